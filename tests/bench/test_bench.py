"""`llama-bench train`, `memory`, `startup` and `checkpoint`: options, the pieces they are built
from, and the memory advice on real ranks (speed thresholds belong to benchmarks, not tests).
Their documented commands run, with their reports checked, in tests/system/test_docs_commands.py."""

from __future__ import annotations

import json

import pytest

from llama_train.bench import memory as mem_bench
from llama_train.bench import peaks
from llama_train.bench import train as train_bench
from llama_train.bench._memory_worker import classify



# `llama-bench train` (the A/B report: ours against Hugging Face in lock step, consistent
# figures) runs as docs/benchmarks-train.md writes it: tests/system/test_docs_commands.py.


def test_train_bench_rejects_bad_options(capsys):
    with pytest.raises(SystemExit, match="--rounds=0 must be >= 1"):
        train_bench.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        train_bench.parse_args(["--override", "data.num_workers"])
    for bad in ("0", "nan", "inf"):
        with pytest.raises(SystemExit, match="--peak-flops"):
            train_bench.parse_args(["--peak-flops", bad])
    with pytest.raises(SystemExit, match="--stages"):
        mem_bench.parse_args(["--stages", "4"])


# ---- MFU's peak: llama-train's own (llama_train.engine.flops.PeakFlops), never a matmul timed here


def _fake_run(step_s: float, logged_peak=None) -> dict:
    """One side's round as read_ours/read_hf return it."""
    return {"step_times": [step_s] * 3, "warmup_step_times": [3.0], "data_wait": [1e-4] * 3,
            "losses": [9.4] * 4, "mem_gb": 1.0, "wall_s": 5.0, "logged_peak_flops": logged_peak}


def _offline_bench(monkeypatch, *argv, logged_peak=None):
    """run_bench on the tiny preset with its runs, loader and model-shape timing faked: what
    is left is how it decides the peak and builds the report. Returns (report, ours' overrides)."""
    import torch

    seen = {}

    def run_round(args, overrides, spec, work, r, env):
        seen["overrides"] = overrides
        return {"ours": _fake_run(0.02, logged_peak),
                "hf": dict(_fake_run(0.04), optimizer="AdamW")}

    monkeypatch.setattr(train_bench, "run_round", run_round)
    monkeypatch.setattr(train_bench, "measure_loader", lambda *a: {"workers=0": 1e-4})
    monkeypatch.setattr(train_bench, "model_shapes_flops", lambda *a: 5e10)
    threads = torch.get_num_threads()
    try:  # the bench's thread count is the session's: the cached peak is per thread count
        args = train_bench.parse_args(
            ["--preset", "tiny", "--seq-len", "64", "--micro-batch", "2", "--steps", "3",
             "--warmup", "1", "--rounds", "1", "--device", "cpu", "--threads", str(threads),
             "--override", "data.max_documents=600", "--override", "data.num_proc=1",
             "--override", "data.num_workers=0", *argv])
        return train_bench.run_bench(args), seen["overrides"]
    finally:
        torch.set_num_threads(threads)


def test_train_bench_mfu_uses_the_datasheet_peak_on_an_h200(monkeypatch):
    """On an H200 the bench timed a square 1024^3 matmul (43.7 TFLOP/s, first-call overhead)
    and printed MFU 1176%; llama-train divides by the datasheet's 989 TFLOP/s, and so must the
    bench, saying so. The device is faked: a CUDA device whose name is an H200's."""
    import argparse
    import os

    import torch

    from llama_train.bench.report import build_report, format_table
    from llama_train.model import load_preset

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak = peaks.mfu_peak("cuda", "bf16", torch.get_num_threads())
    assert (peak.value, peak.kind) == (989e12, "datasheet") and "H200" in peak.source
    args = argparse.Namespace(preset="x", micro_batch=16, seq_len=2048, precision="bf16",
                              zero_stage=0, compile=False, steps=3, warmup=1, rounds=1,
                              interleave="step", override=[], threads=16, peak_flops=None)
    fpt = 6.74e9
    r = build_report(args, "llama-bench train", "cuda", "bf16", load_preset("tiny"), fpt, peak,
                     [7.346e14], [_fake_run(0.4299)], [], {"workers=0": 1e-4}, 0,
                     [(0.0, 0.0, 0.0)] * 2)
    assert r["peak_flops"]["value"] == 989e12 and r["peak_flops"]["kind"] == "datasheet"
    tps = 16 * 2048 / 0.4299
    assert r["ours"]["mfu"] == pytest.approx(fpt * tps / 989e12)  # 51.9%, not 1176%
    assert r["ours"]["mfu_vs_model_shapes"] == pytest.approx(fpt * tps / 7.346e14)
    table = format_table(r)
    assert "MFU peak 989000.0 GFLOP/s (llama-train's; datasheet: datasheet bf16 dense, " \
           "NVIDIA H200)" in table and "model-shape matmuls 734600.0 GFLOP/s" in table
    assert " 51.9% " in table and "above 100%" not in table
    json.dumps(r)  # --json writes it


