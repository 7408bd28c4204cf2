"""ZeRO-3 end to end through the real launcher (2 CPU ranks, gloo, fp32, the tiny model): the
model is built partitioned (``engine.build_model`` inside ``deepspeed.zero.Init``) and every
path that touches whole weights still works: exact resume, resharding 2 -> 1 and 1 -> 2 ranks,
Hugging Face export, ``trainer.init_from``, the end-of-run sample, and CPU offload of parameters
and optimizer.

Tolerances: a resume on the same world size must be bit-identical. A run on another world size
sums gradients in another order (see tests/system/test_launcher_runs.py's note): 2e-4. Step 1's loss
comes from the initial weights before any update, so it differs only by the order of the loss
sum: 1e-6.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from helpers import (TINY, ZERO3, assert_hf_logits_match, assert_losses_close, copy_at_step,
                     export_hf, launcher_cmd, losses, losses_so_far, metrics, one_process,
                     rank_pid, resumed_from, spawn, step_rows, tail, train, wait_for)
from llama_train.checkpoint import find_latest

pytestmark = pytest.mark.slow

TOL = 2e-4
Z3 = ZERO3  # 6 steps, a checkpoint every 2, evaluated at the end
OFFLOAD = ["deepspeed.offload_params=true", "deepspeed.offload_optimizer=true"]
HALF = "trainer.steps_this_run=2"


def _close(a, b, tol=TOL):
    assert_losses_close(a, b, tol)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("zero3_runs")


@pytest.fixture(scope="module")
def reference(zero3_run):
    """6 uninterrupted ZeRO-3 steps on 2 ranks (conftest.py: the run test_launcher_runs.py
    compares with ZeRO-0); never written to here."""
    return zero3_run


@pytest.fixture(scope="module")
def half(reference, runs):
    """The same run as it stood after 2 steps (checkpoint step 2), kept untouched for copies."""
    return copy_at_step(reference, runs / "half", 2)


def test_reshard_two_ranks_to_one(reference, half, runs):
    """Through DeepSpeed's universal checkpoint: 2 -> 1 from the 2-rank checkpoint at step 2.
    With our two param groups (decayed matrices; norms and embedding without decay) this needs
    Engine.load's repair of DeepSpeed's ZeRO-3 universal load (shared Adam step, first group's
    hyperparameters for all): without it the losses drifted by 2e-5, then 1e-3."""
    to_one = runs / "to_one"
    shutil.copytree(half, to_one)
    one_process(to_one, Z3, runs / "to_one.log")
    assert "universal" in (runs / "to_one.log").read_text()
    _close(losses(to_one), losses(reference))


def test_reshard_one_rank_to_two(reference, runs):
    """1 -> 2 from a one-process run's checkpoint at step 2."""
    to_two = runs / "to_two"
    one_process(to_two, [*Z3, HALF], runs / "to_two-1.log")
    train(to_two, Z3, log_name="resume.log")
    assert resumed_from(to_two) == [str(to_two / "checkpoints" / "step_00000002")]
    _close(losses(to_two), losses(reference))


def test_export_then_init_from(reference, runs, tmp_path):
    """A ZeRO-3 checkpoint exports to a Hugging Face model computing our logits; a new ZeRO-3
    run initialised from it (rank 0 loads, one gathered parameter at a time) starts at the
    reference's validation loss."""
    pytest.importorskip("transformers")

    hf_dir = tmp_path / "hf"
    export_hf(reference / "checkpoints", hf_dir)
    assert_hf_logits_match(reference / "checkpoints", hf_dir)

    out = runs / "init_from"
    train(out, ["deepspeed.zero_stage=3", f"trainer.init_from={hf_dir}", "trainer.max_steps=1",
                "trainer.eval_every=1", "optim.lr=1e-9"])
    first = [r for r in metrics(out) if "val_loss" in r][0]["val_loss"]
    final = [r for r in metrics(reference) if "val_loss" in r][-1]["val_loss"]
    assert abs(first - final) < 1e-4, (first, final, tail(runs / "init_from-train.log"))


def test_offload_trains_resumes_exactly_and_exports(reference, runs, tmp_path):
    """Parameters and optimizer state in host memory (DeepSpeed's CPU Adam; its first use
    JIT-builds the op): same losses as ZeRO-3 without offload, bit-identical resume, export."""
    full = runs / "offload"
    train(full, [*Z3, *OFFLOAD], timeout=600)
    _close(losses(full), losses(reference))
    part = copy_at_step(full, runs / "offload_resumed", 2)
    train(part, [*Z3, *OFFLOAD], log_name="resume.log")
    assert resumed_from(part) == [str(part / "checkpoints" / "step_00000002")]
    assert losses(part) == losses(full)
    hf_dir = tmp_path / "hf"
    export_hf(part / "checkpoints", hf_dir)
    assert (hf_dir / "config.json").is_file() and list(hf_dir.glob("*.safetensors"))


