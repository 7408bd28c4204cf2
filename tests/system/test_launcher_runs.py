"""Training through the real deepspeed launcher: 2 CPU ranks over gloo, the tiny model.

Loss agreement tolerance: every configuration below computes the same global-batch loss in fp32
from the same initial weights and the same global sample order; they differ only in the order
in which floating-point sums are taken (gradient all-reduce across ranks or accumulation steps,
ZeRO's flat partitioned buffers). That perturbs the loss by ~1e-7 relative per step, growing a
little through Adam over a few steps; 2e-4 absolute on a loss of ~7.6 is ~100x that and far
below any real bug (a wrong batch split or a missed gradient shows up at 1e-2 or more).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import (REPO, TINY, assert_losses_close, free_port, losses, metrics, node_cmds,
                     one_process, run_nodes, spawn, tail, train)
from llama_train.records import RunInfo

TOL = 2e-4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("train_runs")


STAGES = (0, 1, 2)  # ZeRO-3: conftest.py's zero3_run


@pytest.fixture(scope="module")
def sweep(runs):
    """One launch, one process group, six jobs of a ``--multirun`` sweep (as users sweep):
    ZeRO 0, 1 and 2, each at micro-batch 2 (no accumulation) and at micro-batch 1 (accumulation
    2), global batch 4. Each job trains in its own directory, ``<output_dir>/<swept values>``:
    (stage, micro) -> that directory."""
    out = runs / "sweep"
    train(out, ["--multirun", f"deepspeed.zero_stage={','.join(map(str, STAGES))}",
                "trainer.micro_batch=2,1", "trainer.global_batch=4", "trainer.eval_every=3",
                "trainer.save_every=3", f"hydra.sweep.dir={runs / 'hydra'}"])
    jobs = {}
    for d in out.iterdir():
        swept = dict(part.split("=") for part in d.name.split(","))
        jobs[int(swept["deepspeed.zero_stage"]), int(swept["trainer.micro_batch"])] = d
    assert sorted(jobs) == sorted((s, m) for s in STAGES for m in (2, 1)), sorted(jobs)
    return jobs


@pytest.fixture(scope="module")
def baseline(sweep):
    """ZeRO-0, 2 ranks, micro batch 2, no accumulation: the reference the others must match
    (the sweep's first job)."""
    return sweep[0, 2]


def _close(a, b, tol=TOL):
    assert_losses_close(a, b, tol)


def _same_val(out, baseline):
    """The final val_loss over the same evaluation set (trainer.eval_sequences windows, each
    once), whatever the micro-batch, world size or stage: within 1e-5 (fp32); and its size."""
    mine, theirs = ([r for r in metrics(d) if "val_loss" in r][-1] for d in (out, baseline))
    assert mine["val_tokens"] == theirs["val_tokens"] == 8 * 64
    assert abs(mine["val_loss"] - theirs["val_loss"]) < 1e-5, (mine["val_loss"], theirs["val_loss"])


def test_baseline_run_is_complete(baseline):
    rows = metrics(baseline)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "mem_gb"):
        assert all(key in r for r in steps), key
    assert steps[-1]["tokens"] == 6 * 4 * 64  # steps x global batch x seq_len
    assert all(r["grad_norm"] > 0 for r in steps)
    assert all(0 < r["mfu"] < 1 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]  # it learns
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [3, 6] and all(r["val_ppl"] > 1 for r in val)
    assert (baseline / "checkpoints" / "step_00000006" / "manifest.json").is_file()
    assert (baseline / "sample.txt").read_text().strip()
    info = RunInfo.read(baseline / "run_info.json")
    assert info.params["total"] > 0 and info.final_val_loss == val[-1]["val_loss"]
    # only rank 0 writes metrics: one line per step, no duplicates
    assert len(steps) == len({r["step"] for r in steps})


def test_one_launch_runs_every_job_of_a_sweep(sweep, runs):
    """``deepspeed ... --multirun``: every job ran to its end in its own directory, one after
    the other in the same two ranks."""
    for (stage, micro), out in sweep.items():
        assert sorted(losses(out)) == list(range(1, 7)), (stage, micro)
        info = RunInfo.read(out / "run_info.json")
        assert info.final_val_loss is not None
    log = (runs / "sweep-train.log").read_text()
    assert log.count("--multirun job") == len(sweep), tail(runs / "sweep-train.log")
    assert log.count("spawned with command") == 2  # the launcher started its two ranks once


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_agree(stage, baseline, sweep, request):
    """Same trajectory at every stage; step 1 (before any update) shows that every stage starts
    from the same weights, ZeRO-3's built partitioned: equal up to the order of the loss sum.
    (ZeRO-3: conftest.py's zero3_run, which tests/engine/test_zero3.py resumes and reshards; the others
    are jobs of one --multirun launch, after the baseline in the same processes.)"""
    out = request.getfixturevalue("zero3_run") if stage == 3 else sweep[stage, 2]
    _close(losses(out), losses(baseline))
    assert abs(losses(out)[1] - losses(baseline)[1]) < 1e-6
    _same_val(out, baseline)


