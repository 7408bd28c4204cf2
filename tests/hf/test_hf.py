"""Parity with Hugging Face transformers' Llama, export/import round trips, tokenizer export."""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from the hub; set before transformers loads
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch

from llama_train.hf import (
    export_hf,
    from_hf_config,
    from_hf_state_dict,
    import_hf,
    import_main,
    to_hf_config,
    to_hf_state_dict,
)
from llama_train.model import ModelArgs, RopeScaling, Transformer, load_preset



class _OnFirstUse:
    """A module imported (or the test skipped) when a test first uses it: transformers takes
    1.2 s to import, which every pytest-xdist worker paid while only collecting this file."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(pytest.importorskip(self._name), attr)


transformers = _OnFirstUse("transformers")
spm = pytest.importorskip("sentencepiece")

# GQA (4 query heads share 2 kv heads), a non-default theta, a non-round ffn size
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=400, multiple_of=48,
                 rope_theta=31337.0, norm_eps=1e-6, max_seq_len=64)


def ours(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(args)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(5)  # larger weights make a wrong RoPE pairing visible in the logits
    return m.eval()


def hf_model(args: ModelArgs):
    cfg = transformers.LlamaConfig(**to_hf_config(args))
    return transformers.LlamaForCausalLM(cfg).eval()


def tokens(args: ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tied", [False, True])
def test_ours_to_hf_logits_match(tied):
    args = replace(ARGS, tie_embeddings=tied)
    m = ours(args)
    hf = hf_model(args)
    hf.load_state_dict(to_hf_state_dict(m.state_dict(), args), strict=not tied)
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x), atol=1e-4, rtol=0)


def test_hf_to_ours_logits_match():
    torch.manual_seed(1)
    hf = hf_model(ARGS)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    m = Transformer(ARGS).eval()
    m.load_state_dict(from_hf_state_dict(hf.state_dict(), ARGS), strict=True)
    x = tokens(ARGS)
    with torch.no_grad():
        torch.testing.assert_close(m(x), hf(x).logits, atol=1e-4, rtol=0)


# head_dim 16 at theta 31337 with an original context of 32: the first pair's wavelength is kept,
# the second blended, the rest divided by factor; 128 tokens reach 4x past the original context
SCALED = {
    "llama3": RopeScaling(type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32),
    "linear": RopeScaling(type="linear", factor=4.0),
}


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_rope_scaling_logits_match_hf_beyond_the_original_context(kind, tmp_path):
    args = replace(ARGS, max_seq_len=128, rope_scaling=SCALED[kind])
    m = ours(args)
    hf = hf_model(args)
    hf.load_state_dict(to_hf_state_dict(m.state_dict(), args), strict=True)
    x = torch.randint(0, args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    plain = ours(replace(args, rope_scaling=RopeScaling()))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x), atol=1e-4, rtol=0)
        # the scaling is live: unscaled RoPE gives other logits from the same weights
        assert (plain(x) - m(x)).abs().max() > 1e-2
    # transformers' own saved config (its version's layout) imports back to the same args,
    # and so does our config.json
    for cfg in (hf.config.to_dict(), to_hf_config(args)):
        back = from_hf_config(cfg)
        assert (back.rope_scaling, back.rope_theta, back.max_seq_len) == (
            args.rope_scaling, args.rope_theta, args.max_seq_len)
        assert back.shape_differences(args) == []
    # llama-export then llama-import carry it: the same function comes back
    export_hf(args, m.state_dict(), tmp_path / "hf")
    back_args, back_sd = import_hf(tmp_path / "hf")
    assert back_args.rope_scaling == args.rope_scaling
    again = Transformer(back_args).eval()
    again.load_state_dict(back_sd)
    with torch.no_grad():
        torch.testing.assert_close(again(x), m(x), atol=1e-5, rtol=0)


# Hugging Face's config.json of meta-llama/Llama-3.2-1B and -3B as published (written out here: nothing
# comes from the hub); the two differ only in these shape keys
_HF_LLAMA3_2 = {
    "llama3_2_1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64},
    "llama3_2_3b": {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128},
}
_HF_LLAMA3_2_COMMON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}


@pytest.mark.parametrize("name", sorted(_HF_LLAMA3_2))
def test_llama3_2_presets_match_the_published_hf_models(name):
    args = load_preset(name)
    # Meta's HF config imports as the preset, params.json recipe (multiple_of, multiplier) included
    assert from_hf_config({**_HF_LLAMA3_2_COMMON, **_HF_LLAMA3_2[name]}) == args
    cfg = to_hf_config(args)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_scaling"] == _HF_LLAMA3_2_COMMON["rope_scaling"]
    assert cfg["rope_parameters"] == {**cfg["rope_scaling"], "rope_theta": 500000.0}
    # full size on the meta device: our export has exactly HF's keys and shapes, lm_head aside
    # (tied: HF's is the embedding, and its checkpoints omit it), and HF counts what we count
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
        m = Transformer(args)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert hf.num_parameters() == sum(p.numel() for p in m.parameters())
    hf_sd, sd = hf.state_dict(), to_hf_state_dict(m.state_dict(), args)
    assert set(hf_sd) - set(sd) == {"lm_head.weight"}
    assert all(sd[k].shape == hf_sd[k].shape for k in sd)


@pytest.mark.parametrize("name", sorted(_HF_LLAMA3_2))
def test_llama3_2_shrunk_logits_match_hf_and_round_trip(name, tmp_path):
    # the preset at test size: its tied head, theta, query/kv-head ratio and llama3 RoPE factors
    # (32, low 1, high 4) kept; width, depth, vocab and context cut. head_dim 16 at theta 500000
    # with an original context of 64: one pair kept, one blended, six divided by 32; 256 tokens
    # reach 4x past the original context
    full = load_preset(name)
    n_heads, kv = full.n_heads // 4, full.kv_heads // 4
    args = replace(full, dim=16 * n_heads, n_layers=2, n_heads=n_heads, n_kv_heads=kv,
                   vocab_size=400, multiple_of=32, max_seq_len=256,
                   rope_scaling=replace(full.rope_scaling, original_max_position_embeddings=64))
    assert args.tie_embeddings and args.rope_scaling.factor == 32.0
    m = ours(args)
    hf = hf_model(args)
    hf.load_state_dict(to_hf_state_dict(m.state_dict(), args), strict=False)  # lm_head: tied
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, args.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    plain = ours(replace(args, rope_scaling=RopeScaling()))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x), atol=1e-4, rtol=0)
        # the scaling is live: unscaled RoPE gives other logits from the same weights
        assert (plain(x) - m(x)).abs().max() > 1e-2
    # HF -> ours on the same model
    back = Transformer(args).eval()
    back.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    assert back.output.weight is back.tok_embeddings.weight
    # llama-export then llama-import: tied and scaled as before, the same function
    out = export_hf(args, m.state_dict(), tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["rope_scaling"]["factor"] == 32.0
    back_args, back_sd = import_hf(out)
    assert back_args.shape_differences(args) == [] and back_args.rope_scaling == args.rope_scaling
    assert replace(back_args, multiple_of=32, ffn_dim_multiplier=args.ffn_dim_multiplier) == args
    again = Transformer(back_args).eval()
    again.load_state_dict(back_sd, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(again(x), m(x), atol=1e-5, rtol=0)


def test_state_dict_conversion_is_an_exact_inverse():
    m = ours(ARGS)
    sd = m.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, ARGS), ARGS)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # the q/k permutation is real (not the identity) and v is untouched
    hf = to_hf_state_dict(sd, ARGS)
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    assert torch.equal(hf["model.layers.0.self_attn.v_proj.weight"], sd["layers.0.attention.wv.weight"])


def test_config_round_trip_recovers_published_ffn_settings():
    for name in ("llama1_7b", "llama1_33b", "llama2_13b", "llama2_70b", "llama3_8b", "llama3_70b",
                 "llama3_1_8b", "llama3_1_70b", "llama3_1_405b", "llama3_2_1b", "llama3_2_3b"):
        args = load_preset(name)
        assert from_hf_config(to_hf_config(args)) == args, name
    for dim, inter in [(64, 100), (64, 5), (128, 384), (4096, 11008), (96, 4096)]:
        cfg = to_hf_config(ModelArgs(dim=dim, n_heads=4))
        cfg["intermediate_size"] = inter
        assert from_hf_config(cfg).ffn_hidden_dim == inter
    # and transformers reads our config.json the way we meant it
    hf_cfg = transformers.LlamaConfig(**to_hf_config(ARGS))
    assert hf_cfg.intermediate_size == ARGS.ffn_hidden_dim and hf_cfg.num_key_value_heads == 2
    assert hf_cfg.rope_parameters["rope_theta"] == ARGS.rope_theta


def test_conversion_errors_are_clear():
    sd = ours(ARGS).state_dict()
    del sd["layers.1.feed_forward.w3.weight"]
    with pytest.raises(ValueError, match=r"missing 1 key\(s\): layers\.1\.feed_forward\.w3\.weight"):
        to_hf_state_dict(sd, ARGS)
    wrapped = {"module." + k: v for k, v in ours(ARGS).state_dict().items()}
    with pytest.raises(ValueError, match="wrapper prefix"):
        to_hf_state_dict(wrapped, ARGS)
    cfg = to_hf_config(ARGS)
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ValueError, match="lacks low_freq_factor, high_freq_factor"):
        from_hf_config(cfg)
    for kind in ("dynamic", "yarn", "longrope"):
        cfg["rope_scaling"] = {"rope_type": kind, "factor": 8.0}
        with pytest.raises(ValueError, match=f"RoPE scaling of type '{kind}'"):
            from_hf_config(cfg)
    with pytest.raises(ValueError, match="model_type"):
        from_hf_config({**to_hf_config(ARGS), "model_type": "gpt2"})


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A ~400-piece byte-fallback BPE trained on the stdlib's pydoc topics (a few tens of KB)."""
    from pydoc_data import topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics)[:15])
    prefix = tmp_path_factory.mktemp("spm") / "sp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(prefix), vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=0.995, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False)
    return prefix.with_suffix(".model"), text


