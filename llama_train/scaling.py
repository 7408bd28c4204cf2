"""``llama-plan``: how big a model, how many tokens, and will it fit.

Two regimes (see docs/scaling.md):

* **compute-optimal** (Hoffmann et al. 2022, "Chinchilla"): for a training budget C = 6 N D,
  the (N, D) with the lowest predicted loss. Closed form from the Approach-3 fit, shown beside
  the paper's Approach-1/2 power laws.
* **inference-optimal** (Sardana et al. 2024, "Beyond Chinchilla-Optimal"): for the same
  predicted loss, the (N, D) with the lowest *lifetime* cost 6 N D_train + 2 N D_inf. A smaller
  model trained longer wins once inference tokens are comparable to training tokens.

Plus the practical side for our trainer: parameter/FLOP counts of a preset, model-state memory per
GPU under each ZeRO stage, activation memory per micro-batch, and a LLaMA-shaped ``ModelArgs``
for a target parameter count. ``N`` is always the *total* parameter count (embeddings included),
Chinchilla's convention (Hoffmann et al. App. F), i.e. ``count_params(args)["total"]``.

Python API (used by the Hydra experiments): :func:`compute_optimal`, :func:`inference_optimal`,
:func:`shape_for_params`, :func:`model_memory`, :func:`activation_memory`, :func:`model_info`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

from llama_train.scaling_fit import (
    APPROACH1,
    APPROACH2,
    FITS,
    LossLaw,
    ScalingError,
    collect_runs,
    fit_loss_law,
    group_budgets,
    lifetime_optimal,
    load_fit,
    plot_isoflops,
)

if TYPE_CHECKING:  # torch is imported lazily so the pure-math commands start instantly
    from llama_train.model import ModelArgs

FitSpec = Union[str, Path, LossLaw, Dict[str, Any]]

__all__ = [
    "ScalingError", "LossLaw", "FITS", "load_fit",
    "compute_optimal", "inference_optimal", "shape_for_params", "model_memory",
    "activation_memory", "model_info", "main",
]


# =============================================================================================
# Compute-optimal (Hoffmann et al. 2022)
# =============================================================================================

def compute_optimal(flops: float, fit: FitSpec = "chinchilla") -> Dict[str, Any]:
    """The loss-minimising (N, D) for a training budget of ``flops`` = 6 N D.

    Keys: n_params, n_tokens, tokens_per_param, loss, flops, fit (constants + source),
    exponents (a, b, G of N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b), and approaches
    (the paper's Approach 1 and 2 power laws at the same budget).
    """
    law = load_fit(fit)
    n, d = law.optimal(flops)
    out: Dict[str, Any] = {
        "flops": float(flops),
        "n_params": n,
        "n_tokens": d,
        "tokens_per_param": d / n,
        "loss": law.loss(n, d),
        "fit": law.to_dict(),
        "exponents": {"a": law.a, "b": law.b, "G": law.G},
        "approaches": {},
    }
    for frontier in (APPROACH1, APPROACH2):
        n_k, d_k = frontier.optimal(flops)
        out["approaches"][frontier.name] = {
            "n_params": n_k, "n_tokens": d_k, "tokens_per_param": d_k / n_k,
            "a": frontier.a, "b": 1.0 - frontier.a, "coefficient": frontier.k, "source": frontier.source,
        }
    return out


# =============================================================================================
# Inference-optimal (Sardana et al. 2024)
# =============================================================================================

def _costs(n: float, d: float, d_inf: float) -> Dict[str, float]:
    train, infer = 6.0 * n * d, 2.0 * n * d_inf
    return {"n_params": n, "n_tokens": d, "tokens_per_param": d / n,
            "training_flops": train, "inference_flops": infer, "total_flops": train + infer}


def inference_optimal(
    flops: Optional[float] = None,
    inference_tokens: float = 0.0,
    fit: FitSpec = "chinchilla",
    *,
    reference_params: Optional[float] = None,
    reference_tokens: Optional[float] = None,
    target_loss: Optional[float] = None,
) -> Dict[str, Any]:
    """Cheapest (N, D_train) over the model's lifetime at a fixed predicted loss.

    The target loss comes from exactly one of: ``flops`` (the compute-optimal model of that
    budget), ``reference_params`` (+ optional ``reference_tokens``; without them the
    compute-optimal model of that size), or ``target_loss``. The answer minimises
    6 N D_train + 2 N D_inf on the iso-loss curve (Sardana et al. 2024, Eq. 3).

    Keys: n_params, n_tokens, tokens_per_param, loss, training_flops, inference_flops,
    total_flops, baseline (the compute-optimal model of the same loss, serving the same
    D_inf), savings {flops, percent} against it, param_ratio, token_ratio; and, when
    reference_tokens is given, reference + savings_vs_reference.
    """
    law = load_fit(fit)
    if reference_tokens is not None and reference_params is None:
        raise ScalingError("inference_optimal: reference_tokens needs reference_params (the model it trains)")
    given = [x is not None for x in (flops, reference_params, target_loss)]
    if sum(given) != 1:
        raise ScalingError(
            "inference_optimal: give exactly one of flops (compute-optimal reference), "
            "reference_params (+ optional reference_tokens) or target_loss"
        )
    d_inf = float(inference_tokens)
    if not math.isfinite(d_inf) or d_inf < 0:
        raise ScalingError(f"inference_tokens={inference_tokens!r} must be a finite number >= 0")

    reference = None
    if flops is not None:
        n_ref, d_ref = law.optimal(flops)
        loss = law.loss(n_ref, d_ref)
        how = f"compute-optimal model for C={float(flops):.3g} FLOPs"
    elif reference_params is not None:
        n_ref = float(reference_params)
        if not math.isfinite(n_ref) or n_ref <= 0:
            raise ScalingError(f"reference_params={reference_params!r} must be a number > 0")
        if reference_tokens is None:
            d_ref = law.optimal(law.flops_where_optimal(n_ref))[1]
            how = f"compute-optimal model with N={n_ref:.4g} params"
        else:
            d_ref = float(reference_tokens)
            if not math.isfinite(d_ref) or d_ref <= 0:
                raise ScalingError(f"reference_tokens={reference_tokens!r} must be a number > 0")
            how = f"given model N={n_ref:.4g} params, D={d_ref:.4g} tokens"
            reference = _costs(n_ref, d_ref, d_inf)
        loss = law.loss(n_ref, d_ref)
    else:
        loss = float(target_loss)
        how = f"target loss {loss}"

    n_base, d_base = law.optimal_for_loss(loss)
    n, d = lifetime_optimal(law, loss, d_inf)
    best = _costs(n, d, d_inf)
    base = _costs(n_base, d_base, d_inf)
    out: Dict[str, Any] = {
        **best,
        "loss": loss,
        "inference_tokens": d_inf,
        "target": how,
        "fit": law.to_dict(),
        "baseline": {**base, "description": "compute-optimal (Chinchilla-style) model of the same loss"},
        "savings": _savings(base, best),
        "param_ratio": n / n_base,
        "token_ratio": d / d_base,
    }
    if reference is not None:
        out["reference"] = {**reference, "description": how}
        out["savings_vs_reference"] = _savings(reference, best)
    return out


def _savings(base: Dict[str, float], best: Dict[str, float]) -> Dict[str, float]:
    saved = base["total_flops"] - best["total_flops"]
    return {"flops": saved, "percent": 100.0 * saved / base["total_flops"]}


# =============================================================================================
# Memory (ZeRO, Rajbhandari et al. 2020) and activations (Korthikanti et al. 2022)
# =============================================================================================

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _resolve_args(model: Union["ModelArgs", str, Path]) -> "ModelArgs":
    from llama_train.model import ModelArgs, load_preset

    if isinstance(model, ModelArgs):
        return model
    try:
        return load_preset(model)
    except ValueError as exc:
        raise ScalingError(str(exc)) from None


def _check_dtype(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ScalingError(f"dtype={dtype!r}: choose one of {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def model_memory(
    args: Union["ModelArgs", str, Path],
    zero_stage: int = 0,
    world_size: int = 1,
    dtype: str = "bf16",
    offload_optimizer: bool = False,
    master_copy: Optional[bool] = None,
) -> Dict[str, Any]:
    """Model-state bytes held by ONE data-parallel rank (Rajbhandari et al. 2020, ZeRO §3).

    Mixed precision (bf16/fp16) Adam keeps 2 B params + 2 B grads + 12 B fp32 optimizer state
    (master params, momentum, variance) per parameter: 16Ψ unpartitioned; ZeRO stage 1
    partitions the optimizer state (4Ψ + 12Ψ/N), stage 2 also the grads (2Ψ + 14Ψ/N), stage 3
    also the params (16Ψ/N). fp32 training (our CPU runs): 4 B params + 4 B grads + 8 B Adam
    moments, partitioned the same way. ``master_copy`` (default: what DeepSpeed does) adds a 4 B
    fp32 master partition; it is always there in 16-bit, and in fp32 DeepSpeed's ZeRO-1/2/3
    optimizers clone the rank's partition too (checked on DeepSpeed 0.19.8), while stage 0 keeps
    none: fp32 ZeRO-1 is 8Ψ + 12Ψ/N, ZeRO-2 4Ψ + 16Ψ/N, ZeRO-3 20Ψ/N. Pass ``master_copy=False``
    for the plain 4+4+8 accounting. ``offload_optimizer`` moves the optimizer state (master +
    moments) to host memory (ZeRO-Offload; stages 1-3). Buffers (gradient buckets, prefetch,
    allocator fragmentation) are not counted.

    Returns bytes: params, grads, optimizer_states, total (device), cpu_optimizer_states, and a
    breakdown {master_params, exp_avg, exp_avg_sq} of optimizer_states, to compare with the
    engine's real optimizer tensors; plus n_params (Ψ) and the settings.
    """
    from llama_train.model import count_params

    args = _resolve_args(args)
    p = _check_dtype(dtype)
    if zero_stage not in (0, 1, 2, 3):
        raise ScalingError(f"zero_stage={zero_stage!r}: ZeRO stages are 0, 1, 2, 3")
    if not isinstance(world_size, int) or world_size < 1:
        raise ScalingError(f"world_size={world_size!r} must be an integer >= 1 (data-parallel ranks)")
    if offload_optimizer and zero_stage == 0:
        raise ScalingError("offload_optimizer needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads the partitioned optimizer)")
    if master_copy is None:
        master_copy = p != 4 or zero_stage >= 1
    psi = count_params(args)["total"]
    n = world_size
    master = 4.0 * psi if master_copy else 0.0
    moments = 8.0 * psi  # fp32 exp_avg + exp_avg_sq
    params = float(p * psi)
    grads = float(p * psi)
    if zero_stage >= 1:
        master, moments = master / n, moments / n
    if zero_stage >= 2:
        grads /= n
    if zero_stage >= 3:
        params /= n
    optim = master + moments
    cpu = 0.0
    if offload_optimizer:
        cpu, optim = optim, 0.0
    return {
        "params": params,
        "grads": grads,
        "optimizer_states": optim,
        "total": params + grads + optim,
        "cpu_optimizer_states": cpu,
        "breakdown": {"master_params": master, "exp_avg": moments / 2, "exp_avg_sq": moments / 2},
        "n_params": psi,
        "bytes_per_param_unpartitioned": p + p + (4 if master_copy else 0) + 8,
        "zero_stage": zero_stage,
        "world_size": world_size,
        "dtype": dtype,
        "offload_optimizer": bool(offload_optimizer),
        "master_copy": bool(master_copy),
    }


ACTIVATION_FORMULA = (
    "per layer, bytes (p = bytes/element of the compute dtype, s seq, b micro-batch, h dim, "
    "h_kv = n_kv_heads*head_dim, f = ffn_hidden_dim, a = n_heads): "
    "s*b*[h*(8 + 6p) + 2p*h_kv + 4p*f + 4a + 8]. Terms: each of the 2 RMSNorms keeps its fp32 input "
    "(4sbh), the normalised tensor and its weighted output (2p*sbh) and 1/rms (4sb); fused SDPA keeps "
    "q (p*sbh), k and v (2p*s*b*h_kv), its output, which wo reads as is (p*sbh), and the fp32 "
    "logsumexp (4asb); SwiGLU keeps w1 out, silu out, w3 out and w2 in (4p*sbf). Eager attention adds "
    "the softmax p*a*s^2*b. With a 16-bit model the RoPE cos/sin tables are cast too and their fp32 "
    "copies for q and k are kept (+8*s*head_dim). Head: s*b*[h*(4 + 2p) + 4V + 20] (final norm, fp32 log-softmax, token ids "
    "and targets). Per-block activation checkpointing keeps only each block's input (p*sbh per layer) "
    "and recomputes one block at a time in backward (+ one layer's activations at the peak). "
    "After Korthikanti et al. 2022 (s*b*h*(34 + 5*a*s/h) per GPT layer in 16-bit), redone for "
    "this model's SwiGLU, GQA, fp32 RMSNorm, fused attention and no dropout."
)


def activation_memory(
    args: Union["ModelArgs", str, Path],
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    dtype: str = "bf16",
    checkpointing: Optional[bool] = None,
    attention: str = "sdpa",
) -> Dict[str, Any]:
    """Activation bytes autograd keeps for backward, for one micro-batch on one rank.

    The formula is :data:`ACTIVATION_FORMULA`, a count of the tensors this model's forward saves
    (tests check it against the real saved tensors of a CPU model). ``checkpointing`` defaults
    to ``args.activation_checkpointing``; ``attention="eager"`` also keeps the s x s softmax.
    Keys (bytes): per_layer, layers (kept through the forward), recompute (one block rebuilt in
    backward when checkpointing), head, total = layers + recompute + head.
    """
    args = _resolve_args(args)
    p = _check_dtype(dtype)
    s = args.max_seq_len if seq_len is None else int(seq_len)
    b = int(micro_batch)
    if s <= 0 or b <= 0:
        raise ScalingError(f"seq_len={seq_len} and micro_batch={micro_batch} must be positive integers")
    if attention not in ("sdpa", "eager"):
        raise ScalingError(f"attention={attention!r}: 'sdpa' (fused, default) or 'eager'")
    ckpt = args.activation_checkpointing if checkpointing is None else bool(checkpointing)
    h, a, f, V, L = args.dim, args.n_heads, args.ffn_hidden_dim, args.vocab_size, args.n_layers
    h_kv = args.kv_heads * args.head_dim
    per_layer = s * b * (h * (8 + 6 * p) + 2 * p * h_kv + 4 * p * f + 4 * a + 8)
    if p < 4:  # RoPE tables cast to 16 bit with the model: fp32 copies of cos, sin for q and k
        per_layer += 8 * s * args.head_dim
    if attention == "eager":
        per_layer += p * a * s * s * b
    head = s * b * (h * (4 + 2 * p) + 4 * V + 20)
    layers = L * p * s * b * h if ckpt else L * per_layer
    recompute = per_layer if ckpt else 0
    return {
        "per_layer": float(per_layer),
        "layers": float(layers),
        "recompute": float(recompute),
        "head": float(head),
        "total": float(layers + recompute + head),
        "checkpointing": ckpt,
        "micro_batch": b,
        "seq_len": s,
        "dtype": dtype,
        "attention": attention,
        "formula": ACTIVATION_FORMULA,
    }


def model_info(
    model: Union["ModelArgs", str, Path],
    *,
    zero_stage: int = 0,
    world_size: int = 1,
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    offload_optimizer: bool = False,
    checkpointing: Optional[bool] = None,
    attention: str = "sdpa",
) -> Dict[str, Any]:
    """Params, FLOPs/token, model-state and activation memory, with a meta-device build."""
    import torch

    from llama_train.model import Transformer, count_params, flops_per_token

    args = _resolve_args(model)
    s = args.max_seq_len if seq_len is None else int(seq_len)
    t0 = time.perf_counter()
    with torch.device("meta"):
        net = Transformer(args)
    meta_params = sum(prm.numel() for prm in net.parameters())  # a tied matrix is yielded once
    build_s = time.perf_counter() - t0
    counts = count_params(args)
    states = {dt: model_memory(args, zero_stage, world_size, dt, offload_optimizer) for dt in ("bf16", "fp32")}
    by_stage = {
        str(z): {dt: model_memory(args, z, world_size, dt)["total"] for dt in ("bf16", "fp32")} for z in range(4)
    }
    acts = {dt: activation_memory(args, micro_batch, s, dt, checkpointing, attention) for dt in ("bf16", "fp32")}
    return {
        "model_args": _args_dict(args),
        "params": counts,
        "meta_param_count": int(meta_params),
        "meta_build_seconds": build_s,
        "flops_per_token": flops_per_token(args, s),
        "seq_len": s,
        "model_state": states,
        "model_state_total_by_stage": by_stage,
        "activations": acts,
        "per_gpu_total": {dt: states[dt]["total"] + acts[dt]["total"] for dt in ("bf16", "fp32")},
    }


def _args_dict(args: "ModelArgs") -> Dict[str, Any]:
    from dataclasses import asdict

    d = asdict(args)
    d["head_dim"] = args.head_dim
    d["ffn_hidden_dim"] = args.ffn_hidden_dim
    return d


# =============================================================================================
# Shape search
# =============================================================================================

def _head_dim_for(dim: int) -> int:
    return 32 if dim < 512 else 64 if dim < 2048 else 128


def _kv_heads_for(n_heads: int) -> int:
    if n_heads >= 8 and n_heads % 4 == 0:
        return n_heads // 4
    if n_heads >= 8 and n_heads % 2 == 0:
        return n_heads // 2
    return n_heads


def target_aspect_ratio(dim: int) -> float:
    """dim / n_layers we aim for: 64 up to dim 768, 128 from dim 2048, log-linear between.

    GPT-3 small/medium sit at 43-64, LLaMA 7B/13B and Llama-3 8B at 128, the 65-70B models at
    ~102; Kaplan et al. 2020 found loss nearly flat over aspect ratios ~20-200, so this only
    needs to be sensible, not optimal.
    """
    lo, hi = 768, 2048
    if dim <= lo:
        return 64.0
    if dim >= hi:
        return 128.0
    t = math.log(dim / lo) / math.log(hi / lo)
    return 64.0 * 2.0**t


def shape_for_params(
    n_params: float,
    vocab_size: int = 32000,
    max_seq_len: int = 2048,
    *,
    count: str = "total",
    tie_embeddings: bool = False,
    tolerance: float = 0.02,
) -> "ModelArgs":
    """A LLaMA-shaped ``ModelArgs`` whose ``count_params(...)[count]`` is within ``tolerance`` of n_params.

    Rule: dim is a multiple of 64 below 1024 and of 128 above; head_dim 32 (dim < 512),
    64 (dim < 2048) or 128; n_kv_heads = n_heads/4 when n_heads >= 8 and divisible by 4
    (else n_heads/2 if even and >= 8, else plain MHA); SwiGLU hidden by the LLaMA rule with
    multiple_of 256 (dim >= 1024) or 64. For each dim the layer count that best hits the target
    is computed; among dims within tolerance we take the one whose dim/n_layers is closest (in
    log) to :func:`target_aspect_ratio`. ``count="total"`` is Chinchilla's N (embeddings
    included); use "non_embedding" for Kaplan-style counts.
    """
    from llama_train.model import ModelArgs, count_params

    target = float(n_params)
    if not math.isfinite(target) or target <= 0:
        raise ScalingError(f"n_params={n_params!r} must be a number > 0")
    if count not in ("total", "non_embedding"):
        raise ScalingError(f"count={count!r}: 'total' (Chinchilla N) or 'non_embedding'")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ScalingError(f"vocab_size={vocab_size!r} must be a positive integer")

    def make(dim: int, layers: int) -> "ModelArgs":
        hd = _head_dim_for(dim)
        n_heads = dim // hd
        return ModelArgs(dim=dim, n_layers=layers, n_heads=n_heads, n_kv_heads=_kv_heads_for(n_heads),
                         vocab_size=vocab_size, multiple_of=256 if dim >= 1024 else 64,
                         max_seq_len=max_seq_len, tie_embeddings=tie_embeddings)

    def search(dims: Sequence[int]) -> Tuple[Optional[Tuple[float, float, int, int]], Optional[Tuple[float, int, int]]]:
        best: Optional[Tuple[float, float, int, int]] = None  # (aspect miss, error, dim, layers)
        closest: Optional[Tuple[float, int, int]] = None  # (error, dim, layers)
        for dim in dims:
            c1 = count_params(make(dim, 1))[count]
            per_layer = count_params(make(dim, 2))[count] - c1
            base = c1 - per_layer
            layers = min(int(round((target - base) / per_layer)), 256)
            if layers < 1:
                continue
            err = abs(base + layers * per_layer - target) / target
            if closest is None or err < closest[0]:
                closest = (err, dim, layers)
            if err <= tolerance:
                miss = abs(math.log((dim / layers) / target_aspect_ratio(dim)))
                if best is None or (miss, err) < best[:2]:
                    best = (miss, err, dim, layers)
        return best, closest

    # "Nice" widths first: n_heads a multiple of 4 from dim 512 (so GQA groups of 4 divide
    # evenly), i.e. steps of 64 below 512, 256 up to 2048, 512 above. If no depth lands
    # within tolerance there, any multiple of 64 (<1024) / 128 may be used.
    nice = list(range(64, 512, 64)) + list(range(512, 2048, 256)) + list(range(2048, 32768 + 1, 512))
    best_fit, closest = search(nice)
    if best_fit is None:
        best_fit, closest = search(list(range(64, 1024, 64)) + list(range(1024, 32768 + 1, 128)))
    if best_fit is None:
        if closest is None:
            emb = vocab_size * 64 * (1 if tie_embeddings else 2)
            raise ScalingError(
                f"shape_for_params: {target:.3g} params is below the smallest model with vocab_size="
                f"{vocab_size} (embeddings alone ~{emb:.3g} at dim 64); use a smaller vocab, "
                f"tie_embeddings=True, or count='non_embedding'"
            )
        raise ScalingError(
            f"shape_for_params: no LLaMA shape within {tolerance:.0%} of {target:.3g} params "
            f"(closest: dim={closest[1]}, n_layers={closest[2]}, off by {closest[0]:.1%}); "
            f"raise tolerance or change vocab_size={vocab_size}"
        )
    _, _, dim, layers = best_fit
    return make(dim, layers)


# =============================================================================================
# CLI
# =============================================================================================

def _si(x: float, unit: str = "") -> str:
    """1.234e10 -> '12.3B' (counts) ."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def _gib(x: float) -> str:
    if x >= 2**30:
        return f"{x / 2**30:,.2f} GiB"
    if x >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    return f"{x / 2**10:.1f} KiB" if x else "0"


