"""Faults on purpose, and naming the rank that is gone when one happens by accident.

Injection (tests and fire drills; nothing here is active unless asked for) is one
:class:`~llama_train.hooks.Hook`, :class:`FaultInjector`, driven by ``LLAMA_TRAIN_FAULTS``:
``;``-separated items, each ``kind:key=value,...``::

    nan:batch=3                             the loss of global batch 3 is NaN (repeat the item
                                            for more batches)
    loss_scale:batch=9,factor=1000          multiply the loss of global batch 9 (a loss spike)
    exit:step=5[,rank=0][,code=17]          that rank dies without warning (os._exit) as step 5
                                            begins
    hang:step=5[,rank=0][,seconds=S]        that rank's loop stops as step 5 begins (sleeps S
                                            seconds, default for ever) while its threads, the
                                            watchdog's heartbeat among them, run on
    save_error:step=4,rank=1,errno=ENOSPC   the save of step 4 fails on rank 1 part-way: its
                                            1st file write (write=K: the K-th) stops half
                                            written with OSError(ENOSPC)
    save_error:step=4,rank=0,errno=EROFS,at=mkdir   rank 0 cannot create the checkpoint dir
    slow_save:step=4[,rank=1],seconds=S     that rank's file writes of the save of step 4 start
                                            S seconds late (a slow disk; with trainer.async_save
                                            the loop trains on meanwhile); every rank without
                                            rank=
    nan_weights:step=3[,rank=1]             the first optimizer step from step 3 on leaves every
                                            weight that rank updates NaN (as optim.lr=inf did);
                                            under ZeRO the rank's own partition only
    convert_error:errno=ENOSPC              the universal conversion (a resume on a new world
                                            size) fails part-way: its 1st file write stops half
                                            written with that OSError (read by the conversion's
                                            child, llama_train.engine.ds_checkpoint)
    worker_kill:step=5[,rank=0][,signal=KILL]   as step 5 begins, that rank's DataLoader workers
                                            get the signal (KILL: what the kernel's OOM killer
                                            sends; SEGV, BUS: a crash) and are gone before the
                                            step reads its batch

Batches are counted in the data stream (global batch b = samples [(b-1)G, bG)), not in optimizer
steps, so an injected bad batch stays bad when a rollback replays steps, as real bad data would.

Diagnosis: when a collective fails (a peer process died, or hung past ``comm.timeout_s``), the
survivors check in at the rendezvous store and name the ranks that did not
(:func:`diagnose_lost_ranks`). The launcher's own "exits with return code" line shows the command
of the *last* rank it started, whichever rank died, so it cannot be trusted to name the rank.
"""

from __future__ import annotations

import contextlib
import datetime
import errno as errno_mod
import io
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set

from llama_train.errors import BadInput
from llama_train.hooks import Hook

ENV = "LLAMA_TRAIN_FAULTS"
KINDS = ("nan", "loss_scale", "exit", "hang", "save_error", "nan_weights", "convert_error",
         "slow_save", "worker_kill")


class FaultSpecError(BadInput):
    """A malformed LLAMA_TRAIN_FAULTS value."""


@dataclass
class SaveFault:
    step: int
    rank: int
    errno: int
    write: int = 1  # which torch.save call of that save fails (1-based)
    at: str = "write"  # write | mkdir


@dataclass
class ExitFault:
    step: int
    rank: int = 0
    code: int = 17


@dataclass
class HangFault:
    step: int
    rank: int = 0
    seconds: float = float("inf")


@dataclass
class NanWeightsFault:
    step: int
    rank: int = 0


@dataclass
class SlowSaveFault:
    step: int
    seconds: float
    rank: Optional[int] = None  # None: every rank


@dataclass
class WorkerKillFault:
    step: int
    rank: int = 0
    signal: int = 9  # SIGKILL


