"""Counted traffic: every collective a rank runs, by kind, group size, bytes and phase.

Two counters write into :class:`TrafficCounter`, one per kind of process group:

* a real rank (``comm.count_traffic=true``): :func:`install` wraps the ``torch.distributed``
  collectives (module functions, before DeepSpeed's comm backend starts, which keeps its own
  references to the all-gather and reduce-scatter functions it finds then), so every call from
  DeepSpeed, our trainer or torch itself is seen once (a collective that calls another inside
  it, e.g. the deprecated ``_all_gather_base``, counts as the outer one);
* a simulated rank (``comm.simulate_ranks``): :class:`llama_train.comm.simulate.MirrorGroup`
  counts what it is asked, at the process group's level, always.

Why our own wrapper rather than DeepSpeed's comms logger: the logger sees only what goes through
``deepspeed.comm`` (not our loss all-reduce, which uses ``torch.distributed``), it is off unless
``comms_logger`` is set in DeepSpeed's JSON (a key our config owns), and it reports message
sizes under its own per-op convention (e.g. an all-gather's input, not its output) rounded in
its summary; a wrapper gives the exact bytes of each call under one convention.

The bytes of a collective are those of the whole buffer it is about (``S`` of the ring
formulas, what :mod:`llama_train.scaling.traffic` plans): an all-reduce's tensor, an
all-gather's output (N times its input), a reduce-scatter's input (N times its output), a
broadcast's tensor, an all-to-all's input. Barriers count as calls of 0 bytes.

The phase is the step's part the trainer is in (set by the metered engine,
:class:`llama_train.job.simulation.MeteredEngine`): ``forward``, ``backward`` (including DeepSpeed's
step between micro-batches), ``step`` (from the end of a backward to the end of the optimizer
step: our loss all-reduce and DeepSpeed's step), ``eval`` (the engine in eval mode), ``other``
(start-up, between steps: saves, logging), ``background`` (a thread other than the main one:
an asynchronous save's group).
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
         "gather", "scatter", "barrier")
STEP_PHASES = ("forward", "backward", "step")  # what one optimizer step's traffic is made of
KEPT_STEPS = 16  # steps whose collectives are kept one by one (later steps: totals only)
TRAFFIC_DIR = "traffic"  # under trainer.output_dir: traffic/rank_00000.json per rank


def traffic_file(output_dir, rank: int) -> Path:
    """Where rank ``rank`` of a counted run writes its counts (:meth:`TrafficCounter.to_dict`)."""
    return Path(output_dir) / TRAFFIC_DIR / f"rank_{rank:05d}.json"


def nbytes(t) -> int:
    return int(t.numel()) * int(t.element_size())


class TrafficCounter:
    """Collectives by step (1-based, the steps this process ran), phase, kind and group size:
    calls and bytes. Steps past :data:`KEPT_STEPS` are added to ``later`` only."""

    def __init__(self) -> None:
        self.phase = "other"
        self.step = 1  # the step the next training collective belongs to
        self.steps: Dict[int, Dict[str, Dict[str, Dict[int, List[int]]]]] = {}
        self.later: Dict[str, Dict[str, Dict[int, List[int]]]] = {}
        self.outside: Dict[str, Dict[str, Dict[int, List[int]]]] = {}  # other/eval/background
        self.steps_done = 0
        self._lock = threading.Lock()
        self.path: Optional[Path] = None

    def add(self, kind: str, group_size: int, nbytes_: int, calls: int = 1) -> None:
        main = threading.current_thread() is threading.main_thread()
        phase = self.phase if main else "background"
        with self._lock:
            if phase in STEP_PHASES:
                book = (self.steps.setdefault(self.step, {}) if self.step <= KEPT_STEPS
                        else self.later)
            else:
                book = self.outside
            row = book.setdefault(phase, {}).setdefault(kind, {}).setdefault(int(group_size),
                                                                              [0, 0])
            row[0] += calls
            row[1] += int(nbytes_)

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def step_done(self) -> None:
        """The optimizer step ended: what follows belongs to no step until the next forward."""
        self.steps_done += 1
        self.step += 1
        self.phase = "other"
        if self.path is not None:
            self.write(self.path)

    def to_dict(self) -> Dict[str, Any]:
        def rows(book):
            return [{"phase": ph, "kind": k, "group_size": g, "calls": c, "bytes": b}
                    for ph, kinds in book.items() for k, groups in kinds.items()
                    for g, (c, b) in sorted(groups.items())]

        with self._lock:
            return {"steps_done": self.steps_done,
                    "steps": {str(s): rows(book) for s, book in sorted(self.steps.items())},
                    "later_steps": rows(self.later), "outside_steps": rows(self.outside)}

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)


def per_kind(rows: Iterable[Dict[str, Any]]) -> Dict[str, int]:
    """Bytes per collective kind of some rows (one step's, or a plan's collectives)."""
    out: Dict[str, int] = {}
    for r in rows:
        out[r["kind"]] = out.get(r["kind"], 0) + int(r["bytes"])
    return out


def per_key(rows: Iterable[Dict[str, Any]]) -> Dict[tuple, List[int]]:
    """(phase, kind, group_size) -> [calls, bytes] of some rows."""
    out: Dict[tuple, List[int]] = {}
    for r in rows:
        key = (r["phase"], r["kind"], int(r["group_size"]))
        acc = out.setdefault(key, [0, 0])
        acc[0] += int(r.get("calls", 1))
        acc[1] += int(r["bytes"])
    return out


def step_summary(counted: Dict[str, Any]) -> Dict[str, Any]:
    """A counter's dict (:meth:`TrafficCounter.to_dict`) as one optimizer step's traffic: the
    last kept step, its rows and its bytes per kind; ``all_steps_equal``: every kept step from
    the third on has the same bytes per phase, kind and group size (the first two differ at
    ZeRO-3 by start-up work: see below). Count three steps or more to read a steady one."""
    steps = counted.get("steps") or {}
    if not steps:
        return {"step": None, "rows": [], "bytes_per_kind": {}, "all_steps_equal": True}
    last = max(steps, key=int)
    rows = steps[last]

    def key_bytes(rs):
        return {k: b for k, (_, b) in per_key(rs).items()}

    # the first two steps may differ, once: ZeRO-3 gathers its persistent parameters at their
    # first use, and checks that every rank traced the same modules (broadcasts) when its trace
    # completes (step 2's first forward; a real rank only: a simulated one has no peers)
    same = all(key_bytes(r) == key_bytes(rows) for s, r in steps.items() if int(s) > 2)
    return {"step": int(last), "rows": rows, "bytes_per_kind": per_kind(rows),
            "all_steps_equal": same,
            "bytes_per_kind_by_step": {s: per_kind(r) for s, r in steps.items()}}


# -- the real rank's wrapper -----------------------------------------------------------------
_COUNTER: Optional[TrafficCounter] = None
_DEPTH = threading.local()


def active() -> Optional[TrafficCounter]:
    """This process's counter, if its collectives are counted."""
    return _COUNTER


