"""The chunked loss (issue 55): ``model.loss_chunk_tokens`` computes the output projection and
the cross-entropy a chunk of tokens at a time, so the whole (tokens, vocab) logits and their
gradient never exist; same loss and gradients as the whole logits (docs/performance.md,
"Chunked loss")."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llama_train.model import (ModelArgs, Transformer, cross_entropy, document_ids,
                               linear_cross_entropy)
from llama_train.model.ops import _LinearCrossEntropy

EOS = 3


def small(**kw) -> ModelArgs:
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, multiple_of=32,
                     max_seq_len=64, **kw)


def batch(seed: int = 0):
    """(3, 37) tokens (111 in all: chunks of 16 and 37 do and do not divide them) with EOS
    inside, so document masking splits rows; targets with ignored (-100) positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 1000, (3, 37), generator=g)
    x[0, 10], x[1, 20], x[1, 30] = EOS, EOS, EOS
    y = torch.randint(0, 1000, (3, 37), generator=g)
    y[0, :5], y[2, -3:] = -100, -100
    return x, y


def run(args: ModelArgs, x, y, chunk: int, doc: bool = False):
    """(logits, loss, {name: grad}) of one forward and backward with ``loss_chunk_tokens=chunk``."""
    m = Transformer(dataclasses.replace(args, loss_chunk_tokens=chunk), seed=1).train()
    kw = {"doc_ids": document_ids(x, EOS)} if doc else {}
    logits, loss = m(x, y, **kw)
    loss.backward()
    return logits, loss.detach(), {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("doc", [False, True])
def test_chunked_loss_and_every_gradient_equal_the_whole_logits(tied, doc):
    args = small(tie_embeddings=tied)
    x, y = batch()
    logits, want, want_grads = run(args, x, y, 0, doc)
    assert logits.shape == (3, 37, 1000)
    for chunk in (16, 37, 111, 4096):  # 7 chunks with a short last one, 3 whole, 1, 1 (> N)
        logits, loss, grads = run(args, x, y, chunk, doc)
        assert logits is None  # the whole logits are never made
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        assert grads.keys() == want_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("eager", [True, False])
def test_gradients_of_the_hidden_states_and_weight_with_any_loss_gradient(eager):
    """Both ways of the function: gradients made in forward and scaled in backward (fp32,
    bf16), or recomputed in backward with the loss gradient applied first (fp16's loss scale)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(50, 32, generator=g, requires_grad=True)  # (N, D)
    w = (0.1 * torch.randn(300, 32, generator=g)).requires_grad_()  # (V, D)
    t = torch.randint(0, 300, (50,), generator=g)
    t[::7] = -100
    ref = cross_entropy(h @ w.t(), t)
    (ref * 2.5).backward()  # a loss scale, or sequence parallelism's share
    want_h, want_w = h.grad.clone(), w.grad.clone()
    for chunk in (7, 50, 64):
        h.grad = w.grad = None
        loss = _LinearCrossEntropy.apply(h, w, t, -100, chunk, torch.float32, eager)
        (loss * 2.5).backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(h.grad, want_h, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w.grad, want_w, rtol=1e-6, atol=1e-6)
    h.grad = None
    linear_cross_entropy(h, w.detach(), t, 16).backward()  # a frozen weight gets no gradient
    assert h.grad is not None


def test_evaluation_and_generation_paths():
    """No grad (evaluation): the same loss, chunked; logits asked for without targets stay whole."""
    args = small()
    x, y = batch()
    whole = Transformer(args, seed=1).eval()
    chunked = Transformer(dataclasses.replace(args, loss_chunk_tokens=16), seed=1).eval()
    with torch.no_grad():
        _, want = whole(x, y)
        logits, loss = chunked(x, y)
        assert logits is None
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(chunked(x), whole(x))
    out = chunked.generate(x[:, :5], 4)
    torch.testing.assert_close(out, whole.generate(x[:, :5], 4))


def test_no_target_gives_nan_like_the_whole_logits_and_finite_zero_gradients():
    """All targets ignored: the mean is 0/0 as before, but the gradients of a zeroed loss are
    zeros, not NaN (what a sequence-parallel rank without targets needs)."""
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    t = torch.full((10,), -100)
    loss = linear_cross_entropy(h, w, t, 4)
    assert torch.isnan(loss) and torch.isnan(cross_entropy(h @ w.t(), t))
    loss.nan_to_num(0.0).backward()
    assert not h.grad.any() and not w.grad.any()


def test_sixteen_bit_precision_as_with_the_whole_logits():
    """A bf16 model (DeepSpeed bf16) and fp32 weights under bf16 autocast: bf16 matmuls, fp32
    softmax, as F.linear + cross_entropy; the output weight's gradient summed chunk by chunk."""
    args = small()
    x, y = batch()
    _, ref, ref_grads = run(args, x, y, 0)  # fp32

    def error(chunk, autocast):
        m = Transformer(dataclasses.replace(args, loss_chunk_tokens=chunk), seed=1)
        m = m.train() if autocast else m.to(torch.bfloat16).train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = m(x, y)
        loss.backward()
        assert loss.dtype == torch.float32
        errs = {n: float((p.grad.float() - ref_grads[n]).norm() / ref_grads[n].norm())
                for n, p in m.named_parameters()}
        return abs(loss.item() - ref.item()), errs

    for autocast in (False, True):
        loss_whole, whole = error(0, autocast)
        loss_chunked, chunked = error(16, autocast)
        assert loss_chunked < 1e-2 and loss_whole < 1e-2
        for name, e in chunked.items():
            assert e < 1.5 * whole[name] + 1e-3, (name, e, whole[name])


def test_backward_twice_is_refused_clearly():
    m = Transformer(small(loss_chunk_tokens=16), seed=1).train()
    x, y = batch()
    _, loss = m(x, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="loss_chunk_tokens"):
        loss.backward()


def test_default_turns_on_from_a_32000_token_vocabulary():
    from llama_train.model import load_preset

    assert ModelArgs(vocab_size=31999).loss_chunk == 0
    assert ModelArgs(vocab_size=32000).loss_chunk == 8192  # 8192 * 32000 * 4 B <= 1 GiB
    assert ModelArgs(vocab_size=128256).loss_chunk == 2048
    assert ModelArgs(vocab_size=256000).loss_chunk == 1024
    assert ModelArgs(vocab_size=128256, loss_chunk_tokens=0).loss_chunk == 0
    assert ModelArgs(vocab_size=100, loss_chunk_tokens=7).loss_chunk == 7
    assert load_preset("llama3_1_8b").loss_chunk == 2048 and load_preset("tiny").loss_chunk == 0
    for bad in (-1, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="model.loss_chunk_tokens"):
            ModelArgs(loss_chunk_tokens=bad)


def test_resume_may_change_it_and_the_hf_export_ignores_it():
    from llama_train import policy
    from llama_train.hf import from_hf_config, to_hf_config
    from llama_train.job.resume import policy_of

    assert policy_of("model.loss_chunk_tokens") == policy.MAY_CHANGE
    args = small(loss_chunk_tokens=16)
    cfg = to_hf_config(args)
    assert cfg == to_hf_config(small()) and not any("chunk" in k for k in cfg)
    assert from_hf_config(cfg).loss_chunk_tokens is None  # an import gets the default


def test_planner_counts_one_chunk_and_model_info_prints_it(capsys):
    from llama_train.model import load_preset
    from llama_train.scaling.cli import main
    from llama_train.scaling.memory import activation_memory, rank_peak_memory

    args = load_preset("llama3_1_8b")
    V, h, s = args.vocab_size, args.dim, 32768
    whole = activation_memory(args, 1, s, "bf16", loss_chunk_tokens=0)
    chunked = activation_memory(args, 1, s, "bf16")
    assert (whole["loss_chunk_tokens"], chunked["loss_chunk_tokens"]) == (0, 2048)
    # whole: the fp32 log-softmax (4 s V) kept and its gradient (4 s V) made: 15.66 GiB each
    assert whole["head"] - chunked["head"] == s * (4 * V + 8) - 2 * V * h
    assert whole["backward_transient"] == 4 * s * V
    assert chunked["backward_transient"] == 2048 * V * (4 + 2)  # one chunk's fp32 + bf16
    saved = (whole["head"] + whole["backward_transient"]) - (chunked["head"] + chunked["backward_transient"])
    assert saved / 2**30 == pytest.approx(28.9, abs=0.05)
    peak = {c: rank_peak_memory(args, 3, 8, "bf16", 1, s, loss_chunk_tokens=c)["total"] for c in (0, None)}
    assert peak[0] - peak[None] == pytest.approx(saved)
    assert main(["model-info", "--model", "llama3_1_8b", "--seq-len", "32768"]) == 0
    assert "loss in chunks of 2048 tokens" in capsys.readouterr().out
    assert main(["model-info", "--model", "llama3_1_8b", "--seq-len", "32768",
                 "--loss-chunk-tokens", "0"]) == 0
    assert "loss over the whole logits" in capsys.readouterr().out


_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from llama_train.metrics.meter import hwm, reset_hwm, rss
    from llama_train.model import ModelArgs, Transformer
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32768, max_seq_len=2048,
                     loss_chunk_tokens=int(sys.argv[1]))
    m = Transformer(args, seed=0).train()
    x = torch.randint(0, 32768, (1, 2048))
    m(x[:, :64], x[:, :64])[1].backward()  # warm up kernels and the gradients' buffers
    base = rss()
    reset_hwm()
    m(x, x)[1].backward()
    print(json.dumps(hwm() - base))
