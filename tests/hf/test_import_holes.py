"""Weights we did not write (issue 54, classes 3 and 4): what ``llama-import``,
``trainer.init_from``, ``llama-generate`` and ``llama-export`` read is checked before it is used.

3. integer or quantized weights (int8, uint8-packed int4, bitsandbytes / GPTQ / FP8 tensors, a
   ``quantization_config``), NaN or inf anywhere, a shape, layer count or vocabulary the config
   does not describe, and a config that claims more than the files hold (80 layers where the
   files hold 2; dims that would need TiB) are refused in one line naming the tensor or key and
   the fix, from the safetensors headers (nothing allocated) where shapes are concerned;
4. every file a model directory reads through its shard index (or a symlink) lies inside it
   (a Hugging Face cache snapshot's ``blobs/`` too): ``../outside.safetensors`` and
   ``/etc/passwd`` are refused naming the entry.

Before, each of these imported silently (an int8 model was trained on as floats, a NaN went into
the .pt), or failed late with a raw error (a KeyError traceback for an index without weight_map).
Small HF directories are written here with safetensors directly; the checkpoint cases tamper
with a 2-step in-process run (ZeRO-0) and rewrite its manifest, as a foreign program would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import cfg_for
from llama_train.config import ConfigError
from llama_train.hf import (check_init_from, import_hf, import_main, read_init_from, to_hf_config,
                            to_hf_state_dict)
from llama_train.model import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16,
                 max_seq_len=64)
UP = "model.layers.1.mlp.up_proj.weight"


def _hf_tensors(args: ModelArgs = ARGS) -> dict:
    torch.manual_seed(0)
    sd = to_hf_state_dict(Transformer(args).state_dict(), args)
    return {k: v.contiguous() for k, v in sd.items()}


def _write(d: Path, tensors: dict, cfg: dict = None, index: dict = None) -> Path:
    """An HF directory: config.json and model.safetensors, or the shards of ``index`` (file ->
    names; weight_map written from it)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg or to_hf_config(ARGS)))
    if index is None:
        save_file(tensors, str(d / "model.safetensors"))
    else:
        for f, names in index.items():
            if ".." not in Path(f).parts:  # a file outside: the test writes it
                save_file({n: tensors[n] for n in names}, str(d / f))
        wm = {n: f for f, names in index.items() for n in names}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return d


def _cli(argv, capsys) -> tuple:
    """llama-import in this process: (exit code, its error lines, stderr)."""
    capsys.readouterr()
    code = 0
    try:
        import_main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if ": error:" in line], err


def _refused(d: Path, tmp_path: Path, capsys, *needles: str) -> str:
    """llama-import refuses ``d`` with exit 3 and one line holding every needle, writes no .pt;
    llama-generate and trainer.init_from (its preflight check, which reads headers only)
    refuse it too. Returns the line."""
    from llama_train.inference.generate import GenerateError, load

    out = tmp_path / f"{d.name}.pt"
    code, errors, err = _cli([d, out], capsys)
    assert code == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    assert not out.exists()
    with pytest.raises(GenerateError) as e:
        load(str(d), tokenizer="unused.model")
    assert all(n in str(e.value) for n in needles), str(e.value)
    with pytest.raises(ConfigError) as e:
        read_init_from(str(d), with_weights=True)
    assert all(n in str(e.value) for n in needles), str(e.value)
    return errors[0]


def test_the_expected_shapes_are_the_models_own(tmp_path):
    """The shapes every check compares with, computed from the config alone, are exactly those
    of the model built from it; an HF directory of such a model (tied embeddings too) passes
    every check of its HF names."""
    from llama_train.model.weights import expected_shapes

    tied = ModelArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=3, vocab_size=300,
                     multiple_of=32, ffn_dim_multiplier=1.3, tie_embeddings=True)
    for args in (ARGS, tied):
        built = {k: tuple(v.shape) for k, v in Transformer(args, device="meta").state_dict().items()}
        assert {k: s for k, (s, _) in expected_shapes(args).items()} == built
    d = _write(tmp_path / "tied", _hf_tensors(tied), to_hf_config(tied))
    args, sd = import_hf(d)
    assert not args.shape_differences(tied) and sd["output.weight"] is sd["tok_embeddings.weight"]


def test_a_good_directory_still_imports(tmp_path, capsys):
    d = _write(tmp_path / "good", _hf_tensors())
    code, errors, err = _cli([d, tmp_path / "good.pt"], capsys)
    assert code == 0, err
    args, sd = read_init_from(str(tmp_path / "good.pt"), with_weights=True)
    assert args == ARGS and sd["layers.1.feed_forward.w3.weight"].shape == (176, 64)


