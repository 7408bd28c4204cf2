"""One output_dir, one history (issue 12): corrupt checkpoints, resume=never in a used directory,
two jobs on one directory, resuming under another config (docs/reliability.md, section 7).

In-process tier (a world of one, as tests/job/test_loop.py) for the decisions; the launcher for
what needs ranks: a second 2-rank job refused while the first runs, a kill -9'd holder's lock
taken over, and all ranks exiting 3 when no checkpoint verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (TINY, cfg_for, launcher_cmd, losses_so_far, metrics, rows, spawn, step_rows,
                     tail, train as launch, wait_for)
from llama_train.checkpoint import CheckpointError, find_latest
from llama_train.config import ConfigError
from llama_train.train import train


pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one


def snapshot(out: Path) -> dict:
    """Every file under ``out`` with its sha256 (the lock file aside: it is the run's own)."""
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}


def corrupt(ckpt: Path) -> None:
    victim = max(ckpt.rglob("*.pt"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the sha256 sees it
    victim.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------
# item 2: every checkpoint corrupt


@pytest.mark.slow
def test_all_checkpoints_corrupt_refuses_then_archive_starts_over(tmp_path):
    out = tmp_path / "corrupt"
    args = ["trainer.max_steps=4", "trainer.save_every=2"]
    train(cfg_for(out, *args))
    for step in (2, 4):
        corrupt(out / "checkpoints" / f"step_{step:08d}")
    before = snapshot(out)
    with pytest.raises(CheckpointError) as err:
        train(cfg_for(out, *args))
    msg = str(err.value)
    for step in (2, 4):
        assert f"step_{step:08d}" in msg
    assert msg.count("fails its sha256") == 2 and "trainer.on_existing=archive" in msg
    assert snapshot(out) == before  # nothing touched

    train(cfg_for(out, *args, "trainer.on_existing=archive"))
    archived, = (out / "archive").iterdir()
    assert sorted(p.name for p in (archived / "checkpoints").glob("step_*")) == \
        ["step_00000002", "step_00000004"]
    assert snapshot(archived) == {k: v for k, v in before.items()
                                  if k.split("/")[0] in ("checkpoints", "metrics.jsonl",
                                                         "config.yaml", "run_info.json",
                                                         "sample.txt")}
    assert sorted(step_rows(out)) == [1, 2, 3, 4]
    assert not [r for r in rows(out) if r.get("event") == "resume"]  # a new history
    assert find_latest(out / "checkpoints")[0].name == "step_00000004"


# ------------------------------------------------------------------------------------------------
# item 3: resume=never in a used output_dir


@pytest.mark.slow
def test_resume_never_refuses_a_used_dir_and_overwrite_starts_one_history(tmp_path):
    import torch.distributed as dist

    out = tmp_path / "used"
    train(cfg_for(out, "trainer.max_steps=4", "trainer.save_every=2"))
    before = snapshot(out)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="trainer.resume=never.*already holds a run.*"
                                          "trainer.on_existing=archive"):
        train(cfg_for(out, "trainer.max_steps=2", "trainer.save_every=2",
                      "trainer.resume=never"))
    print(f"resume=never in a used dir refused in {time.monotonic() - t0:.2f}s")
    assert snapshot(out) == before

    train(cfg_for(out, "trainer.max_steps=2", "trainer.save_every=2", "trainer.resume=never",
                  "trainer.on_existing=overwrite"))
    assert not (out / "archive").exists()
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_00000002"]
    assert sorted(step_rows(out)) == [1, 2]
    # the next auto launch continues the new history, not the old run's step 4
    train(cfg_for(out, "trainer.max_steps=3", "trainer.save_every=2"))
    resumed = [r for r in rows(out) if r.get("event") == "resume"]
    assert [r["checkpoint"][-13:] for r in resumed] == ["step_00000002"]
    assert sorted(step_rows(out)) == [1, 2, 3]
    assert dist.is_initialized()  # (the group of one is reused by the module)


# ------------------------------------------------------------------------------------------------
# item 5: resuming under a changed config


@pytest.mark.slow
def test_a_resume_on_fewer_ranks_per_step_keeps_the_checkpoint_global_batch(tmp_path, capfd):
    """Issue 28 item 2: the default global batch (micro_batch x ranks) changes with the number
    of ranks, and a resume on another count was refused. Now the checkpoint's global batch is
    kept and gradient accumulation takes up the difference; the losses follow the run that
    never stopped (another summation order: 1e-5)."""
    from llama_train.checkpoint import read_state

    base = ["trainer.save_every=2", "trainer.max_steps=4"]
    whole = train(cfg_for(tmp_path / "whole", *base))
    out = tmp_path / "split"
    train(cfg_for(out, *base, "trainer.steps_this_run=2"))
    capfd.readouterr()
    resumed = train(cfg_for(out, *base, "trainer.micro_batch=2"))
    assert "keeping its global batch of 4 sequences (trainer.micro_batch=2 x 1 rank(s) x 2 " \
        "accumulation steps)" in capfd.readouterr().err
    assert read_state(out / "checkpoints" / "step_00000004")["global_batch"] == 4
    for step in (3, 4):
        assert resumed["losses"][step] == pytest.approx(whole["losses"][step], abs=1e-5)
    # a global batch the user sets against the checkpoint's is refused, with the fix
    with pytest.raises(ConfigError, match="leave trainer.global_batch and trainer.global_batch_"
                                          "tokens unset to keep the checkpoint's"):
        train(cfg_for(out, *base, "trainer.max_steps=6", "trainer.global_batch=8"))


@pytest.mark.slow
def test_changed_run_config_is_refused_unless_allowed_and_safe_changes_are_logged(tmp_path):
    out = tmp_path / "changed"
    base = ["trainer.save_every=2"]
    train(cfg_for(out, *base, "trainer.max_steps=2"))
    before = snapshot(out)
    with pytest.raises(ConfigError) as err:
        train(cfg_for(out, *base, "trainer.max_steps=4", "optim.lr=0.001", "trainer.seed=7",
                      "model.dim=192", "trainer.global_batch=8"))
    msg = str(err.value)
    for needle in ("optim.lr: 0.0003 -> 0.001", "trainer.seed: 1337 -> 7",
                   "model shape (the checkpoint's weights would not load): "
                   "'dim=128, ffn_hidden_dim=384' -> 'dim=192, ffn_hidden_dim=512'",
                   "global batch (sequences per step, as resolved; leave trainer.global_batch "
                   "and trainer.global_batch_tokens unset to keep the checkpoint's, gradient "
                   "accumulation adapts): 4 -> 8",
                   "trainer.allow_config_change=[optim.lr,trainer.seed]"):
        assert needle in msg, msg
    assert "max_steps" not in msg  # safe: not among the refused
    assert snapshot(out) == before

    # a longer run (max_steps) and the logging/eval intervals: allowed, logged in the event
    train(cfg_for(out, *base, "trainer.max_steps=4", "trainer.log_every=2"))
    resumed = [r for r in rows(out) if r.get("event") == "resume"]
    assert resumed[-1]["config_changes"] == {"trainer.max_steps": [2, 4],
                                             "trainer.log_every": [1, 2]}
    # a run-defining change the user asks for
    train(cfg_for(out, *base, "trainer.max_steps=6", "trainer.log_every=2", "optim.lr=0.001",
                  "trainer.allow_config_change=[optim.lr]"))
    resumed = [r for r in rows(out) if r.get("event") == "resume"]
    assert resumed[-1]["config_changes"] == {"optim.lr": [0.0003, 0.001],
                                             "trainer.max_steps": [4, 6]}
    assert max(step_rows(out)) == 6


def test_config_changes_classifies_keys():
    from llama_train.job.resume import config_changes

    old = {"model": {"dim": 64}, "optim": {"lr": 1.0}, "trainer": {"max_steps": 2, "seed": 1,
           "resume": "auto", "micro_batch": 2}, "deepspeed": {"zero_stage": 2,
           "precision": "fp32"}, "data": {"seed": 1, "num_workers": 1}}
    new = {"model": {"dim": 64, "new_key": 3}, "optim": {"lr": 2.0},
           "trainer": {"max_steps": 9, "seed": 1, "resume": "never", "micro_batch": 4},
           "deepspeed": {"zero_stage": 3, "precision": "bf16"},
           "data": {"seed": 2, "num_workers": 4}}
    defining, safe = config_changes(old, new)
    assert [k for k, _, _ in defining] == ["data.seed", "deepspeed.precision", "optim.lr"]
    assert [k for k, _, _ in safe] == ["data.num_workers", "deepspeed.zero_stage",
                                       "trainer.max_steps", "trainer.micro_batch"]


def test_a_saved_boolean_compile_is_the_same_choice_as_its_string():
    """trainer.compile took strings in issue 55 (auto/true/false): a checkpoint's saved
    ``compile: false`` is no change against ``"false"``, and is one against ``"auto"``."""
    from llama_train.job.resume import config_changes

    old = {"trainer": {"compile": False}}
    assert config_changes(old, {"trainer": {"compile": "false"}}) == ([], [])
    assert config_changes({"trainer": {"compile": True}}, {"trainer": {"compile": "true"}}) \
        == ([], [])
    assert config_changes(old, {"trainer": {"compile": "auto"}})[1] == \
        [("trainer.compile", False, "auto")]


# ------------------------------------------------------------------------------------------------
# item 4: the lock, in this process


HOLD = ("import sys, time; from llama_train.job.runlock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, monkeypatch):
    from llama_train.job import runlock
    from llama_train.job.runlock import RunLock, check_not_held_by_another_job, read_record

    out = tmp_path / "locked"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # this "job"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "MASTER_PORT": "2"})
    try:
        assert proc.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            RunLock(str(out)).acquire()
        refused_s = time.monotonic() - t0
        msg = str(err.value)
        assert f"host {socket.gethostname()} pid {proc.pid} since " in msg, msg
        assert "UTC" in msg and "command:" in msg
        with pytest.raises(ConfigError, match=f"pid {proc.pid}"):  # what rank 1 checks
            check_not_held_by_another_job(str(out))
        print(f"second RunLock refused in {refused_s * 1000:.1f} ms")
        proc.send_signal(signal.SIGKILL)  # kill -9: the kernel drops its flock
        proc.wait(timeout=30)
    finally:
        proc.kill()
    check_not_held_by_another_job(str(out))  # pid gone: stale for rank 1 too
    lock = RunLock(str(out)).acquire()
    try:
        assert lock.took_over["pid"] == proc.pid
        assert read_record(out / ".lock")["pid"] == os.getpid()
        check_not_held_by_another_job(str(out))  # our own job
    finally:
        lock.release()
    assert read_record(out / ".lock") is None  # released: the record is cleared

    # a record left by a job on another host (flock free: a node-local lock, or none):
    # refused while its heartbeat is fresh, taken over once it is older than STALE_S
    record = {"host": "other-node", "pid": 4242, "job": "10.0.0.9:29500", "since": time.time(),
              "heartbeat": time.time(), "command": "llama-train ..."}
    (out / ".lock").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="host other-node pid 4242"):
        RunLock(str(out)).acquire()
    record["heartbeat"] = time.time() - runlock.STALE_S - 1
    (out / ".lock").write_text(json.dumps(record))
    lock = RunLock(str(out)).acquire()
    assert lock.took_over["host"] == "other-node"
    lock.release()


def test_a_holder_that_has_exited_but_is_not_yet_reaped_is_gone(tmp_path, monkeypatch):
    """kill -9 of a job with its launcher: its rank 0 (the lock's holder) is a zombie until
    init reaps it, and a relaunch at once found the lock still held by it."""
    from llama_train.job.runlock import RunLock, alive, read_record

    out = tmp_path / "locked"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # this "job"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "MASTER_PORT": "2"})
    try:
        assert proc.stdout.readline().strip() == "held"
        record = read_record(out / ".lock")
        assert alive(record)
        os.kill(proc.pid, signal.SIGKILL)  # not waited for: a zombie until proc.wait()
        assert wait_for(lambda: open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1]
                        .split()[0] == "Z", 30, 0.05)
        assert not alive(record)  # flock: free once its heartbeat thread has exited too
        lock = RunLock(str(out)).acquire()
        assert lock.took_over["pid"] == proc.pid
        lock.release()
    finally:
        proc.kill()
        proc.wait(timeout=30)