def test_train_bench_peak_flops_option_is_used_as_given(monkeypatch):
    """--peak-flops is trainer.peak_flops: the bench's MFU and ours' own log divide by it."""
    r, overrides = _offline_bench(monkeypatch, "--peak-flops", "2e9", logged_peak=3e9)
    assert (r["peak_flops"]["value"], r["peak_flops"]["kind"]) == (2e9, "override")
    assert "trainer.peak_flops=2000000000.0" in overrides  # ours gets it too
    assert r["ours"]["mfu"] == pytest.approx(r["flops_per_token"] * 128 / 0.02 / 2e9)
    assert "--peak-flops 2000000000.0" in r["command"]
    table = train_bench.format_table(r)
    assert "MFU peak 2.0 GFLOP/s (llama-train's; override: trainer.peak_flops)" in table
    # ours' run_info.json said another figure: the table says its logged mfu differs
    assert "llama-train's own log (run_info.json) used a peak of 3e+09" in table


def test_train_bench_peak_on_cpu_is_llama_trains_cached_measurement(monkeypatch):
    """With neither option nor a known GPU, the peak is the one llama-train logs on this
    machine: the matmul measured once and cached per thread count (not re-timed per round)."""
    import torch

    from llama_train.engine import flops

    r, overrides = _offline_bench(monkeypatch)
    assert not any(o.startswith("trainer.peak_flops") for o in overrides)
    want = flops.PeakFlops(torch.device("cpu"), "fp32", 1)
    assert r["peak_flops"]["value"] == want.value and r["peak_flops"]["kind"] == "measured"
    assert r["peak_flops"]["source"] == want.source and "cached in" in want.source
    assert r["ours"]["mfu"] == pytest.approx(r["flops_per_token"] * 128 / 0.02 / want.value)
    assert r["peak_flops"]["model_shapes"] == 5e10
    assert "note:" not in train_bench.format_table(r)


def test_model_matmul_mix_covers_every_matmul_weight():
    """The shaped-peak mix has one entry per matmul weight: its FLOPs are the 6*N_matmul part
    of flops_per_token."""
    from llama_train.model import flops_per_token, load_preset

    args = load_preset("small")
    n = sum(fin * fout * count for fin, fout, count in peaks.linear_shapes(args))
    attention = 12 * args.n_layers * args.dim * 256
    assert 6 * n + attention == flops_per_token(args, 256)


@pytest.mark.parametrize("tied, decay_norms", [(False, False), (True, False), (False, True)])
def test_hf_optimizer_decays_what_llama_train_decays(tied, decay_norms):
    """The HF side's AdamW groups come from llama_train.job.optim's rule on our parameter names."""
    import dataclasses

    from llama_train.bench.hf_baseline import build_hf_model, make_adamw
    from llama_train.config import OptimConfig
    from llama_train.job.optim import param_groups
    from llama_train.model import Transformer, load_preset

    margs = dataclasses.replace(load_preset("tiny"), tie_embeddings=tied)
    cfg = OptimConfig(weight_decay=0.05, decay_norms_and_biases=decay_norms)
    opt, kind = make_adamw(build_hf_model(margs, 0), margs, cfg)
    ours = param_groups(Transformer(margs), cfg)

    def shapes(groups):
        return [(g["weight_decay"], sorted(tuple(p.shape) for p in g["params"])) for g in groups]

    assert shapes(opt.param_groups) == shapes(ours)
    assert "AdamW" in kind


def test_lockstep_hook_takes_a_turn_around_each_step(monkeypatch):
    import os

    from llama_train.bench.lockstep import Turns, TurnsHook

    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    monkeypatch.setenv(Turns.ENV, f"{go_r},{done_w}")
    hook = TurnsHook(Turns())
    os.write(go_w, b"gg")  # the bench's go for two steps
    for step in (1, 2):
        hook.on_step_begin(step)
        hook.on_step_end(step, {})
    os.close(done_w)
    assert os.read(done_r, 16) == b"rdd"  # ready once, then done after each step
    for fd in (go_r, go_w, done_r):
        os.close(fd)


