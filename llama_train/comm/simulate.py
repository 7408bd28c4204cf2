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

The values that would come from other ranks are therefore this rank's own: a simulated run's
loss is not the job's and must never be reported as such (the trainer says so). The point is
what the rank allocates, how long its phases take and that its code path runs.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "llama_sim"


def _done(result=None):
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


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
        for t in tensors:
            _reduce_(t, op, self._size)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def barrier(self, opts=None):
        return _done()

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts=None):
        for outs, x in zip(outputs, inputs):
            for o in outs:
                o.copy_(x)
        return _done(outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        output.view(self._size, -1).copy_(input.reshape(1, -1).expand(self._size, -1))
        return _done(output)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, x in zip(outputs, inputs):
            self.all_gather_single(o, x)
        return _done(outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for o, xs in zip(outputs, inputs):
            o.copy_(xs[self._rank])
            _reduce_(o, op, self._size)
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        output.copy_(input.reshape(self._size, -1)[self._rank].view_as(output))
        _reduce_(output, op, self._size)
        return _done(output)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, x in zip(outputs, inputs):
            self.reduce_scatter_single(o, x, opts)
        return _done(outputs)

    def gather(self, outputs, inputs, opts=None):
        for outs, x in zip(outputs, inputs):
            for o in outs:
                o.copy_(x)
        return _done(outputs)

    def scatter(self, outputs, inputs, opts=None):
        for o, xs in zip(outputs, inputs):
            if xs:
                o.copy_(xs[self._rank])
        return _done(outputs)

    def alltoall(self, outputs, inputs, opts=None):
        for o in outputs:
            o.copy_(inputs[self._rank])
        return _done(outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        output.copy_(input)
        return _done(output)

    def __repr__(self) -> str:
        return f"MirrorGroup(rank={self._rank}, size={self._size})"


def _create(store, rank: int, size: int, timeout):
    return MirrorGroup(rank, size)


def register() -> None:
    """Make ``llama_sim`` a torch.distributed backend (once per process)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def init(rank: int, world_size: int, timeout) -> None:
    """The default process group: this process as rank ``rank`` of ``world_size``."""
    register()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=timeout)