def start() -> TrafficCounter:
    """A counter for this process (a new one each time: a program may train twice)."""
    global _COUNTER
    _COUNTER = TrafficCounter()
    return _COUNTER


def stop() -> None:
    global _COUNTER
    _COUNTER = None


def _tensors(x) -> List[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _sum(xs) -> int:
    return sum(nbytes(t) for t in _tensors(xs))


# torch.distributed function -> (kind, the argument whose bytes count, how to count it)
_WRAPPED: Dict[str, tuple] = {
    "all_reduce": ("all_reduce", "tensor", _sum),
    "all_reduce_coalesced": ("all_reduce", "tensors", _sum),
    "reduce": ("reduce", "tensor", _sum),
    "broadcast": ("broadcast", "tensor", _sum),
    "all_gather": ("all_gather", "tensor_list", _sum),
    "all_gather_into_tensor": ("all_gather", "output_tensor", _sum),
    "_all_gather_base": ("all_gather", "output_tensor", _sum),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists",
                             lambda ls: sum(_sum(x) for x in ls)),
    "reduce_scatter": ("reduce_scatter", "input_list", _sum),
    "reduce_scatter_tensor": ("reduce_scatter", "input", _sum),
    "_reduce_scatter_base": ("reduce_scatter", "input", _sum),
    "all_to_all_single": ("all_to_all", "input", _sum),
    "all_to_all": ("all_to_all", "input_tensor_list", _sum),
    "gather": ("gather", "tensor", _sum),
    "scatter": ("scatter", "tensor", _sum),
    "barrier": ("barrier", None, None),
    "monitored_barrier": ("barrier", None, None),
}
_ORIGINAL: Dict[str, Callable] = {}


def _counted(name: str, fn: Callable) -> Callable:
    kind, arg, size = _WRAPPED[name]
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_DEPTH, "n", 0)
        counter = _COUNTER
        if counter is not None and depth == 0:
            import torch.distributed as dist

            bound = sig.bind_partial(*args, **kwargs)
            group = bound.arguments.get("group")
            n = dist.get_world_size(group) if group is not None else dist.get_world_size()
            counter.add(kind, n, size(bound.arguments[arg]) if arg else 0)
        _DEPTH.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH.n = depth

    wrapper.__wrapped_by_llama_train__ = True
    return wrapper


def install() -> TrafficCounter:
    """Count this process's ``torch.distributed`` collectives from now on (a real rank's
    ``comm.count_traffic=true``); before DeepSpeed's comm backend starts. Returns the counter."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in _WRAPPED:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__wrapped_by_llama_train__", False):
            continue
        _ORIGINAL[name] = fn
        wrapped = _counted(name, fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    return start()


def uninstall() -> None:
    """Put ``torch.distributed``'s own functions back and stop counting."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name, fn in _ORIGINAL.items():
        if getattr(getattr(dist, name, None), "__wrapped_by_llama_train__", False):
            setattr(dist, name, fn)
        setattr(c10d, name, fn)
    _ORIGINAL.clear()
    stop()
