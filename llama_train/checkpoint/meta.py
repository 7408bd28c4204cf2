"""What a checkpoint's trainer_state.json says about the run that saved it, typed: the record
the resume check (llama_train.job.resume) and preflight read instead of the file's keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from llama_train.checkpoint.discovery import read_state


@dataclass(frozen=True)
class CheckpointMeta:
    """The facts of a save that decide whether and how it continues a run.

    ``world_size``, ``zero_stage`` and ``global_batch`` are in every trainer_state.json a save
    wrote (a state without them raises KeyError naming the key, as reading it did); the rest
    may be absent from a state written by hand."""

    world_size: int
    zero_stage: int
    global_batch: int  # sequences per optimizer step, as resolved
    step: Optional[int] = None
    tokens: Optional[int] = None
    seq_len: Optional[int] = None
    simulated: Optional[Dict[str, int]] = None  # {"ranks", "rank"}: saved by a simulated rank

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "CheckpointMeta":
        """From a trainer_state.json already read (:func:`read_state`)."""
        return cls(world_size=state["world_size"], zero_stage=state["zero_stage"],
                   global_batch=state["global_batch"], step=state.get("step"),
                   tokens=state.get("tokens"), seq_len=state.get("seq_len"),
                   simulated=state.get("simulated"))

    @classmethod
    def of(cls, state: Union["CheckpointMeta", Mapping[str, Any]]) -> "CheckpointMeta":
        """``state`` itself, or the record of a trainer_state.json dict."""
        return state if isinstance(state, CheckpointMeta) else cls.from_state(state)

    @classmethod
    def read(cls, ckpt: Path) -> "CheckpointMeta":
        """From ``ckpt``'s trainer_state.json; CheckpointError naming it if it cannot be read."""
        return cls.from_state(read_state(ckpt))
