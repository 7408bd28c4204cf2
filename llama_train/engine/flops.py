"""What the hardware can do, for the logs: the peak FLOP/s behind MFU (a datasheet figure or a
timed matmul) and the memory a process holds. Plain torch, no DeepSpeed."""

from __future__ import annotations

import json
import os
import time
from typing import Dict, Optional, Tuple

import torch


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s for MFU: the datasheet dense bf16 figure on known GPUs, else a measured matmul."""
    datasheet = _datasheet_flops(device)
    if datasheet is not None:
        return datasheet
    return measure_matmul_flops(device, torch.float32 if precision == "fp32" else torch.bfloat16)


class PeakFlops:
    """The denominator of MFU for the whole job (per-device peak x world size), decided once at
    start and never changed, so MFU moves only with throughput: `trainer.peak_flops` when given,
    else the datasheet dense bf16 figure of a known GPU, else a matmul timed once at start-up
    (measured once per machine, thread count and dtype, then read from the cache: see
    :func:`cached_matmul_flops`). ``source`` says which, in words; ``kind`` says which as one
    of ``"override"``, ``"datasheet"``, ``"measured"`` (for reports that label it)."""

    def __init__(self, device: torch.device, precision: str, world_size: int,
                 override: Optional[float] = None):
        sheet = _datasheet_flops(device)
        if override is not None:
            per_device, self.source, self.kind = override, "trainer.peak_flops", "override"
        elif sheet is not None:
            per_device, self.kind = sheet, "datasheet"
            self.source = f"datasheet bf16 dense, {torch.cuda.get_device_name(device)}"
        else:
            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            per_device, self.source = cached_matmul_flops(device, dtype)
            self.kind = "measured"
        self.value = per_device * world_size

    def mfu(self, achieved: float) -> float:
        return achieved / self.value


def _datasheet_flops(device: torch.device) -> Optional[float]:
    """Dense bf16 datasheet peak of a known GPU, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
             "4090": 165e12, "V100": 125e12}
    return next((v for k, v in table.items() if k in name), None)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                         n: int = 1024, repeats: int = 5,
                         budget_s: Optional[float] = None) -> float:
    """Best-of-N throughput of an n x n x n matmul on this process's threads (the first, warm-up
    run included in the best). With ``budget_s``, it stops early once that much time has gone
    and three runs are done: a bf16 matmul on a CPU without bf16 units takes ~1 s here, and
    best of 21 held every rank's start-up for 20-100 s."""
    # its own generator: the global RNG a run seeds and saves in its checkpoints stays as it was
    # (the first run on a machine measures, later ones read the cache: each saved the same state)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    best, start = float("inf"), time.perf_counter()
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
        if budget_s is not None and i >= 2 and time.perf_counter() - start >= budget_s:
            break
    return 2 * n**3 / best


PEAK_CACHE = "peak_flops.json"  # in llama_train.paths.cache_dir()


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a measured peak holds for: the processor, the threads a process uses, the dtype
    and torch (its matmul kernels)."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{platform.node()}|{cpu}|{os.cpu_count()} cpus|{torch.get_num_threads()} threads|"
            f"{device.type}|{_dtype_name(dtype)}|torch {torch.__version__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def cached_matmul_flops(device: torch.device, dtype: torch.dtype,
                        measure=None) -> Tuple[float, str]:
    """This machine's matmul peak, measured once and kept in ``<cache>/peak_flops.json``.

    A matmul timed at every start read 4.3e10-2.0e11 FLOP/s on one 2-core machine, depending
    on what else ran at that moment, so MFU moved 5%-147% between identical runs. The first
    run measures (best of 20, or of what fits in 3 s) and writes the figure; later runs reuse
    it. Delete the file (or set trainer.peak_flops) to change it. Returns (FLOP/s, where the
    figure came from)."""
    from llama_train.paths import cache_dir

    path = cache_dir() / PEAK_CACHE
    key = _machine_key(device, dtype)
    try:
        entry = json.loads(path.read_text())[key]
        return float(entry["flops"]), (f"{entry['what']} measured {entry['when']}, cached in "
                                       f"{path}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    flops = (measure or measure_matmul_flops)(device, dtype, repeats=20, budget_s=3.0)
    what = f"{_dtype_name(dtype)} matmul on {device.type}, {torch.get_num_threads()} thread(s)"
    when = time.strftime("%Y-%m-%d %H:%M")
    try:  # another process of this machine may write it too: whole files only
        table = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[key] = {"flops": flops, "what": what, "when": when}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
        return flops, f"{what} measured {when}, cached in {path}"
    except OSError:
        return flops, f"{what} measured at start (not cached: {path} is not writable)"


def memory_stats(device: torch.device) -> Dict[str, float]:
    if device.type == "cuda":
        return {"mem_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    import psutil

    return {"mem_gb": psutil.Process().memory_info().rss / 2**30}