@dataclass
class FaultPlan:
    nan_batches: Set[int] = field(default_factory=set)
    loss_scale: Dict[int, float] = field(default_factory=dict)
    exits: List[ExitFault] = field(default_factory=list)
    hangs: List[HangFault] = field(default_factory=list)
    save_errors: List[SaveFault] = field(default_factory=list)
    nan_weights: List[NanWeightsFault] = field(default_factory=list)
    slow_saves: List[SlowSaveFault] = field(default_factory=list)
    worker_kills: List[WorkerKillFault] = field(default_factory=list)
    convert_errno: Optional[int] = None  # convert_error: read by the conversion's child

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        plan = cls()
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            kind, _, rest = item.partition(":")
            try:
                kv = dict(p.split("=", 1) for p in rest.split(",") if p)
            except ValueError:
                raise FaultSpecError(f"{ENV}: {item!r} is not kind:key=value,...") from None
            try:
                plan._add(kind, kv, item)
            except KeyError as e:
                raise FaultSpecError(f"{ENV}: {item!r} needs {e.args[0]}=...") from None
            except ValueError as e:
                if isinstance(e, FaultSpecError):
                    raise
                raise FaultSpecError(f"{ENV}: {item!r}: {e}") from None
        return plan

    def _add(self, kind: str, kv: Dict[str, str], item: str) -> None:
        if kind == "nan":
            self.nan_batches.add(int(kv["batch"]))
        elif kind == "loss_scale":
            self.loss_scale[int(kv["batch"])] = float(kv["factor"])
        elif kind == "exit":
            self.exits.append(ExitFault(int(kv["step"]), int(kv.get("rank", 0)),
                                        int(kv.get("code", 17))))
        elif kind == "hang":
            self.hangs.append(HangFault(int(kv["step"]), int(kv.get("rank", 0)),
                                        float(kv.get("seconds", "inf"))))
        elif kind == "save_error":
            code = kv.get("errno", "ENOSPC")
            if not hasattr(errno_mod, code):
                raise FaultSpecError(f"{ENV}: unknown errno {code!r} in {item!r}")
            at = kv.get("at", "write")
            if at not in ("write", "mkdir"):
                raise FaultSpecError(f"{ENV}: at={at!r} must be write or mkdir ({item!r})")
            self.save_errors.append(SaveFault(int(kv["step"]), int(kv.get("rank", 0)),
                                              getattr(errno_mod, code), int(kv.get("write", 1)),
                                              at))
        elif kind == "slow_save":
            self.slow_saves.append(SlowSaveFault(int(kv["step"]), float(kv["seconds"]),
                                                 int(kv["rank"]) if "rank" in kv else None))
        elif kind == "worker_kill":
            self.worker_kills.append(WorkerKillFault(int(kv["step"]), int(kv.get("rank", 0)),
                                                     _signal_number(kv.get("signal", "KILL"))))
        elif kind == "nan_weights":
            self.nan_weights.append(NanWeightsFault(int(kv["step"]), int(kv.get("rank", 0))))
        elif kind == "convert_error":
            code = kv.get("errno", "ENOSPC")
            if not hasattr(errno_mod, code):
                raise FaultSpecError(f"{ENV}: unknown errno {code!r} in {item!r}")
            self.convert_errno = getattr(errno_mod, code)
        else:
            raise FaultSpecError(f"{ENV}: unknown fault kind {kind!r} in {item!r}; use one of "
                                 f"{', '.join(KINDS)}")

    @classmethod
    def from_env(cls) -> "FaultPlan":
        return cls.parse(os.environ.get(ENV, ""))

    def loss_factor(self, batch: int) -> float:
        return self.loss_scale.get(batch, 1.0)


