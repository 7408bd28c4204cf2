"""Callbacks a :class:`~llama_train.job.trainer.Trainer` calls at fixed points of a step.

Everything that is not training itself but wants a say in the loop plugs in here instead of
patching modules: fault injection (llama_train.job.faults), the lock-step turns of ``llama-bench
train``. The base class does nothing. The checkpoint manager calls the two checkpoint hooks
around the files of a save, so a fault can be injected exactly there.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager, Dict


class Hook:
    def on_step_begin(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run: before its data is read and before its timer
        starts, so time spent here is not in ``step_time_s``."""

    def on_loss(self, batch: int, loss: Any) -> Any:
        """The loss of one micro-batch of global batch ``batch`` of the data stream (1-based),
        before backward; returns the loss to use."""
        return loss

    def on_step_end(self, step: int, metrics: Dict[str, Any]) -> None:
        """After the step was logged, evaluated and checkpointed; ``metrics`` is what was logged
        for it ({} when it was not a log step)."""

    def on_checkpoint_dir(self, step: int, path: Path) -> None:
        """Rank 0 is about to create the partial directory ``path`` of step ``step``'s save;
        raising OSError here is a save that cannot even start."""

    def checkpoint_writes(self, step: int) -> ContextManager[None]:
        """Entered around this rank's file writes of step ``step``'s save (DeepSpeed's shards and
        the rank's own state)."""
        return contextlib.nullcontext()