def test_export_loads_in_transformers_with_equal_logits_and_tokenizer(tmp_path, sp_model):
    model_file, text = sp_model
    m = ours(ARGS)
    out = export_hf(ARGS, m.state_dict(), tmp_path / "hf", tokenizer_model=model_file)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.model",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    x = tokens(ARGS)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x), atol=1e-4, rtol=0)

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    rng = random.Random(0)
    samples = ["Hello world", "The assert statement.\nIt   has  runs of spaces\tand tabs.",
               "naïve café 日本語 ☃", "def f(x):\n    return x**2\n", text[:4000],
               "  two leading spaces\tand a tab", " ", "   ", "trailing spaces   ",
               "\tindented\n\t\tcode\n", "emoji 😀🎉 ok", "中文字符测试，句号。", "x\u00a0y",
               "<s> a literal </s> in text", "\r\nwindows\r\n", "\n\nblank lines first"]
    samples += [text[i:i + rng.randint(1, 200)] for i in rng.sample(range(len(text) - 200), 200)]
    # without BOS, as training by default (data.add_bos=false)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for s in samples:
        assert tok(s)["input_ids"] == sp.encode(s), repr(s[:40])
        assert tok.decode(sp.encode(s)) == sp.decode(sp.encode(s)), repr(s[:40])
    # with BOS, as a run with data.add_bos=true trained
    out_bos = export_hf(ARGS, m.state_dict(), tmp_path / "hf_bos", tokenizer_model=model_file,
                        add_bos=True)
    tok = transformers.AutoTokenizer.from_pretrained(out_bos, local_files_only=True)
    for s in samples[:20]:
        assert tok(s)["input_ids"] == [sp.bos_id()] + sp.encode(s), repr(s[:40])
        assert tok.decode(tok(s)["input_ids"], skip_special_tokens=True) == sp.decode(sp.encode(s))
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (sp.bos_id(), sp.eos_id())