def test_ours_step_times_come_from_metrics_as_logged(tmp_path):
    args = train_bench.parse_args(["--steps", "2", "--warmup", "1"])
    rows = [{"step": s, "loss": 5.0 - s, "step_time_s": 0.1 * s, "data_wait_s": 0.01 * s,
             "mem_gb": 1.0} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = train_bench.read_ours(args, tmp_path, wall=9.0)
    assert got["step_times"] == pytest.approx([0.2, 0.3])
    assert got["warmup_step_times"] == pytest.approx([0.1])
    assert got["data_wait"] == pytest.approx([0.02, 0.03])
    assert got["losses"] == [4.0, 3.0, 2.0]
    for r in rows:
        del r["data_wait_s"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RuntimeError, match="data_wait_s"):
        train_bench.read_ours(args, tmp_path, wall=9.0)


def test_storage_paths_are_classified():
    assert classify("module.layers.0.attention.wq.weight") == "params"
    assert classify("module.layers.0.attention.wq.weight.grad") == "grads"
    assert classify("master[0][0]") == "fp32_master"
    assert classify("optimizer.optimizer.state[3].exp_avg") == "adam_moments"
    assert classify("optimizer.ipg_buffer[0]") == "buckets"
    assert classify("optimizer.grads_in_partition[0]") == "grads"
    assert classify("optimizer.bit16_groups_flat[0]") == "params"


# `llama-bench memory --preset tiny ... --stages 3 --precision fp32` (ZeRO-3's optimizer state
# within 10% of the planner's) runs as documented: tests/system/test_docs_commands.py.


def test_memory_bench_skips_what_cannot_fit(monkeypatch, capsys):
    """A point whose predicted N x (idle + peak) exceeds the RAM share is listed, not run."""
    monkeypatch.setattr(mem_bench, "mem_available", lambda: 2**30)  # 1 GiB
    monkeypatch.setattr(mem_bench, "run_point", lambda *a: pytest.fail("must not launch"))
    args = mem_bench.parse_args(["--preset", "llama2_7b", "--stages", "3", "--nprocs", "8",
                                 "--seq-len", "64"])
    r = mem_bench.run(args)
    (row,) = r["rows"]
    assert row["status"] == "skipped" and "idle" in row["reason"] and row["predicted"] > 2**30
    assert "skipped" in mem_bench.format_table(r)
    with pytest.raises(SystemExit):
        mem_bench.parse_args(["--stages", "4"])
    with pytest.raises(SystemExit):
        mem_bench.parse_args(["--dim", "64"])  # a shape needs --n-layers and --n-heads too


@pytest.mark.slow
def test_gpu_mem_advice_holds_on_cpu_ranks(tmp_path):
    """llama-plan's fit advice, checked by measurement on 2 CPU ranks: with a limit between the
    predicted peaks of ZeRO-0 and ZeRO-1 (small model, bf16), ZeRO-0 does not fit and the advice
    is the next stage; the real ZeRO-0 run measures above the limit, the advised one below.
    ``llama-bench memory`` runs forked from the warm parent, and so do the DeepSpeed launches it
    measures (tests/warm_ranks.py: each rank's peak is read above its own idle baseline)."""
    from helpers import BIN, run

    from llama_train.model import ModelArgs
    from llama_train.scaling import fit_advice, rank_peak_memory

    shape = ["--dim", "512", "--n-layers", "4", "--n-heads", "8", "--vocab", "8192"]
    margs = ModelArgs(dim=512, n_layers=4, n_heads=8, vocab_size=8192, max_seq_len=64)
    cfg = dict(zero_stage=0, world_size=2, dtype="bf16", micro_batch=1, seq_len=64, device="cpu")
    z0 = rank_peak_memory(margs, **cfg)["total"]
    z1 = rank_peak_memory(margs, **dict(cfg, zero_stage=1))["total"]
    limit = (z0 * z1) ** 0.5
    advice = fit_advice(margs, limit, **cfg)
    assert not advice["fits"] and advice["suggestion"]["change"] == "higher ZeRO stage (ZeRO-1)"
    advised = advice["suggestion"]["settings"]
    out = tmp_path / "mem.json"
    run([str(BIN / "llama-bench"), "memory", *shape, "--stages", f"0,{advised['zero_stage']}",
         "--nprocs", "2", "--json", str(out)], tmp_path / "bench.log", warm=True)
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["0"]["peak_above_idle"] > limit, (rows["0"]["peak_above_idle"], limit)
    assert rows[str(advised["zero_stage"])]["peak_above_idle"] < limit
    for r in rows.values():  # and the planner is within 10% of both
        assert r["ratio"] == pytest.approx(1.0, abs=0.10), r


# ---- the perf edits in llama_train.model keep the numbers ------------------------------------


def _rope_reference(x, cos, sin):
    """The plain real-arithmetic rotation of interleaved pairs."""
    import torch

    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2).type_as(x)


