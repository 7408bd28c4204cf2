"""Document masking of packed windows (``Transformer.forward(..., doc_ids=...)``): a document
packed after another scores exactly as it does alone, and nothing changes without ``doc_ids``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llama_train.model import transformer as model_mod
from llama_train.model import ModelArgs, Transformer, document_ids, document_mask

EOS = 2
TOL = 1e-5


def tiny_args(**kw) -> ModelArgs:
    # init_std 0.1 (not 0.02): peaked attention, so a leak across documents shows in the logits
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32,
                max_seq_len=64, init_std=0.1)
    base.update(kw)
    return ModelArgs(**base)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(args, seed=seed)
    with torch.no_grad():  # non-trivial norm weights so they take part in every comparison
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m.eval()


def doc(n: int, gen: torch.Generator, eos: bool = True) -> torch.Tensor:
    """n random tokens (never EOS), the last one EOS if ``eos``."""
    t = torch.randint(3, 300, (n,), generator=gen)
    if eos:
        t[-1] = EOS
    return t


def packed_example():
    """Row 0: A (10, EOS) + B (13, EOS) + C (9, no EOS); row 1: B + A2 (19, no EOS).
    Returns (window (2, 32), B, B's start in each row)."""
    g = torch.Generator().manual_seed(1)
    a, b, c, a2 = doc(10, g), doc(13, g), doc(9, g, eos=False), doc(19, g, eos=False)
    window = torch.stack([torch.cat([a, b, c]), torch.cat([b, a2])])  # (2, 32)
    return window, b, (10, 0)


def internal_targets(tokens: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """(T,) targets: -100 except positions start .. start+n-2, which predict the next token of
    the same document (the first token of a document is predicted from the previous EOS, not
    from its own document, so it is not among them)."""
    t = torch.full_like(tokens, -100)
    t[start:start + n - 1] = tokens[start + 1:start + n]
    return t


# ------------------------------------------------------------------ document_ids / mask


def test_document_ids_hand_example():
    tokens = torch.tensor([[5, 2, 7, 8, 2, 2, 9],
                           [2, 4, 4, 4, 4, 4, 2],
                           [6, 6, 6, 6, 6, 6, 6]])
    want = torch.tensor([[0, 0, 1, 1, 1, 2, 3],
                         [0, 1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0, 0]])
    got = document_ids(tokens, eos_id=2)
    assert got.dtype == torch.long
    assert torch.equal(got, want)


def test_document_mask_hand_example():
    ids = torch.tensor([[0, 0, 1, 1]])
    m = document_mask(ids)
    assert m.shape == (1, 1, 4, 4) and m.dtype == torch.float32
    allowed = torch.tensor([[1, 0, 0, 0],
                            [1, 1, 0, 0],
                            [0, 0, 1, 0],
                            [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m[0, 0] == 0, allowed)
    assert torch.isneginf(m[0, 0][~allowed]).all()
    assert document_mask(ids, dtype=torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------ packed == alone


@pytest.mark.parametrize("n_kv_heads", [2, None], ids=["gqa", "mha"])
def test_packed_document_scores_as_if_alone(n_kv_heads):
    m = build(tiny_args(n_kv_heads=n_kv_heads))
    window, b, starts = packed_example()
    n = b.numel()
    with torch.no_grad():
        alone = m(b[None])[0]  # (n, V), B at positions 0..n-1
        masked = m(window, doc_ids=document_ids(window, EOS))  # (2, 32, V)
        plain = m(window)
    for row, s in enumerate(starts):
        torch.testing.assert_close(masked[row, s:s + n], alone, rtol=0, atol=TOL)
        # per-token losses over B's own targets
        tgt = internal_targets(window[row], s, n)
        keep = tgt != -100
        got = F.cross_entropy(masked[row][keep], tgt[keep], reduction="none")
        want = F.cross_entropy(alone[:-1], b[1:], reduction="none")
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    # Without doc_ids B (after A in row 0) attends to A: the test above can fail.
    assert (plain[0, 10:10 + n] - alone).abs().max() > 1e-2
    # Row 1 starts with B: causal attention alone already isolates it.
    torch.testing.assert_close(plain[1, :n], alone, rtol=0, atol=TOL)


def test_packed_gradients_equal_alone():
    m = build(tiny_args())
    window, b, starts = packed_example()
    n = b.numel()
    tgt = torch.stack([internal_targets(window[r], s, n) for r, s in enumerate(starts)])
    tgt[1] = -100  # B's loss once, from row 0 (after A)

    def grads(tokens, targets, **kw):
        m.zero_grad(set_to_none=True)
        _, loss = m(tokens, targets, **kw)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}

    loss_alone, g_alone = grads(b[None], internal_targets(b, 0, n)[None])
    loss_packed, g_packed = grads(window, tgt, doc_ids=document_ids(window, EOS))
    torch.testing.assert_close(loss_packed, loss_alone, rtol=0, atol=TOL)
    for name, ga in g_alone.items():
        gp = g_packed[name]
        scale = ga.abs().max().item()
        assert scale > 0, name
        err = (gp - ga).abs().max().item()
        assert err <= TOL * max(scale, 1.0), f"{name}: max |diff| {err:.3g} vs max |grad| {scale:.3g}"
    # plain causal attention lets A's tokens into B's loss: different gradients
    _, g_plain = grads(window, tgt)
    assert (g_plain["layers.0.attention.wq.weight"] - g_alone["layers.0.attention.wq.weight"]).abs().max() > 1e-4


def test_full_window_loss_is_sum_of_documents():
    """The packed window's mean loss (every target, the cross-document ones included) equals
    the token-weighted mean of each document scored alone with the EOS before it as context."""
    m = build(tiny_args())
    g = torch.Generator().manual_seed(3)
    a, b = doc(15, g), doc(17, g, eos=False)
    window = torch.cat([a, b])[None]  # (1, 32)
    targets = torch.cat([window[:, 1:], torch.full((1, 1), -100)], dim=1)
    with torch.no_grad():
        _, loss = m(window, targets, doc_ids=document_ids(window, EOS))
        la = F.cross_entropy(m(a[None])[0], torch.cat([a[1:], b[:1]]), reduction="sum")
        lb = F.cross_entropy(m(b[None])[0, :-1], b[1:], reduction="sum")
    torch.testing.assert_close(loss, (la + lb) / 31, rtol=0, atol=TOL)


# ------------------------------------------------------------------ nothing changes without EOS


def test_no_eos_window_is_plain_causal():
    m = build(tiny_args())
    g = torch.Generator().manual_seed(2)
    window = torch.stack([doc(40, g, eos=False), doc(40, g, eos=False)])
    ids = document_ids(window, EOS)
    assert not ids.any()
    with torch.no_grad():
        masked = m(window, doc_ids=ids)
        plain = m(window)
    # Bit-equal on CPU: the mask only adds 0 where causal attention attends and -inf (weight
    # exactly 0) where it does not.
    assert torch.equal(masked, plain)


def test_without_doc_ids_sdpa_call_is_unchanged(monkeypatch):
    """No doc_ids: SDPA gets no mask, is_causal=True and enable_gqa, exactly as before."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append({k: kw.get(k) for k in ("attn_mask", "is_causal", "enable_gqa")})
        return real(*a, **kw)

    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention", spy)
    m = build(tiny_args())
    m(torch.randint(3, 300, (2, 16)))
    assert calls and all(c == {"attn_mask": None, "is_causal": True, "enable_gqa": True}
                         for c in calls)
    calls.clear()
    ids = torch.zeros(2, 16, dtype=torch.long)
    m(torch.randint(3, 300, (2, 16)), doc_ids=ids)
    assert len(calls) == 2 and all(c["attn_mask"] is not None and c["is_causal"] is False
                                   for c in calls)
    assert calls[0]["attn_mask"] is calls[1]["attn_mask"]  # built once, shared by the layers


def test_repeated_kv_path_matches(monkeypatch):
    """The path CUDA takes for a masked GQA call (K/V heads repeated, no enable_gqa), run on CPU."""
    m = build(tiny_args())
    window, b, starts = packed_example()
    ids = document_ids(window, EOS)
    with torch.no_grad():
        want = m(window, doc_ids=ids)
        monkeypatch.setattr(model_mod, "_MASKED_GQA_EXPANDS_KV", ("cpu",))
        got = m(window, doc_ids=ids)
        alone = m(b[None])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    torch.testing.assert_close(got[0, 10:10 + b.numel()], alone, rtol=0, atol=TOL)


# ------------------------------------------------------------------ training paths


@pytest.mark.parametrize("n_kv_heads", [2, None], ids=["gqa", "mha"])
def test_activation_checkpointing_same_loss_and_grads(n_kv_heads):
    window, _, _ = packed_example()
    targets = torch.cat([window[:, 1:], torch.full((2, 1), -100)], dim=1)
    ids = document_ids(window, EOS)
    out = {}
    for ckpt in (False, True):
        m = build(tiny_args(n_kv_heads=n_kv_heads, activation_checkpointing=ckpt)).train()
        _, loss = m(window, targets, doc_ids=ids)
        loss.backward()
        out[ckpt] = (loss.detach(), {k: p.grad for k, p in m.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=0)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=0, atol=1e-7)


def test_bf16_autocast_runs():
    m = build(tiny_args())
    window, _, _ = packed_example()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = m(window, window, doc_ids=document_ids(window, EOS))
    loss.backward()
    assert torch.isfinite(loss)


# ------------------------------------------------------------------ refused


def test_doc_ids_with_kv_cache_refused():
    m = build(tiny_args())
    tokens = torch.randint(3, 300, (1, 8))
    cache = m.new_kv_cache(1, 16)
    with pytest.raises(ValueError, match="doc_ids .* cannot be combined with kv_cache"):
        m(tokens, kv_cache=cache, doc_ids=document_ids(tokens, EOS))


def test_doc_ids_wrong_shape_refused():
    m = build(tiny_args())
    tokens = torch.randint(3, 300, (2, 8))
    with pytest.raises(ValueError, match="doc_ids must have the shape of tokens"):
        m(tokens, doc_ids=torch.zeros(2, 7, dtype=torch.long))


# ------------------------------------------------------------------ the benchmark


def test_docmask_bench_runs(tmp_path, capsys):
    import json

    from llama_train.bench import docmask

    out = tmp_path / "docmask.json"
    docmask.main(["--shapes", "32:16", "--docs", "1,4", "--rounds", "1", "--warmup", "0",
                  "--micro-batch", "2", "--head-dim", "16", "--vocab", "64", "--device", "cpu",
                  "--json", str(out)])
    text = capsys.readouterr().out
    assert "reproduce: " in text and "llama-bench docmask --shapes 32:16" in text
    r = json.loads(out.read_text())
    rows = {row["variant"]: row for row in r["results"][0]["rows"]}
    assert set(rows) == {"causal", "mask/1", "mask/4"}
    assert rows["mask/1"]["attended"] == 1.0 and rows["mask/4"]["attended"] < 1.0
    assert rows["mask/4"]["docs_mean"] == 4.0
    with pytest.raises(SystemExit):
        docmask.parse_args(["--shapes", "256"])
    with pytest.raises(SystemExit):
        docmask.parse_args(["--shapes", "64:8", "--docs", "9", "--head-dim", "16"])


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.slow
def test_through_the_trainer_each_document_scores_as_alone(stage, tmp_path):
    """trainer.document_mask=true through the real trainer and DeepSpeed engine (a world of
    one): the first training batch's loss through the engine equals the token mean of every
    document of it run alone through the same model (1e-5), the step-1 loss the trainer logs is
    that loss, and without the mask it differs."""
    from helpers import cfg_for, step_rows, world_of_one
    from llama_train.data import TrainLoader
    from llama_train.job.preflight import preflight
    from llama_train.job.trainer import start

    import json

    import pydoc_data.topics

    paragraphs = [p for text in pydoc_data.topics.topics.values() for p in text.split("\n\n")
                  if len(p) > 80]  # short documents: several in every 64-token window
    src = tmp_path / "paragraphs.jsonl"
    src.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    with world_of_one():
        pre = preflight(cfg_for(tmp_path / "run", "trainer.document_mask=true",
                                "trainer.max_steps=1", f"deepspeed.zero_stage={stage}",
                                f"data.source={src}", "data.max_documents=null"))
        try:
            tr = start(pre)
            p, eos = pre.plan, tr.eos_id
            assert p.grad_accum == 1
            x, y = next(iter(TrainLoader(pre.prepared.dir, pre.cfg.trainer.seq_len,
                                         p.global_batch, p.micro_batch, seed=pre.cfg.data.seed,
                                         num_workers=0)))
            ids = document_ids(x, eos)
            assert int(ids.max()) >= 1, "the batch should pack several documents"
            tr.engine.eval()
            with torch.no_grad():
                _, packed = tr.engine(x, y, doc_ids=ids)
                _, plain = tr.engine(x, y)
                total, n = 0.0, 0
                for row in range(x.size(0)):
                    for d in ids[row].unique():
                        at = (ids[row] == d).nonzero().flatten()
                        a, b = int(at[0]), int(at[-1]) + 1
                        _, alone = tr.engine(x[row:row + 1, a:b], y[row:row + 1, a:b])
                        total, n = total + alone.double().item() * (b - a), n + (b - a)
            tr.engine.train()
            assert abs(packed.item() - total / n) < TOL, (packed.item(), total / n)
            assert abs(plain.item() - packed.item()) > 10 * TOL  # the mask changes the loss
            tr.fit()
        finally:
            pre.release()
    assert step_rows(tmp_path / "run")[1]["loss"] == pytest.approx(packed.item(), abs=1e-6)
