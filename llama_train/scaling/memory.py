"""The memory model: parameter/FLOP counts of a model, model-state bytes per GPU under each ZeRO
stage (Rajbhandari et al. 2020) and activation bytes per micro-batch (after Korthikanti et al. 2022).

torch is imported lazily, inside the functions that build or count a model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from llama_train.scaling.laws import ScalingError

if TYPE_CHECKING:
    from llama_train.model import ModelArgs


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


def _check_zero(zero_stage: int, world_size: int, offload_optimizer: bool) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise ScalingError(f"zero_stage={zero_stage!r}: ZeRO stages are 0, 1, 2, 3")
    if not isinstance(world_size, int) or world_size < 1:
        raise ScalingError(f"world_size={world_size!r} must be an integer >= 1 (data-parallel ranks)")
    if offload_optimizer and zero_stage == 0:
        raise ScalingError("offload_optimizer needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads the partitioned optimizer)")


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
    _check_zero(zero_stage, world_size, offload_optimizer)
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
