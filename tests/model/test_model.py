"""Tests for llama_train.model: layers against their formulas, decoding, presets, analytic counts."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch
from omegaconf import OmegaConf

from llama_train.model import (
    Attention,
    ModelArgs,
    RMSNorm,
    Transformer,
    apply_rotary_emb,
    count_params,
    flops_per_token,
    list_presets,
    load_preset,
    rope_inv_freq,
    rope_tables,
    sample_next_token,
)
from llama_train.paths import CONFIG_DIR

PUBLISHED = ["llama1_7b", "llama1_13b", "llama1_33b", "llama1_65b", "llama2_7b", "llama2_13b",
             "llama2_70b", "llama3_8b", "llama3_70b", "llama3_1_8b", "llama3_1_70b", "llama3_1_405b",
             "llama3_2_1b", "llama3_2_3b"]


def small_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, multiple_of=32,
                rope_theta=5000.0, max_seq_len=64)
    base.update(kw)
    return ModelArgs(**base)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(args)
    with torch.no_grad():  # non-trivial norm weights so they take part in every comparison
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m.eval()


# ------------------------------------------------------------------ layers


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16) * 4
    want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), want)
    # low-precision input: computed in fp32, returned in the input dtype
    xb = x.bfloat16()
    out = norm.bfloat16()(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("name,hidden", [
    ("llama1_7b", 11008), ("llama1_13b", 13824), ("llama1_33b", 17920), ("llama1_65b", 22016),
    ("llama2_7b", 11008), ("llama2_13b", 13824), ("llama2_70b", 28672),
    ("llama3_8b", 14336), ("llama3_70b", 28672), ("llama3_2_1b", 8192), ("llama3_2_3b", 8192),
])
def test_ffn_hidden_dim_of_published_models(name, hidden):
    assert load_preset(name).ffn_hidden_dim == hidden


def test_published_shapes_and_param_counts():
    # totals as published with the HF checkpoints (e.g. Llama-2-7b-hf: 6,738,415,616)
    want = {"llama2_7b": 6_738_415_616, "llama2_13b": 13_015_864_320, "llama2_70b": 68_976_648_192,
            "llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496,
            "llama3_1_8b": 8_030_261_248, "llama3_1_70b": 70_553_706_496,
            "llama3_1_405b": 405_853_388_800,
            # Llama-3.2-1B/3B (tie_word_embeddings: true): the shared matrix counted once
            "llama3_2_1b": 1_235_814_400, "llama3_2_3b": 3_212_749_824}
    for name, total in want.items():
        assert count_params(load_preset(name))["total"] == total, name
    l3 = load_preset("llama3_8b")
    assert (l3.kv_heads, l3.rope_theta, l3.vocab_size, l3.max_seq_len) == (8, 500000.0, 128256, 8192)
    assert load_preset("llama2_70b").kv_heads == 8 and load_preset("llama1_65b").norm_eps == 1e-6
    # Llama 3.1: Meta's params.json (use_scaled_rope, 128K context); 405B's ffn x1.2 -> 53248
    for name in ("llama3_1_8b", "llama3_1_70b", "llama3_1_405b"):
        a = load_preset(name)
        rs = a.rope_scaling
        assert (rs.type, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                rs.original_max_position_embeddings) == ("llama3", 8.0, 1.0, 4.0, 8192), name
        assert (a.max_seq_len, a.rope_theta, a.kv_heads) == (131072, 500000.0, 8), name
    assert load_preset("llama3_1_405b").ffn_hidden_dim == 53248
    assert load_preset("llama3_8b").rope_scaling.type == "default"


def test_llama3_2_presets_are_tied_and_scale_rope_32x():
    # Meta's params.json for Llama 3.2 1B/3B: use_scaled_rope with factor 32 (3.1: 8), and the
    # output head is the embedding matrix
    for name in ("llama3_2_1b", "llama3_2_3b"):
        a = load_preset(name)
        assert a.tie_embeddings, name
        rs = a.rope_scaling
        assert (rs.type, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                rs.original_max_position_embeddings) == ("llama3", 32.0, 1.0, 4.0, 8192), name
        assert (a.max_seq_len, a.rope_theta, a.kv_heads, a.vocab_size) == (131072, 500000.0, 8, 128256), name
        # untied, the same shapes would add one more vocab x dim matrix
        untied = count_params(replace(a, tie_embeddings=False))["total"]
        assert untied - count_params(a)["total"] == a.vocab_size * a.dim, name
    assert (load_preset("llama3_2_1b").head_dim, load_preset("llama3_2_3b").head_dim) == (64, 128)


def _meta_apply_scaling(freqs: list, factor: float, low: float, high: float, old: int) -> list:
    """Meta's llama3 reference (llama-models, apply_scaling), one frequency at a time."""
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def test_llama3_rope_scaling_equals_metas_reference_and_linear_divides_positions():
    a = load_preset("llama3_1_8b")
    plain = rope_inv_freq(a.head_dim, a.rope_theta).double().tolist()
    rs = a.rope_scaling
    want = _meta_apply_scaling(plain, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                               rs.original_max_position_embeddings)
    got = rope_inv_freq(a.head_dim, a.rope_theta, rs).double().tolist()
    assert got == pytest.approx(want, rel=1e-6)
    # all three bands occur at Llama 3.1's settings: kept, blended, divided by 8
    kept = sum(g == p for g, p in zip(got, plain))
    divided = sum(g == pytest.approx(p / 8, rel=1e-6) for g, p in zip(got, plain))
    assert kept > 0 and divided > 0 and kept + divided < len(got)
    # linear: position p of the scaled table is position p / factor of the plain one
    lin = ModelArgs(rope_scaling={"type": "linear", "factor": 4.0})
    cos, sin = rope_tables(lin.head_dim, 64, lin.rope_theta, scaling=lin.rope_scaling)
    pos = torch.arange(64, dtype=torch.float64)[:, None] / 4
    angles = pos * rope_inv_freq(lin.head_dim, lin.rope_theta).double()[None, :]
    torch.testing.assert_close(cos.double(), angles.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin.double(), angles.sin(), atol=1e-6, rtol=0)
    # and the model uses the scaled tables
    m = Transformer(lin, device="meta")
    m.to_empty(device="cpu")
    m.reset_rope()
    torch.testing.assert_close(m.rope_cos[:64], cos)