HOLD_WITH_KIN = ("import os, sys, time; from llama_train.job.runlock import RunLock; "
                 "RunLock(sys.argv[1]).acquire(); pid = os.fork(); "
                 "time.sleep(2) if pid == 0 else print(pid, flush=True); "
                 "os._exit(0) if pid == 0 else time.sleep(600)")


def test_a_lock_still_held_by_an_ended_holders_exiting_kin_is_waited_for(tmp_path, monkeypatch):
    """The flock belongs to the open file, which a rank's forked DataLoader workers share: after
    a kill -9 of the holder they may hold it a moment longer. The relaunch waits for them
    (runlock.EXITING_S) instead of refusing a directory no job uses."""
    from llama_train.job.runlock import RunLock

    out = tmp_path / "locked"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    proc = subprocess.Popen([sys.executable, "-c", HOLD_WITH_KIN, str(out)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "MASTER_PORT": "2"})
    try:
        kin = int(proc.stdout.readline())  # holds the same open file for ~2 s more
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        lock = RunLock(str(out)).acquire()
        waited = time.monotonic() - t0
        assert lock.took_over["pid"] == proc.pid
        lock.release()
        assert 1.0 < waited < 10, waited  # it waited for the kin (~2 s), then took over
        try:  # the kin has ended: gone, or a zombie until init reaps it
            with open(f"/proc/{kin}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            pass
    finally:
        proc.kill()


def test_lock_heartbeat_is_refreshed(tmp_path, monkeypatch):
    from llama_train.job import runlock
    from llama_train.job.runlock import RunLock, read_record

    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    lock = RunLock(str(tmp_path)).acquire()
    try:
        first = read_record(tmp_path / ".lock")["heartbeat"]
        assert wait_for(lambda: read_record(tmp_path / ".lock")["heartbeat"] > first, 10, 0.02)
    finally:
        lock.release()


# ------------------------------------------------------------------------------------------------
# items 4 and 2 through the launcher: 2 ranks per job


@pytest.mark.slow
def test_second_job_refused_dead_holder_relaunch_and_corrupt_history(tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    args = ["trainer.max_steps=400", "trainer.save_every=10", "trainer.keep_last=2",
            "deepspeed.zero_stage=2"]
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with spawn(launcher_cmd([*TINY, f"trainer.output_dir={out}", *args]), first_log,
               warm=True) as first:
        assert wait_for(lambda: max(losses_so_far(out), default=0) >= 2, 240, 0.1), tail(first_log)
        t0 = time.monotonic()
        with spawn(launcher_cmd([*TINY, f"trainer.output_dir={out}", *args]),
                   second_log, warm=True) as second:
            rc = second.wait(timeout=180)
        refused_s = time.monotonic() - t0
        text = second_log.read_text()
        print(f"second job: exit {rc} after {refused_s:.1f}s (launcher start included)")
        assert rc == 2, tail(second_log)
        holder = json.loads((out / ".lock").read_text())
        assert f"is in use by another job: host {socket.gethostname()} pid {holder['pid']} " \
               f"since" in text, tail(second_log)
        assert "process group up" not in text and "Traceback" not in text
        assert first.poll() is None  # the first job runs on
        assert wait_for(lambda: max(losses_so_far(out), default=0) >= 12, 240, 0.1), tail(first_log)
        os.killpg(first.pid, signal.SIGKILL)  # kill -9 of the holder: its lock must not block
        first.wait(timeout=60)
    killed_at = max(losses_so_far(out))
    latest = find_latest(out / "checkpoints")[0]
    t0 = time.monotonic()
    launch(out, [*args, "trainer.steps_this_run=2"], log_name="relaunch.log")
    print(f"relaunch after kill -9 of the holder: done in {time.monotonic() - t0:.1f}s")
    rel = (tmp_path / "shared-relaunch.log").read_text()
    assert "took over the lock" in rel, rel[-3000:]
    steps = [r["step"] for r in metrics(out) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)), steps  # every step once, none twice
    assert [r["checkpoint"] for r in metrics(out) if r.get("event") == "resume"] == [str(latest)]
    assert killed_at >= 12

    # item 2 with ranks: every checkpoint corrupt -> both ranks exit 3, nothing touched
    for ckpt in (out / "checkpoints").glob("step_*"):
        corrupt(ckpt)
    before = snapshot(out)
    rc = launch(out, args, check=False, log_name="corrupt.log", timeout=180)
    text = (tmp_path / "shared-corrupt.log").read_text()
    assert rc == 3, tail(tmp_path / "shared-corrupt.log")
    # both ranks learn rank 0's decision and exit with it
    assert text.count("llama-train: error: trainer.resume=auto: none of the 2 checkpoint(s)") \
        == 2, tail(tmp_path / "shared-corrupt.log")
    assert "Traceback (most recent call last):\n  File \"/work" not in text.split("atexit")[0]
    assert snapshot(out) == before


def _mount(*args: str) -> str:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    return "" if proc.returncode == 0 else (proc.stderr.strip() or f"mount exit {proc.returncode}")


@pytest.mark.slow
def test_output_dir_turning_read_only_mid_run(tmp_path):
    """2 ranks; the output_dir becomes read-only (a real read-only bind mount) while the job
    logs steps: exit 3 with one message naming the file and the intact checkpoint, no traceback;
    once writable again the relaunch resumes from that checkpoint."""
    out = tmp_path / "ro"
    out.mkdir()
    why = _mount("--bind", str(out), str(out))
    if why:
        pytest.skip(f"cannot bind-mount here: {why}")
    subprocess.run(["umount", str(out)], check=True)
    try:
        launch(out, ["trainer.max_steps=3", "trainer.save_every=3"], log_name="first.log")
        ckpt = out / "checkpoints" / "step_00000003"
        log = tmp_path / "ro-second.log"
        cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", "trainer.max_steps=100000",
                            "trainer.save_every=100000", "comm.timeout_s=20"])
        with spawn(cmd, log, warm=True) as proc:
            assert wait_for(lambda: max(losses_so_far(out), default=0) >= 5 or proc.poll() is not None,
                            240, 0.05), tail(log)
            # a read-only mount stacked on the directory: the job's open files (its lock) stay
            # on the mount below, every new open goes through this one
            why = _mount("--bind", str(out), str(out)) or _mount("-o", "remount,bind,ro", str(out))
            assert not why, why
            rc = proc.wait(timeout=120)
        text = log.read_text(errors="replace")
        # rank 0's; rank 1 may add that it lost rank 0 before the launcher stops it
        errors = [line for line in text.splitlines()
                  if line.startswith("llama-train: error: cannot write")]
        assert rc == 3, tail(log)
        assert len(errors) == 1 and "metrics.jsonl: Read-only file system" in errors[0] \
            and f"the last complete checkpoint, {ckpt}, is intact" in errors[0], errors
        assert "Traceback" not in text, tail(log)
        subprocess.run(["umount", str(out)], check=True)
        assert find_latest(out / "checkpoints")[0] == ckpt  # verifies (sha256 of every file)
        launch(out, ["trainer.max_steps=5"], log_name="third.log")
        assert [r["checkpoint"] for r in metrics(out) if r.get("event") == "resume"][-1] \
            == str(ckpt)
        assert max(losses_so_far(out)) == 5
    finally:
        subprocess.run(["umount", "-l", str(out)], capture_output=True)
