"""Checkpoints that never lose a run: exact resume, kill -9, corruption, resharding, W&B, export.

All runs go through the real deepspeed launcher (2 CPU ranks, gloo) in fp32 on the tiny model.
"""

from __future__ import annotations

import os
import shutil
import signal

import psutil
import pytest
import torch

from helpers import (TINY, assert_hf_logits_match, copy_at_step, export_hf, import_hf,
                     launcher_cmd, losses, losses_so_far, metrics, one_process, rank_pid,
                     resumed_from, spawn, tail, train, wait_for)
from llama_train.checkpoint import find_latest, load_consolidated, verify, write_manifest

pytestmark = pytest.mark.slow

# Exact resume after a clean stop (trainer.steps_this_run) and the fallback past a truncated
# checkpoint are in the in-process tier (tests/job/test_loop.py), W&B's run continuity in
# tests/metrics/test_tracking.py; kill -9 of the whole job is tests/system/test_reliability.py's drill (three
# kills, in steps and in saves, bit-identical losses and weights). Here: what needs the launcher.
# Saves are asynchronous (trainer.async_save, the default) in every run here: the resharding
# and export below read checkpoints written in the background.
# 24 steps: long enough (a few seconds) that a signal or a kill lands mid-run; every checkpoint
# kept, so that a copy of the uninterrupted run at step 12 can be resumed
STEPS = ["trainer.max_steps=24", "trainer.save_every=4", "trainer.keep_last=6",
         "deepspeed.zero_stage=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt_runs")


@pytest.fixture(scope="module")
def uninterrupted(runs):
    out = runs / "full"
    train(out, STEPS)
    return out


def test_half_written_checkpoint_is_never_latest(tmp_path):
    root = tmp_path / "checkpoints"
    good = root / "step_00000002"
    (good / "ds").mkdir(parents=True)
    (good / "ds" / "w.pt").write_bytes(b"x" * 100)
    (good / "trainer_state.json").write_text("{}")
    write_manifest(good, checksums=True)
    # a save that died before its rename, and one renamed without a manifest (impossible by
    # construction, but a copy tool could produce it), and one whose file was altered
    (root / ".tmp-step_00000004" / "ds").mkdir(parents=True)
    (root / "step_00000006" / "ds").mkdir(parents=True)
    bad = root / "step_00000008"
    shutil.copytree(good, bad)
    (bad / "ds" / "w.pt").write_bytes(b"y" * 100)  # same size, different bytes
    latest, warnings = find_latest(root)
    assert latest == good
    assert any("step_00000008" in w and "sha256" in w for w in warnings)
    assert any("step_00000006" in w and "manifest" in w for w in warnings)


def test_reshard_two_ranks_to_one(uninterrupted, runs):
    """Saved by 2 ranks under ZeRO-2 (the uninterrupted run as it stood at its step-12
    checkpoint), resumed by 1 process through DeepSpeed's universal checkpoint, same global
    batch: losses match the uninterrupted 2-rank run within 2e-4 (only the order of
    floating-point sums differs; see test_launcher_runs.py's tolerance note)."""
    out = copy_at_step(uninterrupted, runs / "reshard", 12)
    one_process(out, STEPS, runs / "reshard-1rank.log")
    a, b = losses(out), losses(uninterrupted)
    assert a.keys() == b.keys()
    assert max(abs(a[k] - b[k]) for k in a) < 2e-4, (a, b)
    assert (out / "checkpoints" / "step_00000012" / "universal").is_dir() or \
        "universal" in (runs / "reshard-1rank.log").read_text()