# ------------------------------------------------------------------------------------------------
# 3. integer, quantized, non-finite, misshapen weights and configs that claim more than the files


def _int8(t):
    return (t * 100).round().to(torch.int8)


QUANTIZED = {
    # an int8 model: every weight int8 (the reported case)
    "int8": (lambda sd: {k: _int8(v) for k, v in sd.items()}, ["int8"]),
    # one int8 tensor among floats
    "one_int8": (lambda sd: {**sd, UP: _int8(sd[UP])}, [UP, "int8"]),
    # int4 packed two to a byte
    "uint8_packed": (lambda sd: {**sd, UP: torch.zeros(176, 32, dtype=torch.uint8)},
                     [UP, "uint8"]),
    # bitsandbytes LLM.int8(): int8 weight and its SCB scale vector
    "bitsandbytes": (lambda sd: {**sd, UP: _int8(sd[UP]),
                                 "model.layers.1.mlp.up_proj.SCB": torch.ones(176)},
                     ["model.layers.1.mlp.up_proj.SCB", "quantiz"]),
    # GPTQ: qweight/qzeros/scales/g_idx instead of weight
    "gptq": (lambda sd: {**{k: v for k, v in sd.items() if k != UP},
                         "model.layers.1.mlp.up_proj.qweight": torch.zeros(8, 176, dtype=torch.int32),
                         "model.layers.1.mlp.up_proj.qzeros": torch.zeros(1, 22, dtype=torch.int32),
                         "model.layers.1.mlp.up_proj.scales": torch.ones(1, 176, dtype=torch.float16),
                         "model.layers.1.mlp.up_proj.g_idx": torch.zeros(64, dtype=torch.int32)},
             ["model.layers.1.mlp.up_proj.", "quantiz"]),
    # FP8 (e4m3) weights
    "fp8": (lambda sd: {**sd, UP: sd[UP].to(torch.float8_e4m3fn)}, [UP, "float8_e4m3fn"]),
}


@pytest.mark.parametrize("case", sorted(QUANTIZED))
def test_integer_or_quantized_weights_are_refused(case, tmp_path, capsys):
    change, needles = QUANTIZED[case]
    d = _write(tmp_path / case, change(_hf_tensors()))
    line = _refused(d, tmp_path, capsys, *needles)
    assert "float" in line and "dequantize" in line, line


def test_a_quantization_config_is_refused(tmp_path, capsys):
    cfg = {**to_hf_config(ARGS), "quantization_config": {"quant_method": "awq", "bits": 4}}
    d = _write(tmp_path / "awq", _hf_tensors(), cfg)
    _refused(d, tmp_path, capsys, "quantization_config", "awq", "dequantize")


@pytest.mark.parametrize("where,value", [(UP, float("nan")), ("model.norm.weight", float("inf")),
                                         ("model.embed_tokens.weight", float("-inf"))])
def test_non_finite_weights_are_refused(where, value, tmp_path, capsys):
    sd = _hf_tensors()
    sd[where].view(-1)[-1] = value
    d = _write(tmp_path / "nonfinite", sd)
    _refused(d, tmp_path, capsys, where, "NaN" if value != value else "inf")


def _shrunk(name, rows=None):
    def change(sd):
        t = sd[name]
        return {**sd, name: (t[:rows] if rows else t[..., :-2]).contiguous()}
    return change


