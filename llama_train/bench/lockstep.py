"""Lock-step process control for ``llama-bench train``: the bench lets each side run one training
step at a time, alternating (ours step 1, hf step 1, ours step 2, ...), so that a burst of load from
other jobs hits both sides alike.

* :class:`Turns`: the worker's end, over two pipes inherited from the bench;
* :class:`TurnsHook`: ``Turns`` as a :class:`llama_train.hooks.Hook` of the real trainer, which is
  how the `ours` side runs ``llama_train.train.main()`` unmodified (:func:`run_ours`);
* :class:`Side`: the bench's end, one worker process in its own session.
"""

from __future__ import annotations

import os
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from llama_train.hooks import Hook
from llama_train.proc import kill_session


class Turns:
    """Lock-step turns between the bench and one worker, over two inherited pipes.

    The worker calls ``begin()`` before each training step (it blocks until the bench says go)
    and ``end()`` after it; the bench alternates go's between the two sides, so step k of `ours`
    and step k of `hf` run back to back and meet the same machine load. A no-op when the
    worker was not started in lock step (``LLAMA_BENCH_TURNS`` unset).
    """

    ENV = "LLAMA_BENCH_TURNS"

    def __init__(self) -> None:
        fds = os.environ.get(self.ENV)
        self.go, self.done = (int(f) for f in fds.split(",")) if fds else (None, None)
        self.started = False

    def begin(self) -> None:
        """Wait for our turn. The first call first reports start-up done."""
        if self.go is None:
            return
        if not self.started:
            self.started = True
            os.write(self.done, b"r")
        if not os.read(self.go, 1):
            raise SystemExit("llama-bench train: the bench went away")

    def end(self) -> None:
        if self.done is not None:
            os.write(self.done, b"d")


class TurnsHook(Hook):
    """The trainer takes its turn before each step (outside the step's timer, so
    ``step_time_s`` in metrics.jsonl holds the step alone) and hands it back once the step was
    logged, evaluated and saved."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns

    def on_step_begin(self, step: int) -> None:
        self.turns.begin()

    def on_step_end(self, step: int, metrics: dict) -> None:
        self.turns.end()


def run_ours(overrides: List[str]) -> None:
    """The `ours` side: ``llama_train.train.main()`` with these Hydra overrides and the turns."""
    from llama_train import train

    sys.argv = [sys.argv[0], *overrides]
    train.main(hooks=[TurnsHook(Turns())])


class Side:
    """One worker process started by the bench (its own session, killed with its children)."""

    def __init__(self, name: str, cmd: List[str], log: Path, env: Dict[str, str], lockstep: bool):
        self.name, self.cmd, self.log, self.alive = name, cmd, log, True
        self.t0 = time.perf_counter()
        self.go_w = self.done_r = None
        fds: tuple = ()
        if lockstep:
            go_r, self.go_w = os.pipe()
            self.done_r, done_w = os.pipe()
            env = {**env, Turns.ENV: f"{go_r},{done_w}"}
            fds = (go_r, done_w)
        self.fh = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.fh, stderr=subprocess.STDOUT,
                                     start_new_session=True, pass_fds=fds)
        for fd in fds:  # the child's ends: closed here so its exit reads as EOF
            os.close(fd)

    def turn(self, timeout: float, go: bool = True) -> None:
        """Let the worker run one step; returns when it says done or has exited. With
        ``go=False``: only wait for its start-up to finish (its first ``Turns.begin``)."""
        if not self.alive:
            return
        try:
            if go:
                os.write(self.go_w, b"g")
        except BrokenPipeError:
            self.alive = False
            return
        deadline = time.perf_counter() + timeout
        while True:
            ready, _, _ = select.select([self.done_r], [], [], 1.0)
            if ready:
                self.alive = os.read(self.done_r, 1) != b""  # EOF: finished (or died)
                return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name}: no step finished within {timeout:.0f}s "
                                   f"(--timeout): {shlex.join(self.cmd)}")

    def wait(self, timeout: float) -> float:
        """Wait for exit, raise with the log's tail unless it succeeded; wall seconds."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        self.kill()
        if rc != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
            why = f"timed out after {timeout:.0f}s (--timeout)" if rc is None else f"exit {rc}"
            raise RuntimeError(f"{self.name}: {why}: {shlex.join(self.cmd)}\n"
                               f"--- {self.log} (tail) ---\n{tail}")
        return time.perf_counter() - self.t0

    def kill(self) -> None:
        """Once: the process group goes (its pgid is never signalled again afterwards)."""
        if self.fh.closed:
            return
        kill_session(self.proc)
        for fd in (self.go_w, self.done_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.go_w = self.done_r = None
        self.fh.close()
