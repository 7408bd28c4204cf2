"""All-reduce benchmark: the backend's collective (NCCL/gloo) against the reference ring.

    llama-bench allreduce --nprocs 2                      # relaunches itself via `deepspeed`
    deepspeed --num_gpus 8 --module llama_train.bench.allreduce --max-bytes 1G
    deepspeed --hostfile hosts --module llama_train.bench.allreduce   # multi-node

Reported per message size (nccl-tests conventions): time is the median over iterations of the
slowest rank's time; algbw = bytes / time; busbw = algbw * 2(n-1)/n, the per-link traffic of a
bandwidth-optimal all-reduce, comparable across world sizes and with the link's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

from llama_train.bench import COUNT, COUNT0, check_options
from llama_train.bounds import Range
from llama_train.proc import free_port

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}
_DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_bytes(text: str) -> int:
    """'64K' / '1M' / '1GB' / '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", str(text).upper())
    if not m or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use a positive count with optional K/M/G, e.g. 64K")
    return int(m.group(1)) * _UNITS[m.group(2)]


def fmt_bytes(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-bench allreduce",
        description="Time dist.all_reduce and the reference ring all-reduce over message sizes.")
    p.add_argument("--nprocs", type=int, default=None,
                   help="ranks to start when not already under a launcher (default: #GPUs, or 2 on CPU)")
    p.add_argument("--master-port", type=int, default=None, help="port for the relaunch (default: a free one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--nccl-algo", default=None, help="sets NCCL_ALGO (Ring, Tree, NVLS, ...) before NCCL starts")
    p.add_argument("--dtype", choices=_DTYPES, default="float32")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="default: 64M on CPU, 1G on GPU")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between steps (2 or 4)")
    p.add_argument("--sizes", default=None, help="explicit comma list, e.g. 1K,64K,1M (overrides min/max)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-ring", action="store_true", help="time only the backend collective")
    p.add_argument("--json", default=None, metavar="PATH", help="also write results as JSON (rank 0)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return p


OPTIONS = {
    "nprocs": Range(1, 4096, integer=True, optional=True, fix="ranks to start"),
    "master_port": Range(1, 65535, integer=True, optional=True, fix="a TCP port"),
    "min_bytes": Range(1, 2**40, integer=True), "max_bytes": Range(1, 2**40, integer=True,
                                                                   optional=True),
    "factor": Range(2, 1024, integer=True, fix="size multiplier between steps (2 or 4)"),
    "warmup": COUNT0, "iters": COUNT,
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_options("allreduce", args, OPTIONS)
    if args.sizes is not None:
        args.sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    if args.nccl_algo is not None:
        from llama_train.comm import normalize_nccl_algo
        from llama_train.errors import BadInput
        try:
            args.nccl_algo = normalize_nccl_algo(args.nccl_algo)
        except BadInput as e:  # ConfigError naming the algorithm
            raise SystemExit(f"--nccl-algo: {e}")
    if args.backend == "nccl" and args.device == "cpu":
        raise SystemExit("--backend nccl needs --device cuda; use --backend gloo (or auto) on CPU")
    return args


def _cuda_wanted(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    if os.environ.get("DS_ACCELERATOR", "") == "cpu":
        return False
    import torch  # only now: the relaunching wrapper should start fast
    return torch.cuda.is_available()


def message_sizes(args: argparse.Namespace, on_cuda: bool) -> list[int]:
    if args.sizes:
        return list(args.sizes)
    hi = args.max_bytes or parse_bytes("1G" if on_cuda else "64M")
    if hi < args.min_bytes:
        raise SystemExit(f"--max-bytes={hi} is below --min-bytes={args.min_bytes}")
    sizes, s = [], args.min_bytes
    while s <= hi:
        sizes.append(s)
        s *= args.factor
    return sizes


def forwarded_args(args: argparse.Namespace) -> list[str]:
    """The options a rank needs, in canonical form (used for the relaunch and the repro line)."""
    out = ["--device", args.device, "--backend", args.backend, "--dtype", args.dtype,
           "--warmup", str(args.warmup), "--iters", str(args.iters)]
    if args.sizes:
        out += ["--sizes", ",".join(fmt_bytes(s) for s in args.sizes)]
    else:
        out += ["--min-bytes", fmt_bytes(args.min_bytes), "--factor", str(args.factor)]
        if args.max_bytes:
            out += ["--max-bytes", fmt_bytes(args.max_bytes)]
    if args.nccl_algo:
        out += ["--nccl-algo", args.nccl_algo]
    if args.no_ring:
        out.append("--no-ring")
    if args.json:
        out += ["--json", os.path.abspath(args.json)]
    return out


def _under_launcher(args: argparse.Namespace) -> bool:
    return args.local_rank is not None or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def relaunch(args: argparse.Namespace) -> int:
    """Start ``nprocs`` ranks through the DeepSpeed launcher, running this module."""
    on_cuda = _cuda_wanted(args.device)
    if args.nprocs is None:
        import torch
        args.nprocs = max(1, torch.cuda.device_count()) if on_cuda else 2
    env = os.environ.copy()
    if not on_cuda:
        env["DS_ACCELERATOR"] = "cpu"
        args.device = "cpu" if args.device == "auto" else args.device
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.nprocs),
           "--master_port", str(args.master_port or free_port()),
           "--module", "llama_train.bench.allreduce", *forwarded_args(args)]
    print("launching:", shlex.join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(op: Callable, buf, src, device) -> float:
    """One collective on fresh data (values never blow up), all ranks released together."""
    import torch.distributed as dist
    buf.copy_(src)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    op(buf)
    _sync(device)
    return time.perf_counter() - t0


def _check_ring(ref, got, src) -> None:
    """``ring_all_reduce`` of ``src`` equals the backend's all-reduce, up to summation order."""
    import torch
    import torch.distributed as dist

    from llama_train.comm import ring_all_reduce

    world = dist.get_world_size()
    ref.copy_(src)
    got.copy_(src)
    dist.all_reduce(ref)
    ring_all_reduce(got)
    # Summation order differs, so allow a few roundings of a sum of `world` terms.
    peak = src.abs().max().double()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tol = 2 * world * world * torch.finfo(src.dtype).eps * peak.item()
    err = (ref.double() - got.double()).abs().max().item()
    if err > tol:
        raise RuntimeError(f"ring_all_reduce differs from dist.all_reduce at "
                           f"{src.numel() * src.element_size()} bytes (rank {dist.get_rank()}, "
                           f"max abs err {err:.3g} > {tol:.3g})")


def run(args: argparse.Namespace) -> dict:
    """Benchmark on an already-launched rank; returns the results (same on every rank)."""
    import torch
    import torch.distributed as dist

    from llama_train import engine
    from llama_train.comm import CommConfig, ring_all_reduce

    on_cuda = _cuda_wanted(args.device)
    device_type = "cuda" if on_cuda else "cpu"
    local_size = int(os.environ.get("LOCAL_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if not on_cuda and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))
    backend = engine.init_distributed(CommConfig(backend=args.backend, nccl_algo=args.nccl_algo),
                                      device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    bus_factor = 2 * (world - 1) / world

    impls: dict[str, Callable] = {backend: lambda t: dist.all_reduce(t)}
    if not args.no_ring:
        impls["ring"] = ring_all_reduce
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    rows = []
    for nbytes in message_sizes(args, on_cuda):
        count = max(1, nbytes // elem)
        nbytes = count * elem
        src = torch.randn(count, generator=gen).to(device=device, dtype=dtype)
        bufs = {name: torch.empty_like(src) for name in impls}

        if "ring" in impls:  # the baseline must give the same answer before its time counts
            _check_ring(bufs[backend], bufs["ring"], src)

        times = {name: [] for name in impls}
        names = list(impls)
        for it in range(args.warmup + args.iters):
            order = names if it % 2 == 0 else names[::-1]  # interleave: drift hits both alike
            for name in order:
                t = _timed(impls[name], bufs[name], src, device)
                if it >= args.warmup:
                    times[name].append(t)
        for name in names:
            # Slowest rank per iteration is the collective's time; median over iterations.
            per_iter = torch.tensor(times[name], dtype=torch.float64, device=device)
            dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
            t = statistics.median(per_iter.cpu().tolist())
            algbw = nbytes / t / 1e9
            rows.append({"impl": name, "bytes": nbytes, "count": count, "dtype": args.dtype,
                         "time_us": t * 1e6, "time_us_min": min(per_iter.tolist()) * 1e6,
                         "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor})
        del src, bufs

    n_nodes = int(os.environ.get("CROSS_SIZE", "1"))
    launcher = (["DS_ACCELERATOR=cpu"] if not on_cuda else []) + ["deepspeed"] + (
        ["--num_gpus", str(world)] if n_nodes == 1 else ["--hostfile", "<hostfile>"])
    repro = shlex.join(launcher + ["--module", "llama_train.bench.allreduce", *forwarded_args(args)])
    meta = {
        "world_size": world, "nodes": n_nodes, "backend": backend, "device": device_type,
        "dtype": args.dtype, "warmup": args.warmup, "iters": args.iters, "bus_factor": bus_factor,
        "nccl_algo": os.environ.get("NCCL_ALGO") if backend == "nccl" else None,
        "torch": torch.__version__, "deepspeed": engine.deepspeed_version(),
        "cpu_threads_per_rank": torch.get_num_threads() if not on_cuda else None,
        "gpu": torch.cuda.get_device_name(device) if on_cuda else None,
        "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # Other work on the host skews CPU timings; the 1-minute load average tells how much.
        "loadavg_1m": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
        "command": repro,
    }
    return {"meta": meta, "results": rows}


def format_table(report: dict) -> str:
    meta, rows = report["meta"], report["results"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["impl"], r["bytes"]): r for r in rows}
    head = f"{'size':>8} {'count':>11}" + "".join(
        f" | {name + ' us':>12} {'algbw':>7} {'busbw':>7}" for name in impls)
    if len(impls) == 2:
        head += f" | {'ring/' + impls[0]:>10}"
    lines = [
        f"all-reduce SUM, {meta['world_size']} ranks on {meta['nodes']} node(s), {meta['device']}, "
        f"backend={meta['backend']}, dtype={meta['dtype']}, median of {meta['iters']} "
        f"(+{meta['warmup']} warmup)",
        f"bandwidths in GB/s (1e9 B/s), busbw = algbw * 2(n-1)/n = algbw * {meta['bus_factor']:.3f}"
        + (f"; host load {meta['loadavg_1m'][0]:.1f} -> {meta['loadavg_1m'][1]:.1f} on {meta['cpu_count']} cpus"
           if meta["device"] == "cpu" and None not in meta["loadavg_1m"] else ""),
        ]
    if meta["dtype"] in ("bfloat16", "float16") and "ring" in impls:
        lines.append("note: the ring sums 16-bit inputs in fp32, so it moves twice the bytes shown")
    lines += [head, "-" * len(head)]
    for nbytes in sorted({r["bytes"] for r in rows}):
        line = f"{fmt_bytes(nbytes):>8} {by[(impls[0], nbytes)]['count']:>11}"
        for name in impls:
            r = by[(name, nbytes)]
            line += f" | {r['time_us']:>12.1f} {r['algbw_GBps']:>7.3f} {r['busbw_GBps']:>7.3f}"
        if len(impls) == 2:
            line += f" | {by[(impls[1], nbytes)]['time_us'] / by[(impls[0], nbytes)]['time_us']:>10.2f}"
        lines.append(line)
    lines.append(f"reproduce: {meta['command']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not _under_launcher(args):
        rc = relaunch(args)
        if rc:  # raise, so a dispatcher that ignores return values still exits non-zero
            raise SystemExit(rc)
        return 0
    report = run(args)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        print(format_table(report), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
