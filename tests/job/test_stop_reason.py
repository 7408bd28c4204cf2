"""Why a stopped job stopped, as rank 0 says it: the same whichever rank saw the cause first.

A SIGTERM to the ``deepspeed`` command alone (single node: it dies without passing it on) is
seen by each rank's watcher of the runner (``proc._watch_runner``, once a second), which sends
that rank SIGTERM; the ranks agree to stop at the next step. Rank 0 used to say "stopped by a
signal to another rank" when rank 1's watcher fired first, "stopped by SIGTERM" otherwise
(tests/system/test_launcher_runs.py's sigterm-to-deepspeed case failed a CI run so)."""

from __future__ import annotations

import os
import signal

from llama_train import proc
from llama_train.job.trainer import StopSignals


def test_a_rank_told_by_another_says_the_sigterm_its_own_watcher_would_send():
    stop = StopSignals()
    try:
        told = stop.stopped_line(4, "ckpt", "deepspeed x", "auto")
        gone = stop.stopped_line(4, "ckpt", "deepspeed x", "auto", gone="runner")
        stop.received.append(signal.SIGINT)
        own = stop.stopped_line(4, "ckpt", "deepspeed x", "auto", gone="runner")
    finally:
        stop.restore()
    assert told.startswith("stopped by a signal to another rank: saved step 4")
    assert gone.startswith("stopped by SIGTERM: saved step 4, exiting (ckpt); resume with: "
                           "deepspeed x")
    assert own.startswith("stopped by Ctrl-C (SIGINT)")  # its own signal comes first


def test_the_runner_is_seen_gone_at_once_not_only_by_the_watcher(monkeypatch):
    """launcher_gone() looks now: the launcher (here: this process's parent) no longer a child of
    the runner it started under."""
    parent = os.getppid()
    grandparent = proc._parent_of(parent)
    monkeypatch.setattr(proc, "_launcher_pid", parent)
    monkeypatch.setattr(proc, "_runner_lost", False)
    monkeypatch.setattr(proc, "_runner_pid", grandparent)
    assert proc.launcher_gone() is None  # the launcher's parent is still the runner
    monkeypatch.setattr(proc, "_runner_pid", grandparent + 10**7)  # the runner it had is gone
    assert proc.launcher_gone() == "runner"
    monkeypatch.setattr(proc, "_launcher_pid", parent + 10**7)  # this rank re-parented
    assert proc.launcher_gone() == "launcher"