def _table(rows: Sequence[Sequence[Any]], header: Optional[Sequence[str]] = None) -> str:
    rows = [[str(c) for c in r] for r in rows]
    if header:
        rows = [list(header)] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if header and k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _float(text: str) -> float:
    """argparse type: accepts 1e21, 1.5e12, 7B, 2T, 300M."""
    t = text.strip().replace("_", "")
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:].upper())
    try:
        return float(t[:-1]) * mult if mult else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (examples: 1e21, 7e9, 7B, 2T)") from None


def _print_fit_header(fit: Dict[str, Any]) -> None:
    print(f"fit: {fit['name']}  E={fit['E']:.4g} A={fit['A']:.5g} B={fit['B']:.5g} "
          f"alpha={fit['alpha']:.4g} beta={fit['beta']:.4g}")
    if fit.get("source"):
        print(f"     ({fit['source']})")


def _cmd_compute_optimal(ns: argparse.Namespace) -> Dict[str, Any]:
    res = compute_optimal(ns.flops, ns.fit)
    if not ns.json:
        print(f"Compute-optimal allocation for C = {ns.flops:.3g} training FLOPs (C = 6 N D)")
        _print_fit_header(res["fit"])
        e = res["exponents"]
        rows = [["Approach 3 (fit, closed form)", _si(res["n_params"]), _si(res["n_tokens"]),
                 f"{res['tokens_per_param']:.1f}", f"{res['loss']:.4f}", f"a={e['a']:.3f}"]]
        for key, label in (("approach1", "Approach 1 (Hoffmann Tab. 3)"), ("approach2", "Approach 2 (Hoffmann Tab. A3)")):
            ap = res["approaches"][key]
            rows.append([label, _si(ap["n_params"]), _si(ap["n_tokens"]), f"{ap['tokens_per_param']:.1f}", "-",
                         f"a={ap['a']:.2f}"])
        print(_table(rows, ["", "params N", "tokens D", "tokens/param", "pred. loss", "N ∝ C^a"]))
        print(f"N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b with a={e['a']:.4f}, b={e['b']:.4f}, G={e['G']:.4g}")
    return res