def test_export_and_import_match_transformers(uninterrupted, runs, tmp_path):
    transformers = pytest.importorskip("transformers")

    hf_dir = tmp_path / "hf"
    export_hf(uninterrupted / "checkpoints", hf_dir)
    _, sd = assert_hf_logits_match(uninterrupted / "checkpoints", hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tok.decode(tok("hello world")["input_ids"], skip_special_tokens=True).strip() == \
        "hello world"
    # import: a llama-import file starts a new training run from these weights
    pt = tmp_path / "imported.pt"
    import_hf(hf_dir, pt)
    blob = torch.load(pt, weights_only=True)
    for k, v in sd.items():
        assert torch.equal(blob["model"][k], v), k
    out = runs / "from_import"
    train(out, [f"trainer.init_from={hf_dir}", "trainer.max_steps=1", "trainer.eval_every=1"])
    first = [r for r in metrics(out) if "val_loss" in r][0]["val_loss"]
    full = [r for r in metrics(uninterrupted) if "val_loss" in r][-1]["val_loss"]
    # one step at lr ~1.5e-5 from the trained weights stays near their validation loss,
    # far below the ~7.6 of a fresh initialisation
    assert abs(first - full) < 0.05, (first, full)


def test_a_simulated_zero2_rank_holds_what_the_real_rank_holds(uninterrupted, runs):
    """comm.simulate_ranks=2, rank 1, ZeRO-2, in one process: its fp32 partitions are exactly
    those of rank 1 of the real 2-rank launch (test_simulate.py checks 64 and 512 ranks)."""
    from test_simulate import fp32_partitions

    out = runs / "simulated"
    one_process(out, [*STEPS, "trainer.micro_batch=2", "trainer.max_steps=4",
                      "comm.simulate_ranks=2", "comm.simulate_rank=1"], runs / "simulated.log")
    step4 = ("checkpoints", "step_00000004")
    assert fp32_partitions(out.joinpath(*step4), 1) == \
        fp32_partitions(uninterrupted.joinpath(*step4), 1)


def test_background_writes_killed_failing_sigtermed_and_finished_exactly(uninterrupted, runs):
    """trainer.async_save under ZeRO-2, four launches of one run (the SIGTERM drill rides on
    this chain, not on two launches of its own: each launch costs ~9 CPU-s of imports):
    1. the write of step 8 is slow (a slow disk) and the loop trains on past it; kill -9 of the
       whole job while it is in flight: step 8 never counts, step 4 is the newest;
    2. the relaunch resumes from step 4; the write of step 12 is slow, so the save of step 16
       waits for it (one write in flight) and says so; the write of step 16 fails on rank 1
       (disk full): the run stops at its next save, step 20, with exit 3 naming step 16;
    3. the relaunch resumes from step 12; once it has trained a step, SIGTERM to every process
       of the job (what SLURM or Kubernetes send on preemption): the ranks finish their step,
       save it and exit;
    4. the relaunch with keep_last=2 resumes from that step and ends as the uninterrupted run
       did, bit for bit, keeping the two newest complete checkpoints."""
    out = runs / "background"
    out.mkdir()
    ckpts = out / "checkpoints"
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", *STEPS])
    log1 = runs / "background-1-killed.log"
    with spawn(cmd, log1, {"LLAMA_TRAIN_FAULTS": "slow_save:step=8,seconds=300"},
               warm=True) as proc:
        assert wait_for(lambda: max(losses_so_far(out), default=0) >= 10, timeout=240,
                        interval=0.05), tail(log1)
        assert (ckpts / ".tmp-step_00000008").is_dir(), tail(log1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert find_latest(ckpts)[0] == ckpts / "step_00000004"
    assert not (ckpts / "step_00000008").exists()

    log2 = runs / "background-2-disk-full.log"
    faults = "slow_save:step=12,seconds=4;save_error:step=16,rank=1,errno=ENOSPC"
    with spawn(launcher_cmd([*TINY, f"trainer.output_dir={out}", *STEPS]), log2,
               {"LLAMA_TRAIN_FAULTS": faults}, warm=True) as proc:
        rc = proc.wait(timeout=300)
    text = log2.read_text()
    assert rc == 3, tail(log2)
    assert resumed_from(out)[-1] == str(ckpts / "step_00000004")
    assert "the save of step 16 waited" in text and "background write of step_00000012" in text
    assert f"saving checkpoint {ckpts / 'step_00000016'} failed (rank 1: OSError: [Errno 28] " \
           f"No space left on device" in text, tail(log2)
    assert max(losses_so_far(out)) == 20  # stopped within one save interval
    assert find_latest(ckpts)[0] == ckpts / "step_00000012"
    assert not list(ckpts.glob(".tmp-step_*"))
    saves = {r["step"]: r for r in metrics(out) if r.get("event") == "checkpoint"}
    assert saves[12]["background"] and saves[12]["durable_s"] >= 4.0 > saves[12]["blocked_s"]
    assert 16 not in saves

    log3 = runs / "background-3-sigterm.log"
    step12 = str(ckpts / "step_00000012")

    def trained_since_resuming_from_12() -> bool:
        # until launch 3 cuts it back to checkpoint 12, metrics.jsonl still runs to step 20
        rows = metrics(out)
        resumes = [i for i, r in enumerate(rows) if r.get("event") == "resume"]
        return bool(resumes) and rows[resumes[-1]]["checkpoint"] == step12 and any(
            "loss" in r for r in rows[resumes[-1]:])

    with spawn(launcher_cmd([*TINY, f"trainer.output_dir={out}", *STEPS]), log3) as proc:
        assert wait_for(trained_since_resuming_from_12, timeout=240, interval=0.05), tail(log3)
        ranks = [psutil.Process(rank_pid(proc.pid, r)) for r in (0, 1)]
        # like SLURM or Kubernetes on preemption: SIGTERM to every process of the job; the ranks
        # finish their step and save it (the launcher gives them 30 s before SIGKILL), while
        # the deepspeed command may exit at once: wait for the ranks, not for it
        os.killpg(proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(ranks, timeout=90)
        assert not alive, tail(log3)
        proc.wait(timeout=60)
    assert resumed_from(out)[-1] == step12
    latest, _ = find_latest(ckpts)
    assert latest is not None, tail(log3)
    stopped_at = int(latest.name.split("_")[1])
    assert 13 <= stopped_at < 24 and max(losses_so_far(out)) == stopped_at, tail(log3)
    assert f": saved step {stopped_at}, exiting" in log3.read_text(), tail(log3)

    train(out, [*STEPS, "trainer.keep_last=2"], log_name="4-finish.log")
    assert resumed_from(out) == [str(ckpts / f"step_{k:08d}") for k in (4, 12, stopped_at)]
    assert losses(out) == losses(uninterrupted)
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith((".tmp", "step_")))
    # the two newest: 20 and 24, unless the SIGTERM landed after step 20
    assert kept == [f"step_{k:08d}" for k in sorted({20, 24, stopped_at})[-2:]]
    assert all(verify(ckpts / k) is None for k in kept)
    _, a, _ = load_consolidated(str(ckpts))
    _, b, _ = load_consolidated(str(uninterrupted / "checkpoints"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
