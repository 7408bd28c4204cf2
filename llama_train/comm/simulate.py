"""A process group in which this process is rank R of N and every other rank is its mirror.

``comm.simulate_ranks=N`` runs the real training path (``deepspeed.zero.Init``,
``deepspeed.initialize``, forward/backward/step, checkpoints) as one rank of an N-rank job in
one process. torch's ``fake`` backend does nothing in a collective; this one answers each as if
every peer held exactly what this rank holds:

* all-gather writes the local input into every rank's slot (so on CPU the gathered buffers are
  resident, as after a real all-gather; an untouched ``torch.empty`` would not be, and a memory
  measurement would miss them);
* all-reduce / reduce-scatter with SUM multiply by N (N identical contributions), so DeepSpeed's
  averaged gradients and our averaged loss keep their magnitude; MAX/MIN/AVG leave it as it is;
* broadcast, barrier: nothing to do (the source's value is the local one).

Each collective is also counted (kind, group size, bytes) into this process's traffic counter
when it has one (:mod:`llama_train.comm.counting`; a simulated run always has).

The values that would come from other ranks are therefore this rank's own: a simulated run's
loss is not the job's and must never be reported as such (the trainer says so). The point is
what the rank allocates, how long its phases take and that its code path runs.

Why a ``ProcessGroup`` subclass and not a ``Backend``: torch's C++ ``Backend`` has no Python
constructor, so a Python backend can only be a ``ProcessGroup`` whose methods torch calls
directly. A method it does not define falls through to the C++ ``ProcessGroup``, which looks up
a per-device backend this group does not have: "No backend type associated with device type
cuda" (the first GPU run, torch 2.11: ``all_gather_into_tensor`` calls ``_allgather_base``, a
name torch 2.13 renamed ``all_gather_single``). So every name torch 2.4-2.13 calls, on either
device, is defined here (:data:`ENTRY_POINTS`), and the tensors' device never matters: the
copies run wherever the tensors are.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from llama_train.comm import counting

BACKEND = "llama_sim"


def _done(result=None):
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _count(kind: str, size: int, tensors) -> None:
    """Tell this process's traffic counter (:mod:`llama_train.comm.counting`) of a collective:
    its kind, group size and the bytes of the whole buffer it is about (``tensors``: one
    tensor or lists of them)."""
    counter = counting.active()
    if counter is None:
        return

    def total(x) -> int:
        return (sum(total(y) for y in x) if isinstance(x, (list, tuple))
                else 0 if x is None else counting.nbytes(x))

    counter.add(kind, size, total(tensors))


def _reduce_(t: torch.Tensor, op, n: int) -> None:
    """``t`` as the reduction of n copies of itself."""
    if op == dist.ReduceOp.SUM and t.dtype != torch.bool:
        t.mul_(n)


class MirrorGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``size``; every peer's contribution equals this rank's."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _count("all_reduce", self._size, tensors)
        for t in tensors:
            _reduce_(t, op, self._size)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def barrier(self, opts=None):
        _count("barrier", self._size, None)
        return _done()

    def broadcast(self, tensors, opts=None):
        _count("broadcast", self._size, tensors)
        return _done(tensors)

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts=None):
        _count("all_gather", self._size, outputs)
        for outs, x in zip(outputs, inputs):
            for o in outs:
                o.copy_(x)
        return _done(outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        _count("all_gather", self._size, output)
        output.view(self._size, -1).copy_(input.reshape(1, -1).expand(self._size, -1))
        return _done(output)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, x in zip(outputs, inputs):
            self.all_gather_single(o, x)
        return _done(outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _count("reduce_scatter", self._size, inputs)
        for o, xs in zip(outputs, inputs):
            o.copy_(xs[self._rank])
            _reduce_(o, op, self._size)
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _count("reduce_scatter", self._size, input)
        output.copy_(input.reshape(self._size, -1)[self._rank].view_as(output))
        _reduce_(output, op, self._size)
        return _done(output)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, x in zip(outputs, inputs):
            self.reduce_scatter_single(o, x, opts)
        return _done(outputs)

    def gather(self, outputs, inputs, opts=None):
        _count("gather", self._size, inputs)
        for outs, x in zip(outputs, inputs):
            for o in outs:
                o.copy_(x)
        return _done(outputs)

    def scatter(self, outputs, inputs, opts=None):
        _count("scatter", self._size, outputs)
        for o, xs in zip(outputs, inputs):
            if xs:
                o.copy_(xs[self._rank])
        return _done(outputs)

    def alltoall(self, outputs, inputs, opts=None):
        _count("all_to_all", self._size, inputs)
        for o in outputs:
            o.copy_(inputs[self._rank])
        return _done(outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        _count("all_to_all", self._size, input)
        output.copy_(input)
        return _done(output)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def reduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _count("reduce", self._size, tensors)
        for t in tensors:  # every rank gets the root's result: the same tensor either way
            _reduce_(t, op, self._size)
        return _done(tensors)

    # torch 2.4-2.12 call these under their older names (2.13 still accepts them)
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    # -- coalescing (``_coalescing_manager(group, device=...)``, which DeepSpeed enters with the
    # tensors' device): each collective inside completes at once, so there is nothing to batch
    def _start_coalescing(self, device=None) -> None:
        pass

    def _end_coalescing(self, device=None):
        return _done()

    start_coalescing, end_coalescing = _start_coalescing, _end_coalescing  # torch 2.13's C++ side

    def __repr__(self) -> str:
        return f"MirrorGroup(rank={self._rank}, size={self._size})"


# What torch 2.4-2.13 call on a Python process group, by the API that calls it: each must be
# MirrorGroup's own (tests/comm/test_comm_mirror.py), or the C++ fallback looks for a backend.
ENTRY_POINTS = {
    "all_reduce": ("allreduce",), "all_reduce_coalesced": ("allreduce_coalesced",),
    "all_gather": ("allgather",), "all_gather_coalesced": ("allgather_coalesced",),
    "all_gather_into_tensor": ("all_gather_single", "_allgather_base"),
    "all_gather_into_tensor, coalesced": ("all_gather_single_coalesced",
                                          "allgather_into_tensor_coalesced"),
    "reduce_scatter": ("reduce_scatter",),
    "reduce_scatter_tensor": ("reduce_scatter_single", "_reduce_scatter_base"),
    "reduce_scatter_tensor, coalesced": ("reduce_scatter_single_coalesced",
                                         "reduce_scatter_tensor_coalesced"),
    "all_to_all": ("alltoall",), "all_to_all_single": ("all_to_all_single", "alltoall_base"),
    "broadcast": ("broadcast",), "reduce": ("reduce",), "barrier": ("barrier",),
    "gather": ("gather",), "scatter": ("scatter",),
    "_coalescing_manager": ("_start_coalescing", "_end_coalescing", "start_coalescing",
                            "end_coalescing"),
}


def _create(store, rank: int, size: int, timeout):
    return MirrorGroup(rank, size)


def register() -> None:
    """Make ``llama_sim`` a torch.distributed backend (once per process)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def init(rank: int, world_size: int, timeout) -> None:
    """The default process group: this process as rank ``rank`` of ``world_size``
    (2 .. :data:`llama_train.bounds.SIMULATE_MAX_RANKS`, as comm.simulate_ranks is checked)."""
    from llama_train.bounds import SIMULATE_MAX_RANKS as MAX_RANKS
    from llama_train.errors import ConfigError

    if not (2 <= world_size <= MAX_RANKS and 0 <= rank < world_size):
        raise ConfigError(f"comm.simulate_ranks={world_size}, comm.simulate_rank={rank}: a "
                          f"simulated rank is one of 2 .. {MAX_RANKS} ranks (its collectives and "
                          f"saves slow with the number simulated)")
    register()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=timeout)