@pytest.mark.parametrize("stage", STAGES)
def test_grad_accumulation_matches_micro_batch(stage, baseline, sweep):
    """global batch 4 on 2 ranks: micro 1 x accumulation 2 == micro 2 x accumulation 1."""
    out = sweep[stage, 1]
    _close(losses(out), losses(baseline))
    _same_val(out, baseline)  # the evaluation in batches of 1 instead of 2


def test_single_process_matches_two_ranks(baseline, runs):
    """No launcher: one process with the same global batch continues the same global data."""
    out = runs / "single"
    one_process(out, [], runs / "single.log")
    _close(losses(out), losses(baseline))
    _same_val(out, baseline)  # 1 rank in batches of 4, against 2 ranks in batches of 2


def test_two_node_simulation_matches_single_node(baseline, runs, tmp_path):
    """Two launcher invocations, one per 'node', a two-host hostfile, --no_ssh."""
    out = runs / "two_node"
    cmds = node_cmds(tmp_path / "hostfile", 1, free_port(),
                     ["--module", "llama_train.train", *TINY, f"trainer.output_dir={out}"])
    rc0, rc1 = run_nodes(cmds, [runs / "node0.log", runs / "node1.log"])  # the real launcher
    assert rc0 == 0 and rc1 == 0, tail(runs / "node0.log") + tail(runs / "node1.log")
    _close(losses(out), losses(baseline))


def test_plot(baseline, tmp_path):
    png = tmp_path / "curves.png"
    subprocess.run([sys.executable, "-m", "llama_train.metrics.plot", str(baseline), "--out",
                    str(png)], check=True, cwd=REPO)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# An integration matrix over the combinations users switch on together. fp32 cases must match
# the baseline like the ZeRO stages do; bf16 rounds activations and gradients to 8 mantissa bits
# (relative error ~4e-3 per value, largely averaging out in the mean loss), so it gets 2e-2.
MATRIX = [
    (["deepspeed.zero_stage=3", "model.activation_checkpointing=true", "trainer.micro_batch=1",
      "trainer.global_batch=4"], TOL),
    (["deepspeed.zero_stage=1", "deepspeed.precision=bf16"], 2e-2),
]
# ZeRO-3 with parameter and optimizer offload: tests/engine/test_zero3.py.


@pytest.mark.parametrize("overrides,tol", MATRIX, ids=["zero3-actckpt-accum2", "zero1-bf16"])
def test_integration_matrix(overrides, tol, baseline, runs):
    out = runs / ("matrix-" + "-".join(o.split("=")[1] for o in overrides))
    train(out, overrides)
    _close(losses(out), losses(baseline), tol)


def test_a_killed_launcher_stops_its_ranks_with_a_checkpoint(tmp_path):
    """kill -9 of ``deepspeed.launcher.launch`` (issue 29): its ranks used to train on
    unsupervised. Now each rank gets SIGTERM from the kernel as its launcher dies, finishes its
    step, saves, says why and exits; nothing is left running."""
    import psutil

    from helpers import launcher_cmd, losses_so_far, rank_pid, wait_for
    from llama_train.checkpoint import find_latest

    out = tmp_path / "run"
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", "trainer.max_steps=100000",
                        "trainer.save_every=100000", "trainer.eval_every=100000"])
    log = tmp_path / "run.log"
    with spawn(cmd, log) as proc:
        assert wait_for(lambda: len(losses_so_far(out)) >= 2, 240), tail(log)
        launcher = next(p for p in psutil.Process(proc.pid).children()
                        if "deepspeed.launcher.launch" in " ".join(p.cmdline()))
        ranks = [psutil.Process(rank_pid(proc.pid, r)) for r in (0, 1)]
        launcher.kill()
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"ranks still running 60 s after their launcher died\n{tail(log)}"
    latest, _ = find_latest(out / "checkpoints")
    assert latest is not None and int(latest.name.split("_")[1]) >= 2, tail(log)
    assert "launcher of this rank is gone" in log.read_text(), tail(log)


