"""`llama-bench train`, `memory` and `startup` on the tiny model: real runs, checked for shape and
self-consistency (speed thresholds belong to benchmarks, not tests)."""

from __future__ import annotations

import json
import math

import pytest

from llama_train.bench import memory as mem_bench
from llama_train.bench import peaks
from llama_train.bench import train as train_bench
from llama_train.bench._memory_worker import classify
from llama_train.records import read_metrics

TINY = ["--preset", "tiny", "--seq-len", "64", "--micro-batch", "2", "--steps", "3", "--warmup",
        "1", "--rounds", "2", "--threads", "1", "--device", "cpu",
        "--override", "data.max_documents=600", "--override", "data.num_proc=1",
        "--override", "data.num_workers=0"]


@pytest.mark.slow
def test_train_bench_ab_report_is_consistent(tmp_path, capsys):
    out = tmp_path / "report.json"
    train_bench.main([*TINY, "--json", str(out), "--work-dir", str(tmp_path / "runs")])
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert "reproduce: llama-bench train --preset tiny" in table and r["command"] in table
    s = r["settings"]
    assert (s["rounds"], s["steps"], s["tokens_per_step"], s["precision"]) == (2, 3, 128, "fp32")
    fpt = r["flops_per_token"]
    assert fpt > 0 and len(r["peak_flops"]["square_1024_per_round"]) == 2
    peak = r["peak_flops"]["square_1024"]
    for side in ("ours", "hf"):
        x = r[side]
        st = x["step_time_s"]
        assert len(st["per_round_median"]) == 2
        assert 0 < st["min"] <= st["median"] <= st["max"]
        assert x["tokens_per_s"] == pytest.approx(128 / st["median"])
        assert x["mfu"] == pytest.approx(fpt * x["tokens_per_s"] / peak)
        assert x["mfu"] > 0 and x["mfu_vs_model_shapes"] > 0
        assert 0 <= x["data_wait_share"] < 1  # the wait is part of the step
        assert math.isfinite(x["loss_step1"]) and x["mem_gb"] > 0
    q = r["ratio_ours_over_hf"]
    assert q["tokens_per_s"] == pytest.approx(r["ours"]["tokens_per_s"] / r["hf"]["tokens_per_s"])
    assert len(q["paired_per_round"]) == 2 and all(v > 0 for v in q["paired_per_round"])
    # same initial weights, same first batch: the two models start from the same loss
    assert r["loss_step1_abs_diff"] < 1e-3, (r["ours"]["loss_step1"], r["hf"]["loss_step1"])
    assert "AdamW" in r["hf"]["optimizer"]
    assert set(r["loader_alone_s_per_batch"]) == {"workers=0"}
    # the runs really ran the configured steps (per-round files kept in --work-dir)
    rows = read_metrics(tmp_path / "runs" / "ours-0" / "metrics.jsonl")
    assert [row.step for row in rows if "step_time_s" in row] == [1, 2, 3, 4]


def test_train_bench_rejects_bad_options(capsys):
    with pytest.raises(SystemExit, match="--rounds=0 must be >= 1"):
        train_bench.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        train_bench.parse_args(["--override", "data.num_workers"])
    with pytest.raises(SystemExit, match="--stages"):
        mem_bench.parse_args(["--stages", "4"])


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
    """The HF side's AdamW groups come from llama_train.optim's rule on our parameter names."""
    import dataclasses

    from llama_train.bench.hf_baseline import build_hf_model, make_adamw
    from llama_train.config import OptimConfig
    from llama_train.model import Transformer, load_preset
    from llama_train.optim import param_groups

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