def test_a_simulated_rank_holds_what_the_real_rank_holds(reference, runs):
    """comm.simulate_ranks=2, rank 1, in one process: its fp32 partitions and its files are
    those of rank 1 of the real 2-rank launch (test_simulate.py checks 64 and 512 ranks against
    DeepSpeed's arithmetic, which this confirms at 2)."""
    from test_simulate import fp32_partitions, zero3_partitions

    from helpers import compose_cfg

    out = runs / "simulated"
    one_process(out, [*Z3, "trainer.micro_batch=2", "trainer.max_steps=2",
                      "comm.simulate_ranks=2", "comm.simulate_rank=1"], runs / "simulated.log")
    sim, real = out / "checkpoints" / "step_00000002", reference / "checkpoints" / "step_00000002"
    assert fp32_partitions(sim, 1) == fp32_partitions(real, 1) == zero3_partitions(
        compose_cfg(["model=tiny"]), 2)
    real_files = {p.name: p.stat().st_size for p in (real / "ds").glob("zero_pp_rank_1_*")}
    sim_files = {p.name: p.stat().st_size for p in (sim / "ds").iterdir()}
    assert sim_files.keys() == real_files.keys()
    assert sim_files["zero_pp_rank_1_mp_rank_00_optim_states.pt"] == pytest.approx(
        real_files["zero_pp_rank_1_mp_rank_00_optim_states.pt"], rel=0.02)


def test_four_ranks_step1_loss_and_a_simulated_rank_of_four(reference, runs):
    """One real 4-rank launch (micro-batch 1: the reference's global batch of 4), two checks
    (one launch: each costs ~9 CPU-s of imports).
    * Step 1: the initial weights are the same partitioned 4 ways as 2 ways (and, in the
      in-process tier, built whole on one rank): its loss agrees to float32 rounding.
    * Its step-2 checkpoint: rank 3's partitions, simulated alone in one process, are those of
      rank 3 of the launched job, and DeepSpeed's ceil(numel / 4) per parameter."""
    from test_simulate import fp32_partitions, zero3_partitions

    from helpers import compose_cfg

    settings = [*Z3, "trainer.micro_batch=1", "trainer.max_steps=2", "trainer.eval_every=1000",
                "sample.tokens=0"]
    real, sim = runs / "four", runs / "four-simulated"
    train(real, settings, nprocs=4)
    assert step_rows(real)[1]["tokens"] == step_rows(reference)[1]["tokens"]  # global batch
    assert abs(losses(real)[1] - losses(reference)[1]) < 1e-6, (losses(real), losses(reference))

    one_process(sim, [*settings, "comm.simulate_ranks=4", "comm.simulate_rank=3"],
                runs / "four-simulated.log")
    step2 = ("checkpoints", "step_00000002")
    assert fp32_partitions(sim.joinpath(*step2), 3) == fp32_partitions(real.joinpath(*step2), 3) \
        == zero3_partitions(compose_cfg(["model=tiny"]), 4)


def test_a_rank_killed_during_a_background_write_then_an_exact_resume(reference, half, runs):
    """trainer.async_save under ZeRO-3: the write of step 4 is slow (a slow disk) and the loop
    trains on past it; rank 1 is SIGKILLed while that write is in flight. The job stops, step 4
    never counts, and the relaunch resumes from step 2 bit-identically to the uninterrupted run:
    losses, validation loss and the end-of-run sample (the exact-resume checks ride on this
    relaunch rather than on a launch of their own)."""
    out = runs / "killed_in_write"
    shutil.copytree(half, out)  # the run as it stood after its checkpoint of step 2
    ckpts = out / "checkpoints"
    log = runs / "killed_in_write.log"
    with spawn(launcher_cmd([*TINY, f"trainer.output_dir={out}", *Z3]), log,
               {"LLAMA_TRAIN_FAULTS": "slow_save:step=4,seconds=300"}, warm=True) as proc:
        assert wait_for(lambda: max(losses_so_far(out), default=0) >= 5, timeout=240,
                        interval=0.05), tail(log)
        assert (ckpts / ".tmp-step_00000004").is_dir(), tail(log)
        pid = rank_pid(proc.pid, 1)
        assert pid is not None, tail(log)
        os.kill(pid, signal.SIGKILL)
        rc = proc.wait(timeout=120)
    assert rc != 0, tail(log)
    assert find_latest(ckpts)[0] == ckpts / "step_00000002"
    assert not (ckpts / "step_00000004").exists()
    assert not (out / "sample.txt").exists()  # the killed launch never reached its end

    train(out, Z3, log_name="relaunch.log")
    # a resume cuts metrics.jsonl back to its checkpoint: the killed launch's lines are gone
    assert resumed_from(out) == [str(ckpts / "step_00000002")]
    assert losses(out) == losses(reference)
    assert [r["val_loss"] for r in metrics(out) if "val_loss" in r] == \
        [r["val_loss"] for r in metrics(reference) if "val_loss" in r]
    # every rank decoded the same tokens, layer by layer, without gathering the whole model
    sample = (reference / "sample.txt").read_text().strip()
    assert sample and (out / "sample.txt").read_text().strip() == sample