SHAPES = {
    "up_proj rows": (_shrunk(UP, 160), [UP, "[160, 64]", "[176, 64]", "intermediate_size"]),
    "k_proj heads": (_shrunk("model.layers.0.self_attn.k_proj.weight", 16),
                     ["model.layers.0.self_attn.k_proj.weight", "num_key_value_heads"]),
    "a norm": (_shrunk("model.layers.1.input_layernorm.weight"),
               ["model.layers.1.input_layernorm.weight", "[62]", "[64]"]),
    "lm_head columns": (_shrunk("lm_head.weight"), ["lm_head.weight", "[256, 62]"]),
    "down_proj columns": (_shrunk("model.layers.0.mlp.down_proj.weight"),
                          ["model.layers.0.mlp.down_proj.weight", "[64, 174]"]),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_every_shape_is_checked_against_the_config(case, tmp_path, capsys):
    change, needles = SHAPES[case]
    d = _write(tmp_path / "shape", change(_hf_tensors()))
    _refused(d, tmp_path, capsys, *needles, "config.json")


def test_a_vocabulary_that_is_not_the_embeddings_is_refused(tmp_path, capsys):
    d = _write(tmp_path / "vocab", _hf_tensors(), {**to_hf_config(ARGS), "vocab_size": 200})
    _refused(d, tmp_path, capsys, "vocab_size=200", "model.embed_tokens.weight", "256 rows",
             "vocab_size=256")


def test_a_tokenizer_larger_than_the_embedding_is_refused(run, tmp_path, capsys):
    """The directory's tokenizer.model has 2048 pieces, its embedding 256 rows."""
    d = _write(tmp_path / "tok", _hf_tensors())
    shutil.copy(run / "tokenizer.model", d / "tokenizer.model")
    _refused(d, tmp_path, capsys, "tokenizer.model", "2,048 tokens", "256 rows")


@pytest.mark.parametrize("key,value,needles", [
    ("num_hidden_layers", 80, ["num_hidden_layers=80", "2 layer(s)", "num_hidden_layers=2"]),
    # 2**17 wide (model.dim's upper bound): 192 GiB of weights where the files hold 0.5 MiB,
    # refused from the headers before any allocation; at every bound at once, PiB
    ("hidden_size", 2**17, ["hidden_size", "GiB", "the files hold"]),
    ("intermediate_size", 60000, ["intermediate_size", "60000", "MiB"]),
    ("everything", 2**17, ["num_hidden_layers=4096", "PiB", "2 layer(s)"]),
])
def test_a_config_that_claims_more_than_the_files_hold_is_refused_before_allocating(
        key, value, needles, tmp_path, capsys):
    cfg = {**to_hf_config(ARGS), key: value}
    if key in ("hidden_size", "everything"):
        cfg.update(hidden_size=value, head_dim=value // ARGS.n_heads)
    if key == "everything":
        cfg.update(num_hidden_layers=2**12, vocab_size=2**32, intermediate_size=2**16)
    d = _write(tmp_path / "claims", _hf_tensors(), cfg)
    _refused(d, tmp_path, capsys, *needles)
    # trainer.init_from: preflight's check (headers only) refuses it before the model is built
    from llama_train.hf import from_hf_config

    with pytest.raises(ConfigError) as e:
        check_init_from(str(d), from_hf_config(cfg))
    assert all(n in str(e.value) for n in needles), str(e.value)


def _pt(tmp_path: Path, change=None, args=ARGS) -> Path:
    """A llama-import file (our names), ``change`` applied to its state dict."""
    from dataclasses import asdict

    torch.manual_seed(0)
    sd = Transformer(ARGS).state_dict()
    sd = change(sd) if change else sd
    p = tmp_path / "imported.pt"
    torch.save({"model_args": asdict(args), "model": sd}, p)
    return p


@pytest.mark.parametrize("case", ["int8", "nan", "80 layers", "wide"])
def test_a_llama_import_file_is_checked_by_init_from_and_generate(case, tmp_path):
    from dataclasses import replace

    from llama_train.inference.generate import GenerateError, load

    w3 = "layers.1.feed_forward.w3.weight"
    if case == "int8":
        p, needles = _pt(tmp_path, lambda sd: {**sd, w3: _int8(sd[w3])}), [w3, "int8"]
    elif case == "nan":
        def nan(sd):
            sd[w3][0, 0] = float("nan")
            return sd
        p, needles = _pt(tmp_path, nan), [w3, "NaN"]
    elif case == "80 layers":
        p, needles = _pt(tmp_path, args=replace(ARGS, n_layers=80)), ["n_layers=80", "2 layer(s)"]
    else:
        p, needles = _pt(tmp_path, args=replace(ARGS, dim=2**17, n_heads=2**11)), ["dim", "GiB"]
    with pytest.raises(GenerateError) as e:
        load(str(p), tokenizer="unused.model")
    assert all(n in str(e.value) for n in needles), str(e.value)
    with pytest.raises(ConfigError) as e:
        read_init_from(str(p), with_weights=True)
    assert all(n in str(e.value) for n in needles) and "trainer.init_from=" in str(e.value)
    if case != "nan":  # shapes and dtypes: from the memory-mapped file, before the group
        with pytest.raises(ConfigError):
            check_init_from(str(p), ModelArgs(**torch.load(p, weights_only=True)["model_args"]))


# a 2-step ZeRO-0 run: its checkpoint tampered with (manifest rewritten) for llama-export


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from helpers import world_of_one
    from llama_train.train import train

    out = tmp_path_factory.mktemp("import_holes") / "run"
    with world_of_one():
        train(cfg_for(out, "deepspeed.zero_stage=0", "trainer.max_steps=2",
                      "trainer.save_every=2", "sample.tokens=0"))
    return out / "checkpoints" / "step_00000002"


@pytest.mark.parametrize("case", ["int8", "nan", "shape"])
def test_export_and_generate_refuse_a_checkpoint_with_bad_weights(run, case, tmp_path, capsys):
    """A checkpoint altered together with its manifest: llama-export and llama-generate refuse
    it (exit 3) naming the tensor, instead of exporting or decoding it."""
    from llama_train.checkpoint import write_manifest
    from llama_train.engine import restricted_loads
    from llama_train.hf import export_main
    from llama_train.inference.generate import GenerateError, load

    ckpt = tmp_path / "step_00000002"
    shutil.copytree(run, ckpt)
    f = ckpt / "ds" / "mp_rank_00_model_states.pt"
    with restricted_loads():
        state = torch.load(f, map_location="cpu")
    name = next(k for k in state["module"] if k.endswith("layers.1.feed_forward.w3.weight"))
    t = state["module"][name]
    state["module"][name] = {"int8": lambda: _int8(t), "shape": lambda: t[:-8].clone(),
                             "nan": lambda: t.clone().fill_(float("nan"))}[case]()
    torch.save(state, f)
    write_manifest(ckpt, checksums=True)

    needles = ["layers.1.feed_forward.w3.weight",
               {"int8": "int8", "nan": "NaN", "shape": "model_args.json"}[case]]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        export_main([str(ckpt), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert e.value.code == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert all(n in errors[0] for n in needles), errors[0]
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    with pytest.raises(GenerateError) as g:
        load(str(ckpt))
    assert all(n in str(g.value) for n in needles), str(g.value)


# ------------------------------------------------------------------------------------------------
# 4. files named by the shard index (or a link) stay inside the model directory


def _two_shards(tensors) -> tuple:
    names = sorted(tensors)
    return names[:10], names[10:]


def test_an_index_entry_outside_the_directory_is_refused(tmp_path, capsys):
    """``../outside.safetensors`` (a valid file beside the model: imported before) and
    ``/etc/passwd`` (opened before): refused naming the entry, neither is read."""
    tensors = _hf_tensors()
    a, b = _two_shards(tensors)
    save_file({n: tensors[n] for n in b}, str(tmp_path / "outside.safetensors"))
    d = _write(tmp_path / "up", tensors, index={"model-00001-of-00002.safetensors": a,
                                                 "../outside.safetensors": b})
    line = _refused(d, tmp_path, capsys, "'../outside.safetensors'", "outside the model directory")
    assert b[0] in line or "the entry for" in line, line

    d = _write(tmp_path / "abs", tensors, index={"model.safetensors": sorted(tensors)})
    wm = json.loads((d / "model.safetensors.index.json").read_text())
    wm["weight_map"][a[0]] = "/etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps(wm))
    _refused(d, tmp_path, capsys, "'/etc/passwd'", f"the entry for {a[0]}",
             "outside the model directory")


def test_a_symlink_out_of_the_directory_is_refused_but_the_hub_cache_layout_imports(tmp_path,
                                                                                    capsys):
    tensors = _hf_tensors()
    a, b = _two_shards(tensors)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_file({n: tensors[n] for n in b}, str(elsewhere / "shard.safetensors"))
    d = _write(tmp_path / "linked", tensors, index={"model-00001-of-00002.safetensors": a})
    (d / "model-00002-of-00002.safetensors").symlink_to(elsewhere / "shard.safetensors")
    wm = json.loads((d / "model.safetensors.index.json").read_text())
    wm["weight_map"].update({n: "model-00002-of-00002.safetensors" for n in b})
    (d / "model.safetensors.index.json").write_text(json.dumps(wm))
    _refused(d, tmp_path, capsys, "model-00002-of-00002.safetensors", str(elsewhere),
             "outside the model directory")

    # ~/.cache/huggingface/hub/models--org--tiny/snapshots/<rev>/: links into ../../blobs/
    repo = tmp_path / "hub" / "models--org--tiny"
    src = _write(tmp_path / "src", tensors)
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for i, f in enumerate(("config.json", "model.safetensors")):
        shutil.copy(src / f, repo / "blobs" / f"blob{i}")
        (snap / f).symlink_to(Path("../../blobs") / f"blob{i}")
    args, sd = import_hf(snap)
    assert args == ARGS and sd.keys() == Transformer(ARGS, device="meta").state_dict().keys()


@pytest.mark.parametrize("index,needle", [
    ({"metadata": {}}, "not a shard index"),
    ({"weight_map": ["model.safetensors"]}, "not a shard index"),
    ({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}, "does not exist"),
    ({"weight_map": {"model.norm.weight": 7}}, "not a file name"),
])
def test_a_broken_index_is_one_line(index, needle, tmp_path, capsys):
    d = _write(tmp_path / "idx", _hf_tensors())
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(d, tmp_path, capsys, "model.safetensors.index.json" if needle != "does not exist"
             else "model-00009-of-00009.safetensors", needle)
