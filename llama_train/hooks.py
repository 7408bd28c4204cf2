"""Callbacks a :class:`~llama_train.trainer.Trainer` calls at fixed points of a step.

Everything that is not training itself but wants a say in the loop plugs in here instead of
patching modules: fault injection (llama_train.faults), the lock-step turns of ``llama-bench
train``. The base class does nothing.
"""

from __future__ import annotations

from typing import Any, Dict


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