""")


@pytest.mark.slow  # an interpreter of its own (two): not in make test-fast's in-process tier
def test_measured_peak_of_forward_and_backward_shrinks():
    """Peak resident set above the idle one of one forward + backward, 32K vocabulary, 2048
    tokens: whole fp32 logits and gradient are 256 MiB each; a chunk of 256 tokens 32 MiB."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")

    def peak(chunk: int) -> int:
        out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(chunk)], env=env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    whole, chunked = peak(0), peak(256)
    assert whole > 2 * 2048 * 32768 * 4 * 0.9, whole  # logits' log-softmax and gradient
    assert chunked < whole / 4, (chunked, whole)


@pytest.mark.usefixtures("one_rank")
def test_zero3_trains_as_with_the_whole_logits(tmp_path):
    """ZeRO-3 gathers the (tied) output weight for the chunked loss in forward, and its
    gradient reaches the partitions: the losses and the evaluation of 3 steps equal those of the
    whole logits under ZeRO-3, and the first equals ZeRO-0's (a world of one)."""
    from helpers import cfg_for
    from llama_train.train import train

    common = ["trainer.max_steps=3", "trainer.eval_every=3", "model.tie_embeddings=true"]
    runs = {name: train(cfg_for(tmp_path / name, *common, *extra))
            for name, extra in (("z3_chunked", ["deepspeed.zero_stage=3", "model.loss_chunk_tokens=48"]),
                                ("z3_whole", ["deepspeed.zero_stage=3"]),
                                ("z0_chunked", ["model.loss_chunk_tokens=48"]))}
    chunked, whole = runs["z3_chunked"], runs["z3_whole"]
    assert len(chunked["losses"]) == 3
    for step, loss in chunked["losses"].items():
        assert abs(loss - whole["losses"][step]) < 1e-5, (chunked["losses"], whole["losses"])
    assert abs(chunked["val_loss"] - whole["val_loss"]) < 1e-5, (chunked["val_loss"], whole["val_loss"])
    assert abs(chunked["losses"][1] - runs["z0_chunked"]["losses"][1]) < 1e-6
    assert chunked["sample"]