def _cmd_inference_optimal(ns: argparse.Namespace) -> Dict[str, Any]:
    if ns.flops is None and ns.reference_params is None and ns.loss is None and ns.reference_tokens is None:
        raise ScalingError("inference-optimal: pass --flops C, or --reference-params N [--reference-tokens D], or --loss L")
    res = inference_optimal(ns.flops, ns.inference_tokens, ns.fit, reference_params=ns.reference_params,
                            reference_tokens=ns.reference_tokens, target_loss=ns.loss)
    if not ns.json:
        print(f"Inference-optimal model (Sardana et al. 2024) for the quality of the {res['target']}")
        _print_fit_header(res["fit"])
        print(f"target loss {res['loss']:.4f}, lifetime inference {_si(res['inference_tokens'])} tokens "
              f"(cost = 6 N D_train + 2 N D_inf)")
        cols = [("baseline", res["baseline"], "compute-optimal, same loss")]
        if "reference" in res:
            cols.append(("reference", res["reference"], "given model"))
        cols.append(("optimal", res, "inference-optimal"))
        rows = []
        for label, key in (("params N", "n_params"), ("train tokens D", "n_tokens"), ("tokens/param", "tokens_per_param"),
                           ("training FLOPs", "training_flops"), ("inference FLOPs", "inference_flops"),
                           ("total FLOPs", "total_flops")):
            rows.append([label] + [f"{c[key]:.1f}" if key == "tokens_per_param" else
                                   (_si(c[key]) if key in ("n_params", "n_tokens") else f"{c[key]:.4g}") for _, c, _ in cols])
        print(_table(rows, [""] + [f"{name} ({desc})" for name, _, desc in cols]))
        sv = res["savings"]
        print(f"saves {sv['flops']:.4g} FLOPs ({sv['percent']:.1f}%) vs the compute-optimal model of the same loss; "
              f"{res['param_ratio']:.1%} of its params, {res['token_ratio']:.2f}x its tokens")
        if "savings_vs_reference" in res:
            sr = res["savings_vs_reference"]
            print(f"saves {sr['flops']:.4g} FLOPs ({sr['percent']:.1f}%) vs the given reference model")
    return res