class FaultInjector(Hook):
    """The faults of a :class:`FaultPlan` for one rank, as a hook on the loop and on the
    checkpoint manager's saves."""

    def __init__(self, plan: FaultPlan, rank: int):
        self.plan, self.rank = plan, rank

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjector":
        return cls(FaultPlan.from_env(), rank)

    def on_step_begin(self, step: int) -> None:
        for f in self.plan.exits:
            if f.step == step and f.rank == self.rank:
                os._exit(f.code)  # a rank dies without warning
        for h in self.plan.hangs:
            if h.step == step and h.rank == self.rank:
                _stall(h.seconds)  # a loop stuck where the watchdog still hears its heartbeat
        for f in self.plan.nan_weights:
            if f.step == step and f.rank == self.rank:
                _poison_next_optimizer_step()
        for k in self.plan.worker_kills:
            if k.step == step and k.rank == self.rank:
                _kill_data_workers(k.signal)

    def on_loss(self, batch: int, loss):
        if batch in self.plan.nan_batches:
            loss = loss * float("nan")  # a batch with a non-finite loss
        factor = self.plan.loss_factor(batch)
        return loss * factor if factor != 1.0 else loss  # a loss spike

    def _save_fault(self, step: int, at: str) -> Optional[SaveFault]:
        for f in self.plan.save_errors:
            if f.step == step and f.rank == self.rank and f.at == at:
                return f
        return None

    def on_checkpoint_dir(self, step: int, path) -> None:
        f = self._save_fault(step, "mkdir")
        if f is not None:
            raise OSError(f.errno, os.strerror(f.errno), str(path))

    @contextlib.contextmanager
    def checkpoint_writes(self, step: int) -> Iterator[None]:
        """During one checkpoint save: the planned ``torch.save`` call writes half its bytes and
        raises, like a disk that fills up in the middle of a file."""
        for slow in self.plan.slow_saves:
            if slow.step == step and slow.rank in (None, self.rank):
                time.sleep(slow.seconds)
        f = self._save_fault(step, "write")
        if f is None:
            yield
            return
        import torch

        real_save, calls = torch.save, [0]

        def save(obj, target, *args, **kwargs):
            calls[0] += 1
            if calls[0] != f.write or not isinstance(target, (str, os.PathLike)):
                return real_save(obj, target, *args, **kwargs)
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            with open(target, "wb") as fh:
                fh.write(buf.getvalue()[: buf.tell() // 2])
            raise OSError(f.errno, os.strerror(f.errno), str(target))

        torch.save = save
        try:
            yield
        finally:
            torch.save = real_save


def _poison_next_optimizer_step() -> None:
    """The next torch optimizer step on this rank (the one DeepSpeed drives: under ZeRO its
    params are this rank's fp32 partitions, copied into the model afterwards) leaves every
    weight it updated NaN, as a step with an infinite learning rate does. Through torch's global
    optimizer hook, removed once it fired; a skipped step does not fire it."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def poison(optimizer, args, kwargs) -> None:
        handle.remove()
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.fill_(float("nan"))

    handle = register_optimizer_step_post_hook(poison)


def _signal_number(name: str) -> int:
    """KILL, SIGKILL or 9 -> 9."""
    import signal

    if name.isdigit():
        return int(name)
    try:
        return int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except KeyError:
        raise ValueError(f"unknown signal {name!r} (KILL, SEGV, BUS, ...)") from None


def _kill_data_workers(sig: int) -> None:
    """Send ``sig`` to this process's DataLoader workers (torch names them pt_data_worker) and
    wait until they are gone, as the kernel's OOM killer would leave them."""
    import logging
    import multiprocessing

    workers = []
    for p in multiprocessing.active_children():
        try:
            with open(f"/proc/{p.pid}/comm") as f:
                if f.read().strip() == "pt_data_worker":
                    workers.append(p)
        except OSError:
            continue
    if not workers:
        logging.getLogger("llama_train").warning(
            "%s: worker_kill found no DataLoader worker to signal (data.num_workers=0?)", ENV)
    for p in workers:
        os.kill(p.pid, sig)
    for p in workers:
        p.join(timeout=10)


def _stall(seconds: float) -> None:
    """Block this thread only (the GIL is free: other threads run), through signals."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(1.0, end - time.monotonic()))


# ------------------------------------------------------------------------------------------------
# A peer is gone: say which


_COMM_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer",
                 "broken pipe", "timed out", "socket timeout", "dist_backend",
                 "application timeout")  # gloo: "Application timeout caused pair closure"


def find_comm_error(exc: BaseException) -> Optional[BaseException]:
    """The exception that came out of a collective (torch raises gloo errors as RuntimeError),
    also when another error was raised while handling it (a DataLoader worker that the launcher
    terminated meanwhile, say); None if there is none in the chain."""
    import torch.distributed as dist

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, getattr(dist, "DistError", ())):
            return exc
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and any(m in text for m in _COMM_MARKERS):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def is_comm_failure(exc: BaseException) -> bool:
    return find_comm_error(exc) is not None


def diagnose_lost_ranks(rank: int, world: int, wait_s: float = 5.0) -> str:
    """After a failed collective: every survivor writes ``alive/<rank>`` to the rendezvous store
    and waits up to ``wait_s`` for the others; the ranks that never check in are gone (or hung).
    Rank 0 hosts the store, so if it cannot be reached, rank 0 is the one gone."""
    import torch.distributed as dist

    prefix = "llama_train/alive/"
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=max(1.0, wait_s)))
        store.set(f"{prefix}{rank}", str(time.time()))
        deadline = time.monotonic() + wait_s
        missing = list(range(world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
            if missing:
                time.sleep(0.1)
    except Exception as e:  # noqa: BLE001 - the store itself is unreachable
        return (f"rank {rank} cannot reach the rendezvous store at {where} ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}): rank 0, which hosts it, is gone")
    if not missing:
        return (f"rank {rank}: every rank checked in after the failure (a network fault or a "
                f"timeout, not a dead process?)")
    names = ", ".join(str(r) for r in missing)
    return (f"rank(s) {names} did not check in within {wait_s:.0f}s: rank(s) {names} died or hung "
            f"(seen from rank {rank})")
