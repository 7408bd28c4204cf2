"""A reference ring all-reduce built only from point-to-point send/recv.

Why a ring: with n ranks and a message of S bytes, cut the message into n chunks of S/n.

    reduce-scatter (n-1 steps): each rank sends one chunk to rank+1 and adds the chunk it
        receives from rank-1; after n-1 steps rank r holds the full sum of chunk r+1.
    all-gather     (n-1 steps): the finished chunks travel once more around the ring.

Each rank sends (and receives) 2(n-1) chunks of S/n, i.e. 2(n-1)/n * S bytes, which is the
lower bound for all-reduce and tends to 2S however many ranks there are: the ring is
bandwidth-optimal. Its cost is latency, 2(n-1) sequential steps, which is why NCCL switches to
trees for small messages on many nodes. The same 2(n-1)/n factor turns a measured algorithm
bandwidth (S / time) into the "bus bandwidth" the benchmark reports.

This is a readable reference and a benchmark baseline, not a replacement for NCCL/gloo.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# 16-bit floats are summed in fp32: rounding the partial sum at each of the n-1 hops would
# compound the error. The price is fp32 on the wire (2x bytes) for those dtypes.
_ACC_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _chunk_bounds(numel: int, n: int) -> list[int]:
    """Chunk i is [b[i], b[i+1]); sizes differ by at most one and may be zero (numel < n)."""
    return [i * numel // n for i in range(n + 1)]


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send to ``dst`` and receive from ``src`` at once.

    Batched so NCCL posts both in one group: two ranks that each block in send before
    receiving would deadlock. Empty chunks are skipped on both sides (sizes are symmetric).
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


@torch.no_grad()
def ring_all_reduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group`` in place (like ``dist.all_reduce``) and return it.

    Any shape, contiguity and numel (including numel < world size); integer dtypes are exact,
    fp16/bf16 accumulate in fp32. Each rank sends 2(n-1)/n of the tensor's bytes in 2(n-1) steps.
    """
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"ring_all_reduce sums real numbers; got dtype {tensor.dtype}")
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    # P2P peers are global ranks; translate when a sub-group is given.
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    nxt, prv = to_global((rank + 1) % world), to_global((rank - 1) % world)

    acc_dtype = _ACC_DTYPE.get(tensor.dtype, tensor.dtype)
    in_place = acc_dtype == tensor.dtype and tensor.is_contiguous()
    if in_place:
        work = tensor.view(-1)  # (N,) aliasing the caller's storage
    else:
        work = torch.empty(tensor.numel(), dtype=acc_dtype, device=tensor.device)
        work.copy_(tensor.reshape(-1))

    bounds = _chunk_bounds(work.numel(), world)

    def chunk(i: int) -> torch.Tensor:  # contiguous slice (chunk_len,)
        i %= world
        return work[bounds[i]:bounds[i + 1]]

    scratch = torch.empty(bounds[1] - bounds[0] + 1, dtype=acc_dtype, device=work.device)

    # Reduce-scatter: at step s send chunk (r - s), receive and accumulate chunk (r - s - 1).
    for step in range(world - 1):
        dst = chunk(rank - step - 1)
        buf = scratch[:dst.numel()]
        _exchange(chunk(rank - step), nxt, buf, prv, group)
        dst.add_(buf)

    # All-gather: rank r owns the finished chunk (r + 1); pass finished chunks along.
    for step in range(world - 1):
        _exchange(chunk(rank + 1 - step), nxt, chunk(rank - step), prv, group)

    if not in_place:
        tensor.copy_(work.view(tensor.shape))
    return tensor
