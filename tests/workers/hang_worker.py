"""Rank program for tests/system/test_hang.py: ``llama-train`` itself, with two test-only additions.

* A hook reports the step to the watchdog as each step begins, and the eval phase, as the
  trainer's own calls do (``watchdog.note(step=..., phase="train")``).
* ``HANG_WORKER_STOP=<phase>:<rank>:<step>[:<signal>]`` makes that rank stop itself (SIGSTOP;
  ``kill``: SIGKILL) inside that phase of that step: ``eval`` as the evaluation of the step
  starts, ``save`` half-way through the checkpoint of the step (after DeepSpeed's first file,
  or its first copy to host memory when the save is asynchronous, the default),
  ``load`` half-way through resuming the checkpoint of that step (after the first file read).

Started by ``deepspeed`` (forked from the warm parent: tests/warm_ranks.py) with Hydra
overrides, like ``llama_train.train``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from llama_train import watchdog
from llama_train.hooks import Hook


def _stop_plan():
    spec = os.environ.get("HANG_WORKER_STOP")
    if not spec:
        return None
    phase, rank, step, *sig = spec.split(":")
    return phase, int(rank), int(step), signal.SIGKILL if sig == ["kill"] else signal.SIGSTOP


class Position(Hook):
    def on_step_begin(self, step: int) -> None:
        watchdog.note(step=step, phase="train")


def _stop_here(phase: str) -> None:
    plan = _stop_plan()
    step, now = watchdog.position()
    if plan and plan[0] == phase and now == phase and plan[2] == step \
            and plan[1] == int(os.environ.get("RANK", -1)):
        print(f"hang_worker: rank {plan[1]} stops itself in {phase} of step {step}",
              file=sys.stderr, flush=True)
        time.sleep(2.5)  # its peers read the phase (they look once a second), as in a longer one
        os.kill(os.getpid(), plan[3])


def _instrument() -> None:
    import torch

    from llama_train.engine import wrapper
    from llama_train.job.trainer import Trainer

    evaluate = Trainer.evaluate

    def evaluate_noted(self):
        with watchdog.phase("eval"):
            _stop_here("eval")
            return evaluate(self)

    Trainer.evaluate = evaluate_noted
    torch.save = _then_stop(torch.save, "save")  # after DeepSpeed's first file of a save
    # trainer.async_save: the loop's part of a save copies DeepSpeed's states to host memory
    # (the files are written by a thread, after the loop has left the save)
    wrapper.host_copy = _then_stop(wrapper.host_copy, "save")
    torch.load = _then_stop(torch.load, "load")  # after the first file read of a resume


def _then_stop(fn, phase: str):
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        _stop_here(phase)
        return out

    return call


if __name__ == "__main__":
    from llama_train.train import main

    _instrument()
    main(hooks=[Position()])