def _cmd_model_info(ns: argparse.Namespace) -> Dict[str, Any]:
    res = model_info(ns.model, zero_stage=ns.zero_stage, world_size=ns.world_size, micro_batch=ns.micro_batch,
                     seq_len=ns.seq_len, offload_optimizer=ns.offload_optimizer,
                     checkpointing=True if ns.activation_checkpointing else None, attention=ns.attention)
    if not ns.json:
        a, c = res["model_args"], res["params"]
        print(f"model {ns.model}: dim={a['dim']} n_layers={a['n_layers']} n_heads={a['n_heads']} "
              f"n_kv_heads={a['n_kv_heads'] or a['n_heads']} head_dim={a['head_dim']} ffn={a['ffn_hidden_dim']} vocab={a['vocab_size']}"
              f"{' tied' if a['tie_embeddings'] else ''}")
        print(_table([["total", f"{c['total']:,}", _si(c["total"])],
                      ["embedding", f"{c['embedding']:,}", _si(c["embedding"])],
                      ["non-embedding", f"{c['non_embedding']:,}", _si(c["non_embedding"])]],
                     ["parameters", "count", ""]))
        print(f"meta-device build: {res['meta_param_count']:,} params in {res['meta_build_seconds']:.2f}s")
        print(f"training FLOPs/token at seq_len {res['seq_len']}: {res['flops_per_token']:.4g}")
        st = res["model_state"]
        print(f"\nmodel states per GPU: ZeRO-{ns.zero_stage}, {ns.world_size} rank(s)"
              f"{', optimizer offloaded to CPU' if ns.offload_optimizer else ''}")
        rows = [[k] + [_gib(st[dt][k]) for dt in ("bf16", "fp32")]
                for k in ("params", "grads", "optimizer_states", "total", "cpu_optimizer_states")]
        print(_table(rows, ["", "bf16 mixed (2+2+12 B)", "fp32 (4+4+8 B, +4 B master in ZeRO-1/2/3)"]))
        print(_table([[f"ZeRO-{z}"] + [_gib(v[dt]) for dt in ("bf16", "fp32")]
                      for z, v in res["model_state_total_by_stage"].items()],
                     [f"all stages, {ns.world_size} rank(s)", "bf16 total", "fp32 total"]))
        act = res["activations"]
        print(f"\nactivations per micro-batch (b={ns.micro_batch}, s={res['seq_len']}, "
              f"checkpointing={'on' if act['bf16']['checkpointing'] else 'off'}, attention={ns.attention}):")
        print(_table([[k] + [_gib(act[dt][k]) for dt in ("bf16", "fp32")] for k in ("per_layer", "layers", "recompute", "head", "total")],
                     ["", "bf16", "fp32"]))
        print(f"per GPU (model states + activations): bf16 {_gib(res['per_gpu_total']['bf16'])}, "
              f"fp32 {_gib(res['per_gpu_total']['fp32'])}")
    return res


