"""Ctrl-C on a job of one process (issue 53, item 8): one line with the step saved and the
command that resumes it, exit 130, no traceback. Under the deepspeed launcher:
test_launcher_runs.py::test_a_stopped_job_saves_and_says_so_without_a_traceback."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from helpers import BIN, TINY, losses_so_far, resumed_from, spawn, tail, wait_for


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_says_how_to_resume(tmp_path):
    """``llama-train ...`` in a terminal, Ctrl-C after a few steps: the step is saved, one line
    names it and the command (this one) that resumes it, and the command exits 130; the same
    command then resumes from that step."""
    from llama_train.checkpoint import find_latest

    out = tmp_path / "run"
    cmd = [str(BIN / "llama-train"), *TINY, f"trainer.output_dir={out}",
           "trainer.max_steps=100000", "trainer.save_every=100000", "trainer.eval_every=100000"]
    log = tmp_path / "run.log"
    with spawn(cmd, log) as proc:
        assert wait_for(lambda: len(losses_so_far(out)) >= 2, 240), tail(log)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
    text = log.read_text(errors="replace")
    stopped = re.findall(r"\[rank0\] WARNING stopped by Ctrl-C \(SIGINT\): saved step (\d+), "
                         r"exiting \((\S+)\); resume with: (.*)", text)
    assert len(stopped) == 1 and rc == 130, (rc, tail(log))
    [(step, where, again)] = stopped
    latest, _ = find_latest(out / "checkpoints")
    assert where == str(latest) and latest.name == f"step_{int(step):08d}", tail(log)
    assert shlex.split(again) == ["llama-train", *cmd[1:]], again
    assert "Traceback" not in text, tail(log, 120)
    # the command it names resumes from the saved step (one more step, then done)
    again_cmd = [str(BIN / "llama-train"), *shlex.split(again)[1:],
                 f"trainer.max_steps={int(step) + 1}"]
    with spawn(again_cmd, tmp_path / "again.log") as proc:
        assert proc.wait(timeout=240) == 0, tail(tmp_path / "again.log")
    assert resumed_from(out) == [str(latest)], tail(tmp_path / "again.log")
    assert max(losses_so_far(out)) == int(step) + 1

@pytest.mark.slow  # an interpreter of its own: not in make test-fast's in-process tier
def test_ctrl_c_outside_the_loop_is_one_line_and_exit_130(tmp_path):
    """A Ctrl-C before the loop (data preparation, the process group, a resume's load) or after
    its last save: KeyboardInterrupt, which used to end the command with its traceback (killed
    by the SIGINT Python re-raises). Now one line that nothing more was saved, exit 130."""
    script = (
        "import sys\n"
        "import llama_train.train as t\n"
        "def interrupted(*a, **k):\n"
        "    raise KeyboardInterrupt\n"
        "t.preflight = interrupted\n"
        f"sys.argv = ['llama-train', *{list(TINY)!r}, 'trainer.output_dir={tmp_path / 'run'}']\n"
        "t.cli()\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=180, env=env)
    text = p.stdout + p.stderr
    assert p.returncode == 130 and "Traceback" not in text, (p.returncode, text[-3000:])
    assert "llama-train: interrupted (Ctrl-C) outside the training loop" in text, text[-3000:]


@pytest.mark.parametrize("stopping", [True, False], ids=["stopped-by-a-signal", "mid-run"])
def test_a_lost_wandb_service_is_a_warning_only_mid_run(stopping, tmp_path, caplog):
    """The deepspeed launcher SIGTERMs W&B's service with the ranks on Ctrl-C, so the W&B run of
    a stopped job cannot finish: expected, the upload command (as at any offline run's end), no
    warning. A service that dies while the job trains on still warns."""
    import logging

    from llama_train.config import TensorBoardConfig, TrackingConfig, WandbConfig
    from llama_train.metrics.tracking import Tracker

    class GoneRun:
        def finish(self):
            raise ConnectionResetError("Connection lost")

    t = Tracker(TrackingConfig(wandb=WandbConfig(mode="offline"),
                               tensorboard=TensorBoardConfig(enabled=False)),
                str(tmp_path), rank=0)
    t._wandb, t.run_id, t.wandb_dir = GoneRun(), "abcd1234", tmp_path / "wandb"
    run_dir = t.wandb_dir / "offline-run-20260101_000000-abcd1234"
    run_dir.mkdir(parents=True)
    (run_dir / "run-abcd1234.wandb").write_bytes(b"")
    t.stopping = lambda: stopping
    with caplog.at_level(logging.INFO, logger="llama_train"):
        t.finish()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"wandb sync {run_dir}" in caplog.text
    assert bool(warned) is not stopping, caplog.text
    assert ("service process is gone" in caplog.text) is not stopping, caplog.text