def test_rope_score_depends_only_on_relative_offset():
    torch.manual_seed(0)
    hd, theta = 32, 10000.0
    cos, sin = rope_tables(hd, 128, theta)
    q, k = torch.randn(1, 1, 1, hd), torch.randn(1, 1, 1, hd)

    def score(m: int, n: int) -> float:
        qm = apply_rotary_emb(q, cos[m:m + 1], sin[m:m + 1])
        kn = apply_rotary_emb(k, cos[n:n + 1], sin[n:n + 1])
        return float((qm * kn).sum())

    for m, n in [(5, 2), (9, 9), (3, 20)]:
        for shift in (1, 17, 60):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3  # and it does depend on the offset
    # rotation keeps norms, position 0 is the identity
    assert torch.allclose(apply_rotary_emb(q, cos[:1], sin[:1]), q)
    assert apply_rotary_emb(q, cos[7:8], sin[7:8]).norm() == pytest.approx(q.norm().item(), rel=1e-5)


def _rope_by_hand(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Interleaved-pair rotation through complex numbers, the way Meta's reference writes it."""
    hd = x.size(-1)
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    rot = torch.polar(torch.ones(len(pos), hd // 2), torch.outer(pos.float(), freqs))  # (T, hd/2)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], hd // 2, 2))  # (B, T, H, hd/2)
    return torch.view_as_real(xc * rot[:, None, :]).flatten(-2)


def test_attention_without_gqa_matches_hand_written_multi_head_attention():
    args = small_args(n_kv_heads=None)
    torch.manual_seed(0)
    attn = Attention(args)
    B, T, H, hd = 2, 7, args.n_heads, args.head_dim
    x = torch.randn(B, T, args.dim)
    cos, sin = rope_tables(hd, T, args.rope_theta)
    pos = torch.arange(T)
    q = _rope_by_hand((x @ attn.wq.weight.T).view(B, T, H, hd), pos, args.rope_theta).transpose(1, 2)
    k = _rope_by_hand((x @ attn.wk.weight.T).view(B, T, H, hd), pos, args.rope_theta).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(B, T, H, hd).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, H, T, T)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * hd) @ attn.wo.weight.T
    torch.testing.assert_close(attn(x, cos, sin), out, atol=1e-5, rtol=1e-4)


def test_gqa_equals_attention_with_repeated_kv_heads():
    gqa_args = small_args(n_heads=8, n_kv_heads=2)  # 4 query heads per kv head
    torch.manual_seed(0)
    gqa = Attention(gqa_args)
    mha = Attention(replace(gqa_args, n_kv_heads=None))
    rep, hd = 4, gqa_args.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):  # kv head j serves query heads j*rep .. j*rep+rep-1
            w = getattr(gqa, name).weight.view(2, hd, -1)
            getattr(mha, name).weight.copy_(w.repeat_interleave(rep, dim=0).reshape(8 * hd, -1))
    x = torch.randn(2, 9, gqa_args.dim)
    cos, sin = rope_tables(hd, 9, gqa_args.rope_theta)
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ model


