"""What a checkpoint carries of the training process, part by part.

:class:`StateRegistry`: the trainer registers its stateful parts by name (the train state, the
data position, the tracker, the facts of the run a resume is judged by; per rank, the RNGs),
each with ``state_dict()`` / ``load_state_dict()``. A save builds ``trainer_state.json`` (and
each rank's ``ranks/rank_N.pt``) from the registry, in the order the parts were registered,
which is the file's key order; a load hands each part its entry back. A plain value rides in
a tiny adapter (:class:`Fixed`), the RNGs in :class:`RngState`, so the files keep their format.

The per-rank state is plain tensors and ints, so ``torch.load(weights_only=True)`` loads it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Dict, List, Protocol

import numpy as np
import torch


class Stateful(Protocol):
    """A part of a checkpoint: what it saves, and how it takes that back."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


# ----------------------------------------------------------------------------------------------
# RNG


def rng_state() -> Dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": np_state[0], "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached": float(np_state[4]), "state": torch.from_numpy(np_state[1].copy())},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["key"], n["state"].numpy(), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RngState:
    """This process's random generators (Python's, NumPy's, torch's, CUDA's) as a part."""

    def state_dict(self) -> Dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        set_rng_state(state)


class Fixed:
    """Plain values saved as they are and never loaded back: facts of the save (the world size
    it ran on, its ZeRO stage, global batch...) that a resume is judged by (llama_train.job.resume),
    not state to restore. Registered with ``restore=False``: a checkpoint a run may continue
    can lack one (a simulated rank continuing a real checkpoint has no ``simulated`` entry)."""

    def __init__(self, values: Dict[str, Any]):
        self.values = dict(values)

    def state_dict(self) -> Dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class _Part:
    name: str
    part: Stateful
    merged: bool  # its keys at the top level of the saved dict (else under ``name``)
    restore: bool


class StateRegistry:
    """Named stateful parts; :meth:`state_dict` is what a checkpoint saves of them,
    :meth:`load_state_dict` hands each part its entry back.

    A part is saved under its name, or ``merged``: its own keys at the top level (the train
    state's ``step``, ``tokens``...), and then it gets the whole saved dict back, as it reads
    only its own keys. ``restore=False``: saved, but loaded back by its owner, who needs more
    than the entry (the tracker: whether the checkpoint is another run's)."""

    def __init__(self) -> None:
        self._parts: List[_Part] = []

    def register(self, name: str, part: Stateful, merged: bool = False,
                 restore: bool = True) -> Stateful:
        """Add ``part`` after those registered before (its place in the saved dict); returns
        it."""
        if name in self.names():
            raise RuntimeError(f"a state part named {name!r} is registered already")
        self._parts.append(_Part(name, part, merged, restore))
        return part

    def names(self) -> List[str]:
        return [p.name for p in self._parts]

    def state_dict(self) -> Dict[str, Any]:
        """Every part's state, in registration order: a merged part's keys, or its name."""
        out: Dict[str, Any] = {}
        for p in self._parts:
            entries = p.part.state_dict() if p.merged else {p.name: p.part.state_dict()}
            clash = sorted(set(entries) & set(out))
            if clash:
                raise RuntimeError(f"state part {p.name!r} saves {clash}, saved already by "
                                   f"another part")
            out.update(entries)
        return out

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Each part that restores, in registration order, gets its entry (``saved[name]``; a
        merged part: all of ``saved``). A missing entry is a KeyError naming it."""
        for p in self._parts:
            if p.restore:
                p.part.load_state_dict(saved if p.merged else saved[p.name])