def test_import_round_trips_and_reads_shards(tmp_path):
    m = ours(ARGS)
    sd = m.state_dict()
    export_hf(ARGS, sd, tmp_path / "one")
    args, back = import_hf(tmp_path / "one")
    assert args.ffn_hidden_dim == ARGS.ffn_hidden_dim and replace(args, multiple_of=ARGS.multiple_of) == ARGS
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    # sharded: several files plus the index json
    out = export_hf(ARGS, sd, tmp_path / "sharded", max_shard_bytes=200_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    x = tokens(ARGS)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x), atol=1e-4, rtol=0)
    _, back = import_hf(out)
    assert all(torch.equal(back[k], sd[k]) for k in sd)

    # bf16 export is bf16 on disk and says so in config.json
    out = export_hf(ARGS, sd, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, back = import_hf(out)
    assert back["layers.0.attention.wq.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(back["layers.0.attention.wq.weight"].float(), sd["layers.0.attention.wq.weight"],
                               atol=0.05, rtol=0.01)


def test_import_cli_writes_a_loadable_checkpoint(tmp_path):
    args = replace(ARGS, tie_embeddings=True)
    m = ours(args)
    export_hf(args, m.state_dict(), tmp_path / "hf")
    import_main([str(tmp_path / "hf"), str(tmp_path / "ckpt.pt")])
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    loaded = ModelArgs(**ckpt["model_args"])
    assert loaded.tie_embeddings and loaded.ffn_hidden_dim == args.ffn_hidden_dim
    m2 = Transformer(loaded).eval()
    m2.load_state_dict(ckpt["model"], strict=True)
    x = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(m2(x), m(x))
    with pytest.raises(ValueError, match="config.json"):
        import_hf(tmp_path / "nowhere")


def test_export_warns_when_the_tokenizer_normalises_text(tmp_path, caplog):
    from pydoc_data import topics

    spm.SentencePieceTrainer.train(  # sentencepiece's default nmt_nfkc rule, extra spaces removed
        sentence_iterator=iter(topics.topics["assert"].splitlines() * 20), model_prefix=str(tmp_path / "nfkc"),
        vocab_size=300, model_type="bpe", byte_fallback=True, character_coverage=0.99, minloglevel=2)
    with caplog.at_level("WARNING", logger="llama_train.hf"):
        export_hf(ARGS, ours(ARGS).state_dict(), tmp_path / "hf", tokenizer_model=tmp_path / "nfkc.model")
    assert "normalization_rule_name='identity'" in caplog.text
    with pytest.raises(ValueError, match="tokenizer_model"):
        export_hf(ARGS, ours(ARGS).state_dict(), tmp_path / "hf2", tokenizer_model=tmp_path / "missing.model")