def test_forward_shapes_and_loss():
    args = small_args()
    m = build(args)
    x = torch.randint(0, args.vocab_size, (2, 10))
    y = torch.randint(0, args.vocab_size, (2, 10))
    y[0, :4] = -100
    logits = m(x)
    assert logits.shape == (2, 10, args.vocab_size) and logits.dtype == torch.float32
    logits2, loss = m(x, y)
    torch.testing.assert_close(logits2, logits)
    keep = y != -100
    want = -logits.log_softmax(-1)[keep].gather(-1, y[keep][:, None]).mean()
    torch.testing.assert_close(loss, want)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, args.max_seq_len + 1, dtype=torch.long))


def test_causality_future_tokens_do_not_change_past_logits():
    args = small_args()
    m = build(args)
    x = torch.randint(0, args.vocab_size, (1, 16))
    x2 = x.clone()
    x2[0, 10] = (x[0, 10] + 1) % args.vocab_size
    a, b = m(x), m(x2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4


def test_kv_cache_decoding_equals_full_forward():
    args = small_args()
    m = build(args)
    x = torch.randint(0, args.vocab_size, (3, 20))
    full = m(x)
    cache = m.new_kv_cache(batch_size=3, max_len=20)
    # a prefill, a chunk after a prefix (needs the offset causal mask), then single tokens
    chunks = [(0, 6), (6, 11)] + [(i, i + 1) for i in range(11, 20)]
    parts = [m(x[:, s:e], start_pos=s, kv_cache=cache) for s, e in chunks]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="exceed"):
        m(x[:, :1], start_pos=20, kv_cache=cache)


def test_greedy_generate_equals_argmax_of_full_forward():
    args = small_args()
    m = build(args)
    prompt = torch.randint(0, args.vocab_size, (2, 5))
    out = m.generate(prompt, max_new_tokens=12)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    logits = m(out[:, :-1])
    torch.testing.assert_close(out[:, 5:], logits[:, 4:].argmax(-1), rtol=0, atol=0)


def test_generate_ragged_prompts_match_single_prompts_and_stop_at_eos():
    args = small_args()
    m = build(args)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [3]]
    out = m.generate(prompts, max_new_tokens=4, pad_id=0)
    assert out.shape == (3, 6 + 4)
    for i, p in enumerate(prompts):
        alone = m.generate(torch.tensor([p]), max_new_tokens=4)[0]
        assert out[i, : len(p) + 4].tolist() == alone.tolist()
        assert (out[i, len(p) + 4:] == 0).all()
    # stop: make the first greedy token the eos id -> one step, then cut short
    first = m.generate(torch.tensor([prompts[0]]), max_new_tokens=1)[0, -1].item()
    out = m.generate(torch.tensor([prompts[0]]), max_new_tokens=10, eos_id=first)
    assert out.tolist() == [prompts[0] + [first]]


def test_sampling_draws_only_allowed_tokens():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50).repeat(4000, 1)  # (N, V): many draws from one distribution
    order = logits[0].argsort(descending=True)
    top_k = sample_next_token(logits, temperature=1.0, top_k=5, generator=g)
    assert set(top_k.tolist()) <= set(order[:5].tolist())
    assert len(set(top_k.tolist())) > 1  # it samples, not argmax
    # nucleus: the smallest prefix of the sorted distribution whose mass reaches p
    probs = logits[0].softmax(-1)[order]
    n_keep = int((probs.cumsum(0) < 0.6).sum()) + 1
    top_p = sample_next_token(logits, temperature=1.0, top_p=0.6, generator=g)
    assert set(top_p.tolist()) <= set(order[:n_keep].tolist())
    assert len(set(top_p.tolist())) == n_keep  # every allowed token turns up in 4000 draws
    assert sample_next_token(logits[:2], temperature=0.0).tolist() == [order[0].item()] * 2
    with pytest.raises(ValueError, match="top_p"):
        sample_next_token(logits, temperature=1.0, top_p=0.0)