def _cmd_shape(ns: argparse.Namespace) -> Dict[str, Any]:
    from llama_train.model import count_params

    args = shape_for_params(ns.params, ns.vocab, ns.max_seq_len, count=ns.count, tie_embeddings=ns.tie_embeddings,
                            tolerance=ns.tolerance)
    counts = count_params(args)
    res = {"model_args": _args_dict(args), "params": counts, "target": ns.params, "count": ns.count,
           "relative_error": counts[ns.count] / ns.params - 1.0, "aspect_ratio": args.dim / args.n_layers}
    if not ns.json:
        print(f"LLaMA shape for {_si(ns.params)} {ns.count} params (vocab {ns.vocab}):")
        a = res["model_args"]
        print(_table([[k, a[k]] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim",
                                           "multiple_of", "vocab_size", "max_seq_len", "tie_embeddings")]))
        print(f"params: total {counts['total']:,}, non-embedding {counts['non_embedding']:,} "
              f"({res['relative_error']:+.2%} vs target); dim/n_layers = {res['aspect_ratio']:.0f}")
        print("yaml (configs/model/<name>.yaml):")
        for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len", "tie_embeddings"):
            v = a[k]
            print(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}")
    return res


def _cmd_fit(ns: argparse.Namespace) -> Dict[str, Any]:
    runs, skipped = collect_runs(ns.sweep_dir, params=ns.params)
    if len(runs) < 5:
        raise ScalingError(
            f"fit: {len(runs)} usable run(s) under {ns.sweep_dir} (need >= 5 with metrics.jsonl holding a "
            f"val_loss and run_info.json); skipped: {skipped[:5]}"
        )
    result = fit_loss_law([r.n_params for r in runs], [r.tokens for r in runs], [r.val_loss for r in runs],
                          top_k=ns.top_k, name=Path(ns.sweep_dir).name or "fitted")
    law = result.law
    budgets = []
    for budget, members in group_budgets(runs):
        best = min(members, key=lambda r: r.val_loss)
        n_opt, d_opt = law.optimal(budget)
        budgets.append({"flops": budget, "runs": len(members), "best_run": best.run, "best_n_params": best.n_params,
                        "best_val_loss": best.val_loss, "fitted_n_opt": n_opt, "fitted_d_opt": d_opt,
                        "fitted_loss": law.loss(n_opt, d_opt)})
    res = {**result.to_dict(), "params_convention": ns.params, "runs": [vars(r) for r in runs],
           "skipped": skipped, "budgets": budgets}
    if ns.out:
        res["plot"] = str(plot_isoflops(runs, law, ns.out))
    if ns.save_fit:
        import yaml

        Path(ns.save_fit).write_text(yaml.safe_dump(law.to_dict(), sort_keys=False))
        res["saved_fit"] = ns.save_fit
    if not ns.json:
        print(f"fitted L(N,D) = E + A/N^alpha + B/D^beta on {result.n_points} runs ({ns.params} params), "
              f"Huber delta={result.delta:g} on log loss, best of {result.n_starts} L-BFGS starts")
        print(_table([[k, f"{getattr(law, k):.5g}"] for k in ("E", "A", "B", "alpha", "beta")]))
        print(f"compute-optimal: N_opt ∝ C^{law.a:.4f}, D_opt ∝ C^{law.b:.4f}, G={law.G:.4g}; "
              f"rms log residual {result.rms_log_residual:.4f}")
        print(_table([[f"{b['flops']:.3g}", b["runs"], _si(b["best_n_params"]), f"{b['best_val_loss']:.4f}",
                       _si(b["fitted_n_opt"]), f"{b['fitted_loss']:.4f}"] for b in budgets],
                     ["budget (FLOPs)", "runs", "best run N", "its loss", "fitted N_opt", "fitted loss"]))
        if skipped:
            print(f"skipped {len(skipped)} run(s): " + "; ".join(f"{s['run']}: {s['reason']}" for s in skipped[:10]))
        if ns.out:
            print(f"plot: {res['plot']}")
        if ns.save_fit:
            print(f"fit saved to {ns.save_fit} (use it with --fit {ns.save_fit})")
    return res