@pytest.mark.slow
def test_memory_bench_zero3_matches_the_plan(tmp_path, capsys):
    out = tmp_path / "mem.json"
    mem_bench.main(["--preset", "tiny", "--stages", "3", "--nprocs", "2", "--precision", "fp32",
                    "--json", str(out)])
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert "reproduce: llama-bench memory" in table and "--precision fp32" in r["command"]
    (row,) = r["rows"]
    assert (row["config"], row["nprocs"], row["status"]) == ("3", 2, "ok")
    # fp32 master partition + both Adam moments, partitioned over 2 ranks: within 10% of the plan
    from llama_train.scaling import model_memory

    plan = model_memory("tiny", zero_stage=3, world_size=2, dtype="fp32")["optimizer_states"]
    assert row["counted_optimizer"] == pytest.approx(plan, rel=0.10), row
    assert row["counted"]["adam_moments"] == pytest.approx(8 * r["n_params"] / 2, rel=0.10)
    assert row["hwm_reset"] and row["peak_above_idle"] > 0 and row["idle_rss"] > 0
    assert set(row["phases"]) == {"build", "initialize", "step1", "step2"}


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
    is the next stage; the real ZeRO-0 run measures above the limit, the advised one below."""
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
    mem_bench.main([*shape, "--stages", f"0,{advised['zero_stage']}", "--nprocs", "2",
                    "--json", str(out)])
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


@pytest.mark.slow
def test_startup_bench_reports_each_variant_and_phase(tmp_path, capsys):
    from helpers import TINY as TEST_TINY

    from llama_train.bench import startup

    assert startup.TINY == TEST_TINY  # the bench times the tests' tiny run
    with pytest.raises(SystemExit, match="--rounds=0 must be >= 1"):
        startup.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit, match="no llama_train/train.py"):
        startup.parse_args(["--baseline", str(tmp_path)])
    out = tmp_path / "startup.json"
    startup.main(["--nprocs", "1", "--rounds", "1", "--phase-rounds", "1", "--json", str(out)])
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert "reproduce: llama-bench startup --nprocs 1" in table and r["command"] in table
    assert "llama-train model=tiny" in r["commands"]["1"]["ours"]
    res = r["results"]["1"]
    assert set(res) == {"floor", "ours"} and res["floor"]["over_floor_s"] == 0
    for x in res.values():
        assert 0 < x["to_step1_s"]["median"] <= x["to_exit_s"]["median"] and x["first_run_s"] > 0
        assert x["cpu_s"]["median"] > 0
    ours = r["phases"]["1"]["ours"]
    labels = [p["phase"] for p in ours]
    assert labels[0].startswith("launcher") and labels[-1] == "step 1 logged (metrics.jsonl)"
    assert {"import deepspeed", "deepspeed.initialize", "peak FLOPs (matmul timing)"} <= set(labels)
    assert not any("shm comm op" in lab for lab in labels)  # not loaded on CPU any more
    # the phases of the one probe run add up to its command -> step 1 (metrics.jsonl's time)
    total = r["phases"]["1"]["ours (probe run total)"]["median"]
    assert sum(p["median_s"] for p in ours) == pytest.approx(total, abs=0.05)
    floor = [p["phase"] for p in r["phases"]["1"]["floor"]]
    assert floor[-1] == "step 1 (forward, backward, AdamW step)"


@pytest.mark.slow
def test_checkpoint_bench_reports_blocked_and_durable_seconds(tmp_path, capsys):
    """`llama-bench checkpoint`, one launch of 2 ranks (the tiny data, already prepared): each
    save's blocked and durable seconds, the medians, and the command, from real records."""
    from llama_train.bench import checkpoint as ckpt_bench

    out = tmp_path / "bench.json"
    ckpt_bench.main(["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--rounds", "1",
                     "--steps", "3", "--save-every", "1", "--modes", "async", "--no-warmup",
                     "--no-resume", "--override", "model.vocab_size=2048",
                     "--workdir", str(tmp_path / "runs"), "--json", str(out)])
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    run = r["runs"][0]
    assert run["mode"] == "async" and len(run["blocked_s"]) == 2  # steps 1 and 2; 3 is the end
    assert all(0 < b <= d for b, d in zip(run["blocked_s"], run["durable_s"]))
    assert r["summary"]["async"]["blocked_s_per_save"] == pytest.approx(sum(run["blocked_s"]) / 2)
    assert r["command"] in table and "llama-bench checkpoint --dim 64" in table
