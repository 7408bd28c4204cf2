"""Peaks for ``llama-bench train``'s MFU: the peak llama-train itself divides by
(:class:`llama_train.engine.flops.PeakFlops`, one definition for both), and the throughput of the
model's own matmul shapes (forward and both backward products), reported beside it because skinny
shapes such as 2048 x 384 x 1024 run below a square matmul's peak."""

from __future__ import annotations

import time
from typing import List, Optional


def linear_shapes(model_args) -> List[tuple]:
    """(in_features, out_features, count) of every matmul weight used per training step."""
    a = model_args
    d, qd, kvd, f = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim, a.ffn_hidden_dim
    L = a.n_layers
    return [(d, qd, L), (d, kvd, 2 * L), (qd, d, L), (d, f, 2 * L), (f, d, L), (d, a.vocab_size, 1)]


def model_matmul_flops(model_args, tokens: int, device, dtype, repeats: int = 3) -> float:
    """FLOP/s of the model's matmul mix for ``tokens`` rows: each linear's forward ``x W^T``
    and both backward products (``dy W`` and ``dy^T x``), best-of-``repeats`` per product,
    weighted by how often the step runs it. Excludes attention's QK^T/AV (done by SDPA)."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    total_flops, total_time = 0.0, 0.0
    for fin, fout, count in linear_shapes(model_args):
        x = torch.randn(tokens, fin, device=device, dtype=dtype)
        w = torch.randn(fout, fin, device=device, dtype=dtype)
        dy = torch.randn(tokens, fout, device=device, dtype=dtype)
        for fn in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x):
            best = float("inf")
            for _ in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t0)
            total_time += count * best
            total_flops += count * 2.0 * tokens * fin * fout
    return total_flops / total_time


def mfu_peak(device_name: str, precision: str, threads: int, override: Optional[float] = None):
    """The :class:`~llama_train.engine.flops.PeakFlops` a one-process ``llama-train`` run with
    these settings divides by (override = ``trainer.peak_flops``), on ``threads`` threads: the
    cached CPU measurement is per thread count, and the `ours` side runs on ``threads``. A square
    matmul timed here instead read 43.7 TFLOP/s on an H200 (first-call overhead) against its
    989 datasheet figure: MFU 1176%."""
    import torch

    from llama_train.engine.flops import PeakFlops

    torch.set_num_threads(threads)
    return PeakFlops(torch.device(device_name), precision, 1, override)


def model_shapes_flops(model_args, tokens: int, device_name: str, precision: str,
                       threads: int) -> float:
    """The model-shape matmul throughput on ``threads`` threads (measured before each round)."""
    import torch

    torch.set_num_threads(threads)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return model_matmul_flops(model_args, tokens, torch.device(device_name), dtype, repeats=5)
