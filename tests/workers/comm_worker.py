"""Rank program for tests/comm/test_comm.py: ring_all_reduce must agree with dist.all_reduce.

Started by the real `deepspeed` launcher (plain, or launch/local_two_nodes.sh). Prints one
"RANK r/w ..." line per rank, then checks many sizes/dtypes/shapes; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from _lines import say

from llama_train.comm import CommConfig, ring_all_reduce
from llama_train.engine import init_distributed

SIZES = [1, 2, 3, 5, 6, 7, 97, 1000, 4099]  # incl. numel < world and not divisible by 2 or 3


def exact_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """The true sum, from every rank's input gathered in float64 (or int64)."""
    wide = torch.float64 if x.dtype.is_floating_point else torch.int64
    parts = [torch.empty(x.shape, dtype=wide) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.to(wide), group=group)
    return torch.stack(parts).sum(0)


def check_case(name: str, x: torch.Tensor, failures: list, group=None, exact_values: bool = False) -> None:
    """``exact_values``: inputs are small integers, so every correct sum is exact."""
    ref, got = x.clone(), x.clone()
    dist.all_reduce(ref, group=group)
    out = ring_all_reduce(got, group=group)
    exact = exact_sum(x, group)
    n = dist.get_world_size(group)
    if out is not got:
        failures.append(f"{name}: ring_all_reduce did not return its input tensor")
    if exact_values or not x.dtype.is_floating_point:
        ok = torch.equal(got, ref) and torch.equal(got.to(exact.dtype), exact)
    else:
        info = torch.finfo(x.dtype)
        scale = exact_sum(x.abs(), group)  # sum_i |x_i| bounds every partial sum
        if info.bits == 16:  # ring sums in fp32, then rounds once to 16 bits
            ring_bound = info.eps / 2 * exact.abs() + n * 2.0**-23 * scale + info.tiny
        else:  # n-1 roundings of a partial sum, like any all-reduce
            ring_bound = n * info.eps * scale + info.tiny
        ring_ok = bool(((got.double() - exact).abs() <= ring_bound).all())
        # The backend may round at every hop in the input dtype.
        ref_ok = bool(((ref.double() - exact).abs() <= n * info.eps * scale + info.tiny).all())
        ok = ring_ok and ref_ok
    if not ok:
        diff = (got.double() - ref.double()).abs().max().item()
        err = (got.double() - exact.double()).abs().max().item()
        failures.append(f"{name}: ring differs (max |ring - all_reduce| = {diff:.3g}, |ring - exact| = {err:.3g}); "
                        f"ring[:4]={got.flatten()[:4].tolist()} all_reduce[:4]={ref.flatten()[:4].tolist()}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)
    p.add_argument("--expect-world", type=int, default=None)
    p.add_argument("--expect-nodes", type=int, default=None)
    args = p.parse_args()

    init_distributed(CommConfig(timeout_s=60), "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.ones(1)
    dist.all_reduce(total)  # the probe the launch scripts are tested with
    say(f"RANK {rank}/{world} node={os.environ.get('CROSS_RANK')}/{os.environ.get('CROSS_SIZE')} "
        f"local_rank={os.environ.get('LOCAL_RANK')} all_reduce(1)={int(total.item())}")

    failures: list[str] = []
    if args.expect_world is not None and world != args.expect_world:
        failures.append(f"world size {world} != expected {args.expect_world}")
    if args.expect_nodes is not None and os.environ.get("CROSS_SIZE") != str(args.expect_nodes):
        failures.append(f"CROSS_SIZE={os.environ.get('CROSS_SIZE')} != expected {args.expect_nodes}")
    if int(total.item()) != world:
        failures.append(f"all_reduce(1) = {total.item()} != world {world}")

    for size in SIZES:
        g = torch.Generator().manual_seed(7919 * rank + size)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            check_case(f"randn size={size} {dtype}", torch.randn(size, generator=g).to(dtype), failures)
            ints = torch.randint(-50, 51, (size,), generator=g).to(dtype)
            check_case(f"integer-valued size={size} {dtype}", ints, failures, exact_values=True)
        for dtype in (torch.int64, torch.int32):
            check_case(f"int size={size} {dtype}", torch.randint(-1000, 1000, (size,), generator=g, dtype=dtype),
                       failures)

    # Shapes: 0-d, 3-d, and a non-contiguous (transposed) view that must be written in place.
    g = torch.Generator().manual_seed(rank)
    check_case("0-d float32", torch.randn((), generator=g), failures)
    check_case("3-d float32", torch.randn(3, 5, 7, generator=g), failures)
    base = torch.randn(6, 5, generator=g)
    view, expect = base.t(), base.t().clone()
    dist.all_reduce(expect)
    ring_all_reduce(view)
    if not torch.allclose(base.t(), expect, rtol=1e-6, atol=1e-6):
        failures.append("non-contiguous view: result not written back into the caller's storage")
    contig = torch.randn(10, generator=g)
    ptr = contig.data_ptr()
    ring_all_reduce(contig)
    if contig.data_ptr() != ptr:
        failures.append("contiguous fp32 tensor was not reduced in place")

    if world >= 3:  # a sub-group without rank 0: group ranks differ from global ranks
        members = list(range(1, world))
        sub = dist.new_group(members)
        if rank in members:
            for size in (1, 5, 1000):
                x = torch.randn(size, generator=g)
                check_case(f"sub-group {members} size={size}", x, failures, group=sub)

    for f in failures:
        say(f"rank {rank} FAIL {f}", fd=2)
    bad = torch.tensor([len(failures)])
    dist.all_reduce(bad)
    if rank == 0:
        say(f"COMM_WORKER {'FAILED' if bad.item() else 'OK'} world={world} failures={int(bad.item())}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if bad.item() else 0


if __name__ == "__main__":
    from llama_train.proc import exit_skipping_teardown

    # after the result is printed, a teardown with gloo's threads alive can still abort the
    # rank ("terminate called without an active exception", exit 250: seen once on a fresh
    # clone's `make test`), and the launcher then fails a check that passed
    exit_skipping_teardown(main())