def build_parser() -> argparse.ArgumentParser:
    fits = ", ".join(f"{k} ({v.source.split(',')[0]})" for k, v in FITS.items())
    parser = argparse.ArgumentParser(
        prog="llama-plan",
        description="Scaling-law planner: compute-optimal and inference-optimal model sizes, model memory, shapes, fits.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, fit: bool = True) -> None:
        p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
        if fit:
            p.add_argument("--fit", default="chinchilla",
                           help=f"loss-law constants: {fits}; or a YAML file with E, A, B, alpha, beta")

    p = sub.add_parser("compute-optimal", help="loss-optimal N, D for a training budget (Hoffmann et al. 2022)")
    p.add_argument("--flops", type=_float, required=True, help="training budget C in FLOPs (C = 6 N D)")
    common(p)
    p.set_defaults(func=_cmd_compute_optimal)

    p = sub.add_parser("inference-optimal", help="lifetime-cost-optimal N, D at a fixed loss (Sardana et al. 2024)")
    p.add_argument("--flops", type=_float, help="target quality = the compute-optimal model of this budget")
    p.add_argument("--reference-params", type=_float, help="target quality = this model size ...")
    p.add_argument("--reference-tokens", type=_float, help="... trained on this many tokens (default: compute-optimal)")
    p.add_argument("--loss", type=float, help="target quality as a predicted loss")
    p.add_argument("--inference-tokens", type=_float, required=True, help="lifetime inference tokens D_inf")
    common(p)
    p.set_defaults(func=_cmd_inference_optimal)

    p = sub.add_parser("model-info", help="params, FLOPs/token, ZeRO model-state and activation memory of a model")
    p.add_argument("--model", required=True, help="preset name (configs/model) or a model yaml path")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per forward")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer state in host memory")
    p.add_argument("--activation-checkpointing", action="store_true", help="force per-block recomputation on")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    common(p, fit=False)
    p.set_defaults(func=_cmd_model_info)

    p = sub.add_parser("shape", help="a LLaMA-shaped ModelArgs for a target parameter count")
    p.add_argument("--params", type=_float, required=True, help="target parameter count (e.g. 1.3e9 or 1.3B)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--count", default="total", choices=["total", "non_embedding"],
                   help="which count must hit the target (Chinchilla: total)")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.02, help="relative tolerance on the count")
    common(p, fit=False)
    p.set_defaults(func=_cmd_shape)

    p = sub.add_parser("fit", help="fit L(N,D) to a sweep's final validation losses; IsoFLOP plot")
    p.add_argument("sweep_dir", help="folder with run dirs (each: metrics.jsonl + run_info.json)")
    p.add_argument("--out", help="write the IsoFLOP/frontier plot to this PNG")
    p.add_argument("--params", default="total", choices=["total", "non_embedding"], help="which N to fit on")
    p.add_argument("--save-fit", help="write the fitted constants to this YAML (usable as --fit)")
    p.add_argument("--top-k", type=int, default=64,
                   help="run L-BFGS from the k best of the paper's 4500 initialisations (0 = all)")
    common(p, fit=False)
    p.set_defaults(func=_cmd_fit)
    return parser


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "top_k", None) == 0:
        ns.top_k = None
    try:
        res = ns.func(ns)
        if ns.json:
            print(json.dumps(_jsonable(res), indent=2))
    except ScalingError as exc:
        print(f"llama-plan {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `llama-plan ... | head`
        sys.stderr.close()
        return 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