@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-c, SIGINT ignored by deepspeed",
                                 "sigterm-to-deepspeed"])
def test_a_stopped_job_saves_and_says_so_without_a_traceback(how, tmp_path):
    """Issue 28, item 1 and issue 53, item 8, through the real launcher (ZeRO-3, W&B offline):
    * ``ctrl-c``: SIGINT to the job's process group, what a terminal sends. The launcher
      SIGTERMs everything under each rank, W&B's service process too: the rank that hosts the
      store used to die of W&B's broken socket while closing, and the other rank then failed
      its last barrier ("lost contact with the job"); then each rank said "signal [2]: saved
      step N, exiting", W&B warned that its "service process is gone", and nothing said how to
      resume;
    * ``ctrl-c, SIGINT ignored by deepspeed``: the same, the command started as
      ``trap '' INT; deepspeed ...`` (docs/reliability.md): DeepSpeed's runner then waits for
      its launcher instead of dying of a KeyboardInterrupt;
    * ``sigterm-to-deepspeed``: SIGTERM to the ``deepspeed`` command alone (``kill <pid>``):
      it used to die quietly and leave the launcher and the ranks training on headless.
    Each: the ranks finish the step and save it; rank 0 says so in one line, with the step, the
    checkpoint and the command that resumes it; the newest checkpoint is that step. The only
    traceback allowed is DeepSpeed's runner's own KeyboardInterrupt on a plain Ctrl-C (not ours
    to catch: docs/reliability.md). ``deepspeed`` exits as documented: killed by the SIGINT
    (a shell's 130) or the SIGTERM (143) itself; 1 (its launcher's code) when it ignores SIGINT.
    """
    import os
    import re
    import signal
    import shlex

    import psutil

    from helpers import launcher_cmd, losses_so_far, rank_pid, wait_for
    from llama_train.checkpoint import find_latest

    out = tmp_path / "run"
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", "trainer.max_steps=100000",
                        "trainer.save_every=100000", "trainer.eval_every=100000",
                        "deepspeed.zero_stage=3", "tracking.wandb.mode=offline"])
    if how == "ctrl-c, SIGINT ignored by deepspeed":
        cmd = ["bash", "-c", "trap '' INT; exec \"$@\"", "deepspeed", *cmd]
    log = tmp_path / "run.log"
    with spawn(cmd, log) as proc:
        assert wait_for(lambda: len(losses_so_far(out)) >= 2, 240), tail(log)
        ranks = [psutil.Process(rank_pid(proc.pid, r)) for r in (0, 1)]
        if how.startswith("ctrl-c"):
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(ranks, timeout=90)
        assert not alive, f"ranks still running 90 s after {how}\n{tail(log)}"
        rc = proc.wait(timeout=60)
    text = log.read_text(errors="replace")
    why = "SIGTERM" if how == "sigterm-to-deepspeed" else r"Ctrl-C \(SIGINT\)"
    stopped = re.findall(rf"\[rank(\d)\] WARNING stopped by {why}: saved step (\d+), exiting "
                         rf"\((\S+)\); resume with: (.*)", text)
    assert [r for r, *_ in stopped] == ["0"], tail(log)
    [(_, step, where, again)] = stopped
    latest, _ = find_latest(out / "checkpoints")
    assert latest is not None and latest.name == f"step_{int(step):08d}", tail(log)
    assert where == str(latest) and max(losses_so_far(out)) == int(step)
    # the command that started the job (the port included), which resumes it as it is
    assert shlex.split(again) == ["deepspeed", *cmd[cmd.index("--num_gpus"):]], again
    for bad in ("lost contact", "Error executing job", "Exception ignored", "ERROR rank",
                "service process is gone"):
        assert bad not in text, tail(log, 120)
    assert "wandb sync " in text  # the offline run's upload command, as at any end
    runner_tracebacks = len(re.findall(r"Traceback \(most recent call last\):\n  File \"\S+/"
                                       r"bin/deepspeed\"", text))
    assert text.count("Traceback") == runner_tracebacks <= (how == "ctrl-c"), tail(log, 120)
    assert rc == {"ctrl-c": -signal.SIGINT, "ctrl-c, SIGINT ignored by deepspeed": 1,
                  "sigterm-to-deepspeed": -signal.SIGTERM}[how], (rc, tail(log))
    if how == "sigterm-to-deepspeed":
        assert "the deepspeed command that started this job is gone" in text, tail(log)
