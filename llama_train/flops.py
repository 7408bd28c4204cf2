"""What the hardware can do, for the logs: the peak FLOP/s behind MFU (a datasheet figure or a
timed matmul) and the memory a process holds. Plain torch, no DeepSpeed."""

from __future__ import annotations

from typing import Dict, Optional

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
    (on a machine busy at that moment it reads low; the trainer then says so, once).
    ``source`` says which."""

    def __init__(self, device: torch.device, precision: str, world_size: int,
                 override: Optional[float] = None):
        sheet = _datasheet_flops(device)
        if override is not None:
            per_device, self.source = override, "trainer.peak_flops"
        elif sheet is not None:
            per_device = sheet
            self.source = f"datasheet bf16 dense, {torch.cuda.get_device_name(device)}"
        else:
            per_device = peak_flops(device, precision)
            self.source = f"{precision} matmul measured at start on {device.type}"
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
                         n: int = 1024, repeats: int = 5) -> float:
    """Best-of-N throughput of an n x n x n matmul on this process's threads."""
    import time

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def memory_stats(device: torch.device) -> Dict[str, float]:
    if device.type == "cuda":
        return {"mem_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    import psutil

    return {"mem_gb": psutil.Process().memory_info().rss / 2**30}