def test_generate_sampling_is_reproducible_with_generator():
    args = small_args()
    m = build(args)
    prompt = torch.tensor([[1, 2, 3]])
    a = m.generate(prompt, 8, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(1))
    b = m.generate(prompt, 8, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    greedy = m.generate(prompt, 8)
    assert torch.equal(m.generate(prompt, 8, temperature=1.0, top_k=1), greedy)


def test_activation_checkpointing_gives_same_loss_and_grads():
    args = small_args()
    x = torch.randint(0, args.vocab_size, (2, 12))
    y = torch.randint(0, args.vocab_size, (2, 12))
    results = []
    for ckpt in (False, True):
        m = build(replace(args, activation_checkpointing=ckpt)).train()
        _, loss = m(x, y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], msg=n)


# ------------------------------------------------------------------ init, meta device, tying


def test_init_std_and_scaled_residual_projections():
    args = ModelArgs(dim=256, n_layers=8, n_heads=4, vocab_size=512, multiple_of=64, init_std=0.02)
    torch.manual_seed(0)
    m = Transformer(args)
    res = 0.02 / math.sqrt(2 * 8)
    assert m.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert m.output.weight.std().item() == pytest.approx(0.02, rel=0.05)
    layer = m.layers[3]
    for lin in (layer.attention.wq, layer.attention.wk, layer.feed_forward.w1, layer.feed_forward.w3):
        assert lin.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for lin in (layer.attention.wo, layer.feed_forward.w2):
        assert lin.weight.std().item() == pytest.approx(res, rel=0.05)
    assert all(bool((n.weight == 1).all()) for n in (layer.attention_norm, layer.ffn_norm, m.norm))


def test_meta_device_build_then_materialise():
    args = small_args(tie_embeddings=True)
    with torch.device("meta"):
        m = Transformer(args)
    assert m.tok_embeddings.weight.is_meta
    m.to_empty(device="cpu")
    m.init_weights()
    assert m.output.weight is m.tok_embeddings.weight  # to_empty unties, init_weights re-ties
    x = torch.randint(0, args.vocab_size, (1, 8))
    assert torch.isfinite(m(x)).all()
    assert "rope_cos" not in m.state_dict() and "rope_sin" not in m.state_dict()
    ref = build(args, seed=3)
    torch.testing.assert_close(ref.rope_cos, m.rope_cos)