def test_complex_rope_equals_real_arithmetic_for_any_layout():
    import torch

    from llama_train.model import apply_rotary_emb, rope_tables

    cos, sin = rope_tables(8, 5, 10000.0)
    base = torch.randn(2, 5, 3, 9, generator=torch.Generator().manual_seed(0))
    odd_offset = base[..., 1:]  # pairs straddle complex boundaries: must be copied first
    transposed = torch.randn(2, 3, 5, 8).transpose(1, 2)  # (B, T, H, hd) view, not contiguous
    for x in (base[..., :8].contiguous(), odd_offset, transposed, base[..., :8].bfloat16()):
        out = apply_rotary_emb(x, cos, sin)
        assert out.dtype == x.dtype and out.shape == x.shape
        torch.testing.assert_close(out, _rope_reference(x, cos, sin), atol=1e-6, rtol=1e-6)


def test_cross_entropy_matches_torch_in_value_and_gradient():
    import torch
    import torch.nn.functional as F

    from llama_train.model import cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(37, 50, generator=g)).requires_grad_()
    targets = torch.randint(0, 50, (37,), generator=g)
    targets[::5] = -100  # ignored positions count neither in the mean nor in the gradient
    ours = cross_entropy(logits, targets)
    (g_ours,) = torch.autograd.grad(2.5 * ours, logits)
    ref = F.cross_entropy(logits, targets, ignore_index=-100)
    (g_ref,) = torch.autograd.grad(2.5 * ref, logits)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-7, rtol=1e-5)
    assert g_ours[::5].abs().max() == 0
    with torch.no_grad():  # evaluation takes torch's own path
        torch.testing.assert_close(cross_entropy(logits, targets), ref.detach())


def test_startup_bench_options(tmp_path):
    """The bench times the tests' tiny run and refuses bad options; its run is checked where
    docs/benchmarks-startup.md's command runs (tests/system/test_docs_commands.py)."""
    from helpers import TINY as TEST_TINY

    from llama_train.bench import startup

    assert startup.TINY == TEST_TINY  # the bench times the tests' tiny run
    with pytest.raises(SystemExit, match="--rounds=0 must be >= 1"):
        startup.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit, match="no llama_train/train.py"):
        startup.parse_args(["--baseline", str(tmp_path)])


# `llama-bench checkpoint` (blocked and durable seconds of each save, from real records) runs
# as documented in docs/benchmarks-checkpoint.md: tests/system/test_docs_commands.py.


def test_train_bench_json_keeps_the_old_peak_keys_with_a_deprecation_note():
    """Readers of reports from before 2026-11-28 find ``peak_flops.square_1024*`` still there
    (the MFU denominator under its old names) and a ``deprecated`` map naming what replaces each."""
    import argparse
    import os

    from llama_train.bench.report import build_report
    from llama_train.engine.flops import PeakFlops
    from llama_train.model import load_preset

    import torch

    peak = PeakFlops(torch.device("cpu"), "fp32", 1, 5e11)
    args = argparse.Namespace(preset="x", micro_batch=2, seq_len=64, precision="fp32",
                              zero_stage=0, compile=False, steps=3, warmup=1, rounds=2,
                              interleave="step", override=[], threads=1, peak_flops=5e11)
    r = build_report(args, "llama-bench train", "cpu", "fp32", load_preset("tiny"), 1e6, peak,
                     [3e11, 3.2e11], [_fake_run(0.1), _fake_run(0.1)], [], {"workers=0": 1e-4},
                     0, [(0.0, 0.0, 0.0)] * 2)
    pk = json.loads(json.dumps(r))["peak_flops"]
    assert pk["square_1024"] == pk["value"] == 5e11
    assert pk["square_1024_per_round"] == [5e11, 5e11]
    assert set(pk["deprecated"]) == {"square_1024", "square_1024_per_round"}
    assert all(v.startswith("value") for v in pk["deprecated"].values())


def test_data_bench_cached_corpus_reads_the_cache_and_says_so(monkeypatch, tmp_path):
    """``llama-bench data --cached-corpus``: the corpus as training reads it, no extraction
    timed, and the report's build says so."""
    import argparse
    import os

    from llama_train.bench import data as data_bench
    from llama_train.data import corpus

    def no_extraction():
        raise AssertionError("extracted though --cached-corpus")

    cached = list(corpus.builtin_corpus())  # in the session's cache (conftest)
    monkeypatch.setattr(corpus, "extract_builtin", no_extraction)
    args = argparse.Namespace(no_cold=True, cached_corpus=True, vocab_size=512)
    res: dict = {"loadavg": {"start": [0.0], "end": [0.0]}}
    docs, tok_path, _ = data_bench._one_off_costs(args, tmp_path, res)
    assert docs == cached and res["corpus_build_s"] is None and os.path.isfile(tok_path)
