"""DeepSpeed-Ulysses sequence parallelism (``parallel.sequence=N``): the process groups and the
attention wrapper; :class:`llama_train.job.train_module.TrainModule` slices the sequences.

Each group of N consecutive ranks shares every sequence. A rank embeds and runs the MLPs on its
seq_len / N tokens; in attention, DeepSpeed's ``DistributedAttention`` exchanges q, k and v with
an all-to-all so that each rank holds the whole sequence for n_heads / N heads, runs the model's
own :class:`~llama_train.model.CoreAttention` on it (causal and document masks as usual), and
exchanges the result back. The groups are DeepSpeed's own (its ``parallel_state_sp`` unit, passed
to ``deepspeed.initialize`` as ``mpu``): ZeRO partitions and reduces over all ranks (sequence x
data), and divides gradients by the data-parallel size only, so each rank's loss is its tokens'
share of the sequence group's token mean (TrainModule scales it).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Dict, Iterator, Optional

import torch
from torch import nn


class UlyssesAttention(nn.Module):
    """``CoreAttention`` run by DeepSpeed's ``DistributedAttention`` over the sequence group.

    Inputs (B, T/N, heads, hd): heads scattered, sequence gathered, (B, T, heads/N, hd) into the
    core, and back. With fewer K/V heads than N, each K/V head is copied to N / n_kv_heads ranks
    first, so every rank holds the K/V head its query heads read (head j of H uses K/V head
    j // (H / KV) before and after). ``local`` is the plain core, for decoding on one rank."""

    def __init__(self, local: nn.Module, group: Any, size: int):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.local = local
        self.size = size
        # batch first: scatter the head dim (2), gather the sequence dim (1)
        self.dist = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor] = None, causal: bool = True) -> torch.Tensor:
        if k.size(2) < self.size:  # (B, T/N, KV, hd) -> (B, T/N, N, hd)
            rep = self.size // k.size(2)
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return self.dist(q, k, v, 0, None, mask=mask, causal=causal)


def init_sequence_parallel(size: int):
    """The sequence-parallel groups (ranks [0, N), [N, 2N) ...) on a process group that is up:
    DeepSpeed's ``parallel_state_sp`` module, which ``deepspeed.initialize`` takes as ``mpu``.
    None when ``size`` is 1."""
    if size == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    try:
        mpu.get_sequence_parallel_group()
    except AssertionError:  # not made yet in this process
        mpu.initialize_sequence_parallel(sequence_parallel_size=size)
    return mpu


def sequence_rank(mpu) -> int:
    """This rank's place in its sequence group: which slice of each sequence it holds."""
    return 0 if mpu is None else int(mpu.get_sequence_parallel_rank())


def gradient_factor(zero_stage: int, mpu) -> float:
    """What the loss is multiplied by in backward so that DeepSpeed's reduced gradient is the
    gradient of the loss. DeepSpeed sums gradients over the ranks of a sequence group and
    averages over data-parallel replicas (it divides by ranks / N), except ZeRO-3's
    reduce-scatter path, which every ZeRO-3 gradient takes (``reduce_scatter`` is on by
    default) and which divides by all ranks (DeepSpeed 0.19.8): there it is N, else 1.
    tests/engine/test_sequence_parallel.py checks the gradient norm against one rank, stage by stage."""
    if mpu is None or zero_stage != 3:
        return 1.0
    return float(mpu.get_sequence_parallel_world_size())


def shard_attention(model: nn.Module, mpu) -> None:
    """Wrap every attention core of ``model`` for sequence parallelism (no parameter changes:
    the state dict, checkpoints and converters see the same model)."""
    if mpu is None:
        return
    group, size = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_world_size()
    for block in model.layers:
        attn = block.attention
        if not isinstance(attn.core, UlyssesAttention):
            attn.core = UlyssesAttention(attn.core, group, size)


# -- read-outs for measurement tools (llama-bench memory --sequence-parallel) ------------------


@contextlib.contextmanager
def all_to_all_meter() -> Iterator[Dict[str, float]]:
    """Counts every all-to-all DeepSpeed runs inside (its sequence-parallel exchanges go through
    ``deepspeed.comm.all_to_all_single``): calls, bytes (each call's output), the seconds spent
    exchanging and the seconds spent before it waiting for the group's other ranks (a barrier
    this meter adds, so that the exchange is timed with every rank present). gloo's calls are
    synchronous; with NCCL these would be launch times only."""
    from deepspeed import comm as dscomm

    stats = {"calls": 0, "bytes": 0, "seconds": 0.0, "wait_seconds": 0.0}
    inner = dscomm.all_to_all_single

    def counted(output, tensor, *args, **kwargs):
        t0 = time.perf_counter()
        dscomm.barrier(group=kwargs.get("group"))
        t1 = time.perf_counter()
        out = inner(output, tensor, *args, **kwargs)
        stats["wait_seconds"] += t1 - t0
        stats["seconds"] += time.perf_counter() - t1
        stats["calls"] += 1
        stats["bytes"] += output.numel() * output.element_size()
        return out

    dscomm.all_to_all_single = counted
    try:
        yield stats
    finally:
        dscomm.all_to_all_single = inner


def all_to_all_seconds(mpu, nbytes: int, reps: int = 7) -> float:
    """Median seconds of one all-to-all of ``nbytes`` per rank over the sequence group, alone
    (after one untimed call): the collective's own cost, to set beside the time a step spends
    in them."""
    from deepspeed import comm as dscomm

    group, n = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_world_size()
    elems = max(n, nbytes // 4 // n * n)
    times = []
    for i in range(reps + 1):
        src, dst = torch.ones(elems), torch.empty(elems)  # fresh buffers, as in a step
        dscomm.barrier(group=group)
        t0 = time.perf_counter()
        dscomm.all_to_all_single(dst, src, group=group)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