def test_init_depends_on_seed_and_name_only():
    """What ZeRO-3 relies on: each parameter initialised alone (gathered from its partitions)
    equals the same parameter of a whole-model build; bf16 gets the fp32 values rounded once."""
    args = small_args()
    whole = Transformer(args, device="meta")
    whole.to_empty(device="cpu")
    whole.init_weights(seed=7)
    again = Transformer(args)
    again.init_weights(seed=7)
    one_by_one = Transformer(args)
    for name, p in reversed(list(one_by_one.named_parameters())):
        one_by_one.init_param(name, p, seed=7)
    half = Transformer(args).to(torch.bfloat16)
    half.init_weights(seed=7)
    other = Transformer(args)
    other.init_weights(seed=8)
    for name, p in whole.named_parameters():
        assert torch.equal(p, dict(again.named_parameters())[name]), name
        assert torch.equal(p, dict(one_by_one.named_parameters())[name]), name
        assert torch.equal(p.to(torch.bfloat16), dict(half.named_parameters())[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(p, dict(other.named_parameters())[name]), name


def test_tied_embeddings_share_one_matrix():
    args = small_args(tie_embeddings=True)
    m = build(args)
    assert m.output.weight is m.tok_embeddings.weight
    m2 = Transformer(args)
    m2.load_state_dict(m.state_dict())
    x = torch.randint(0, args.vocab_size, (1, 6))
    torch.testing.assert_close(m2.eval()(x), m(x))


@pytest.mark.parametrize("tied", [False, True])
def test_count_params_matches_module_for_every_preset(tied):
    names = list_presets()
    assert set(PUBLISHED + ["tiny", "small"]) <= set(names)
    for name in names:
        args = replace(load_preset(name), tie_embeddings=tied)
        with torch.device("meta"):
            m = Transformer(args)
        real = sum(p.numel() for p in m.parameters())  # shared parameters counted once
        c = count_params(args)
        assert c["total"] == real, name
        assert c["embedding"] == m.tok_embeddings.weight.numel()
        assert c["non_embedding"] == real - m.tok_embeddings.weight.numel()


def test_flops_per_token_counts_every_matmul_weight():
    for name in ("tiny", "llama3_8b"):
        args = load_preset(name)
        with torch.device("meta"):
            m = Transformer(args)
        n_matmul = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
        want = 6 * n_matmul + 12 * args.n_layers * args.dim * 1024
        assert flops_per_token(args, 1024) == want
    assert 6 * count_params(load_preset("llama2_7b"))["total"] < flops_per_token(load_preset("llama2_7b"), 4096)


def test_preset_sizes():
    assert 1e6 <= count_params(load_preset("tiny"))["total"] <= 5e6
    assert 15e6 <= count_params(load_preset("small"))["total"] <= 40e6
    assert load_preset("tiny").vocab_size == 2048 and load_preset("small").vocab_size == 8192


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("kw,field", [
    (dict(dim=100, n_heads=3), "model.n_heads"),
    (dict(dim=96, n_heads=32), "head_dim"),  # head_dim 3 is odd
    (dict(n_heads=4, n_kv_heads=3), "model.n_kv_heads"),
    (dict(dim=0), "model.dim"),
    (dict(n_layers=2.0), "model.n_layers"),
    (dict(vocab_size=-1), "model.vocab_size"),
    (dict(norm_eps=0.0), "model.norm_eps"),
    (dict(rope_theta=-1.0), "model.rope_theta"),
    (dict(ffn_dim_multiplier=0.0), "model.ffn_dim_multiplier"),
    (dict(multiple_of=0), "model.multiple_of"),
    (dict(max_seq_len=0), "model.max_seq_len"),
    (dict(init_std="big"), "model.init_std"),
    (dict(tie_embeddings="yes"), "model.tie_embeddings"),
    (dict(rope_scaling={"type": "yarn"}), "model.rope_scaling.type"),
    (dict(rope_scaling={"type": "linear", "factor": 0.5}), "model.rope_scaling.factor"),
    (dict(rope_scaling={"type": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 4.0}),
     "model.rope_scaling.high_freq_factor"),
    (dict(rope_scaling={"type": "llama3", "original_max_position_embeddings": 0}),
     "model.rope_scaling.original_max_position_embeddings"),
    (dict(rope_scaling={"type": "llama3", "scale": 8}), "model.rope_scaling.scale"),
])
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelArgs(**kw)


def test_dim_heads_message_says_how_to_fix():
    with pytest.raises(ValueError) as e:
        ModelArgs(dim=100, n_heads=3)
    assert "model.dim=100" in str(e.value) and "choose n_heads that divides dim" in str(e.value)


def test_every_yaml_lists_exactly_the_model_args_fields():
    files = sorted((CONFIG_DIR / "model").glob("*.yaml"))
    assert len(files) >= 11
    want = {f.name for f in fields(ModelArgs)}
    for f in files:
        cfg = OmegaConf.load(f)
        assert set(cfg.keys()) == want, f.name
        args = ModelArgs.from_dict(cfg)
        # only Llama 3.2 (1B, 3B) shares its output head with the embedding, as Meta released it
        assert args.tie_embeddings == f.stem.startswith("llama3_2_"), f.name
        assert not args.activation_checkpointing and args.init_std == 0.02
        assert f.read_text().startswith("#"), f"{f.name} needs a source comment"


def test_load_preset_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dim: 64\nn_head: 4\n")
    with pytest.raises(ValueError, match="model.n_head"):
        load_preset(bad)
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*tiny"):
        load_preset("nope")
    good = tmp_path / "good.yaml"
    good.write_text("dim: 64\nn_heads: 4\nnorm_eps: 1e-6\n")
    assert load_preset(str(good)) == ModelArgs(dim=64, n_heads=4, norm_eps=1e-6)
