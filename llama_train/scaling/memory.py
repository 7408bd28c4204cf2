"""The memory model: parameter/FLOP counts of a model, model-state bytes per GPU under each ZeRO
stage (Rajbhandari et al. 2020) and activation bytes per micro-batch (after Korthikanti et al. 2022).

Plain Python: counts and shapes come from :mod:`llama_train.model.args`, no model is built
(``llama-plan model-info`` imports torch only for DeepSpeed's estimator). The per-rank peak
(:func:`rank_peak_memory`, and :func:`fit_advice` on it) is the largest of the phases that
:mod:`llama_train.scaling.phases` writes out term by term.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from llama_train.scaling.laws import ScalingError
# the phases of rank_peak_memory; HPZ_TERM and RANK_PEAK_MECHANISMS are this module's names too
from llama_train.scaling.phases import (HPZ_TERM, RANK_PEAK_MECHANISMS, _checkpoint_phases,  # noqa: F401
                                       _peak_of, _rank_terms, _zero0_phases, _zero3_phases,
                                       _zero12_phases, _zero_sizes)

if TYPE_CHECKING:
    from llama_train.model.args import ModelArgs


_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _resolve_args(model: Union["ModelArgs", str, Path]) -> "ModelArgs":
    from llama_train.model.args import ModelArgs, load_preset

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


def _check_groups(zero_stage: int, world_size: int, hpz_partition_size: int,
                  mics_shard_size: int) -> int:
    """ZeRO++'s hpZ and MiCS group sizes (deepspeed.zeropp.hpz_partition_size,
    deepspeed.mics_shard_size; 1 and 0: off); returns the ranks ZeRO-3 partitions the model
    states over: MiCS's shard group, else all of them."""
    for name, v, low in (("hpz_partition_size", hpz_partition_size, 1),
                         ("mics_shard_size", mics_shard_size, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ScalingError(f"{name}={v!r} must be an integer >= {low} ({low}: off)")
    on = [n for n, v in (("hpz_partition_size", hpz_partition_size > 1),
                         ("mics_shard_size", mics_shard_size > 0)) if v]
    if on and zero_stage != 3:
        raise ScalingError(f"{on[0]} needs ZeRO stage 3 (hpZ and MiCS partition ZeRO-3's weights)")
    if len(on) == 2:
        raise ScalingError("hpz_partition_size and mics_shard_size together: DeepSpeed does not "
                           "combine them; plan one")
    for name, v in (("hpz_partition_size", hpz_partition_size), ("mics_shard_size", mics_shard_size)):
        if v > 1 and world_size % v:
            raise ScalingError(f"{name}={v} must divide world_size={world_size} (groups of {v} "
                               f"consecutive ranks)")
    return mics_shard_size if mics_shard_size > 0 else world_size


def model_memory(
    args: Union["ModelArgs", str, Path],
    zero_stage: int = 0,
    world_size: int = 1,
    dtype: str = "bf16",
    offload_optimizer: bool = False,
    master_copy: Optional[bool] = None,
    *,
    hpz_partition_size: int = 1,
    mics_shard_size: int = 0,
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

    ZeRO-3 only: ``hpz_partition_size`` H > 1 (ZeRO++'s hpZ) adds the secondary copy of the
    16-bit weights partitioned over H ranks (one node), p Ψ/H (``hpz_secondary_params``, in
    ``total``); ``mics_shard_size`` M > 0 (MiCS) partitions params, grads and optimizer state
    over M ranks instead of all N (each state / M; M must divide N).

    Returns bytes: params, grads, optimizer_states, total (device), cpu_optimizer_states, and a
    breakdown {master_params, exp_avg, exp_avg_sq} of optimizer_states, to compare with the
    engine's real optimizer tensors; plus n_params (Ψ) and the settings.
    """
    from llama_train.model.args import count_params

    args = _resolve_args(args)
    p = _check_dtype(dtype)
    _check_zero(zero_stage, world_size, offload_optimizer)
    n = _check_groups(zero_stage, world_size, hpz_partition_size, mics_shard_size)
    if master_copy is None:
        master_copy = p != 4 or zero_stage >= 1
    psi = count_params(args)["total"]
    params, grads, master, moments, optim, cpu = _model_state_bytes(
        p, psi, zero_stage, n, master_copy, offload_optimizer)
    secondary = p * psi / hpz_partition_size if hpz_partition_size > 1 else 0.0
    return {
        "params": params,
        "grads": grads,
        "optimizer_states": optim,
        "hpz_secondary_params": secondary,
        "total": params + grads + optim + secondary,
        "cpu_optimizer_states": cpu,
        "breakdown": {"master_params": master, "exp_avg": moments / 2, "exp_avg_sq": moments / 2},
        "n_params": psi,
        "bytes_per_param_unpartitioned": p + p + (4 if master_copy else 0) + 8,
        "zero_stage": zero_stage,
        "world_size": world_size,
        "dtype": dtype,
        "offload_optimizer": bool(offload_optimizer),
        "master_copy": bool(master_copy),
        "hpz_partition_size": int(hpz_partition_size),
        "mics_shard_size": int(mics_shard_size),
    }


def _model_state_bytes(p: int, psi: int, zero_stage: int, n: int, master_copy: bool,
                       offload_optimizer: bool) -> tuple:
    """model_memory's ZeRO partitioning on its own: (params, grads, master, moments, optim, cpu)."""
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
    return params, grads, master, moments, optim, cpu


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
    "this model's SwiGLU, GQA, fp32 RMSNorm, fused attention and no dropout. Sequence parallelism "
    "over N ranks (parallel.sequence, Ulysses): a rank keeps s/N tokens of every term, except k "
    "and v, which attention holds for the whole sequence and n_kv_heads/N heads (at least one: "
    "2p*s*b*head_dim*max(n_kv_heads/N, 1)). When backward starts, the fp32 gradient of the "
    "logits (4*s*b*V, s/N tokens under sequence parallelism) lives beside all of them: the "
    "per-rank peak counts it (backward_transient). With the loss in chunks of c tokens "
    "(model.loss_chunk_tokens) no whole logits exist: the head keeps "
    "s*b*[h*(4 + 2p) + 12] + p*V*h (final norm, the hidden states' gradient in place of the "
    "output projection's input, token ids, and the output weight's gradient, all made in "
    "forward) and the transient is one chunk's logits and their gradient, "
    "min(c, s*b)*V*(4 + p) at the end of forward (4*c*V in fp32; fp16 makes the same in backward)."
)


def activation_memory(
    args: Union["ModelArgs", str, Path],
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    dtype: str = "bf16",
    checkpointing: Optional[bool] = None,
    attention: str = "sdpa",
    sequence_parallel: int = 1,
    loss_chunk_tokens: Optional[int] = None,
) -> Dict[str, Any]:
    """Activation bytes autograd keeps for backward, for one micro-batch on one rank;
    ``sequence_parallel`` N: the rank's share when N ranks share each sequence;
    ``loss_chunk_tokens`` defaults to ``args.loss_chunk`` (0: the whole logits).

    The formula is :data:`ACTIVATION_FORMULA`, a count of the tensors this model's forward saves
    (tests check it against the real saved tensors of a CPU model). ``checkpointing`` defaults
    to ``args.activation_checkpointing``; ``attention="eager"`` also keeps the s x s softmax.
    Keys (bytes): per_layer, layers (kept through the forward), recompute (one block rebuilt in
    backward when checkpointing), head, total = layers + recompute + head; backward_transient:
    the logits' gradient (chunked: one chunk's logits and gradient), made while all of those
    are still held (not in total); loss_chunk_tokens: the chunk in effect (0: none).
    """
    args = _resolve_args(args)
    p = _check_dtype(dtype)
    s = args.max_seq_len if seq_len is None else int(seq_len)
    b = int(micro_batch)
    if s <= 0 or b <= 0:
        raise ScalingError(f"seq_len={seq_len} and micro_batch={micro_batch} must be positive integers")
    if attention not in ("sdpa", "eager"):
        raise ScalingError(f"attention={attention!r}: 'sdpa' (fused, default) or 'eager'")
    n = int(sequence_parallel)
    if n < 1 or s % n:
        raise ScalingError(f"sequence_parallel={sequence_parallel} must be a positive divisor of "
                           f"seq_len={s}")
    ckpt = args.activation_checkpointing if checkpointing is None else bool(checkpointing)
    h, a, f, V, L = args.dim, args.n_heads, args.ffn_hidden_dim, args.vocab_size, args.n_layers
    h_kv = max(args.kv_heads // n, 1) * args.head_dim  # k, v heads attention holds on this rank
    sl = s // n  # this rank's tokens
    per_layer = sl * b * (h * (8 + 6 * p) + 4 * p * f + 4 * a + 8) + s * b * 2 * p * h_kv
    if p < 4:  # RoPE tables cast to 16 bit with the model: fp32 copies of cos, sin for q and k
        per_layer += 8 * sl * args.head_dim
    if attention == "eager":
        per_layer += p * (a // n) * s * s * b
    chunk = args.loss_chunk if loss_chunk_tokens is None else int(loss_chunk_tokens)
    if chunk < 0:
        raise ScalingError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 0 (0: whole logits)")
    if chunk:  # Transformer's chunked loss (model_ops.linear_cross_entropy)
        head = sl * b * (h * (4 + 2 * p) + 12) + p * V * h
        transient = min(chunk, sl * b) * V * (4 + (p if p < 4 else 0))
    else:
        head = sl * b * (h * (4 + 2 * p) + 4 * V + 20)
        transient = 4 * sl * b * V
    layers = L * p * sl * b * h if ckpt else L * per_layer
    recompute = per_layer if ckpt else 0
    return {
        "per_layer": float(per_layer),
        "layers": float(layers),
        "recompute": float(recompute),
        "head": float(head),
        "total": float(layers + recompute + head),
        "backward_transient": float(transient),
        "loss_chunk_tokens": chunk,
        "checkpointing": ckpt,
        "micro_batch": b,
        "seq_len": s,
        "sequence_parallel": n,
        "dtype": dtype,
        "attention": attention,
        "formula": ACTIVATION_FORMULA,
    }


def sequence_parallel_traffic(
    args: Union["ModelArgs", str, Path],
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    sequence_parallel: int = 2,
    dtype: str = "bf16",
    checkpointing: Optional[bool] = None,
) -> Dict[str, Any]:
    """The all-to-alls one rank runs for one micro-batch under sequence parallelism (Ulysses):
    in every layer q, k, v and the attention output forward, their gradients backward, and the
    forward's four again when activation checkpointing recomputes the block. Each exchanges the
    rank's (b, s/N, heads, head_dim) tensor (k and v with max(n_kv_heads, N) heads: fewer are
    copied up to N first) and (N-1)/N of it leaves the rank. Keys: calls, bytes (the exchanged
    tensors, as each all-to-all's output), bytes_sent."""
    args = _resolve_args(args)
    p = _check_dtype(dtype)
    s = args.max_seq_len if seq_len is None else int(seq_len)
    n, b = int(sequence_parallel), int(micro_batch)
    if n < 1 or s % n:
        raise ScalingError(f"sequence_parallel={sequence_parallel} must be a positive divisor of "
                           f"seq_len={s}")
    ckpt = args.activation_checkpointing if checkpointing is None else bool(checkpointing)
    passes = 3 if ckpt else 2  # forward, backward (+ the recomputed forward)
    one_head = p * b * (s // n) * args.head_dim
    q, kv = one_head * args.n_heads, one_head * max(args.kv_heads, n)
    call_bytes = [] if n == 1 else [q, kv, kv, q]  # per layer and pass: q, k, v, out
    total = passes * args.n_layers * sum(call_bytes)
    return {"calls": len(call_bytes) * args.n_layers * passes, "bytes": float(total),
            "call_bytes": call_bytes, "passes": passes, "layers": args.n_layers,
            "bytes_sent": float(total * (n - 1) / n), "sequence_parallel": n, "seq_len": s,
            "micro_batch": b, "dtype": dtype, "checkpointing": ckpt}


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
    sequence_parallel: int = 1,
    loss_chunk_tokens: Optional[int] = None,
    hpz_partition_size: int = 1,
    mics_shard_size: int = 0,
) -> Dict[str, Any]:
    """Params, FLOPs/token, model-state and activation memory, counted from the shape (no
    model is built); ``world_size`` counts every rank (ZeRO partitions over all of them),
    ``sequence_parallel`` how many share each sequence, ``loss_chunk_tokens`` overrides the
    model's (:func:`activation_memory`); ``hpz_partition_size`` and ``mics_shard_size``
    (ZeRO-3: ZeRO++'s hpZ, MiCS; :func:`model_memory`) change ``model_state``, not
    ``model_state_total_by_stage`` (plain ZeRO)."""
    from llama_train.model.args import count_params, flops_per_token

    args = _resolve_args(model)
    s = args.max_seq_len if seq_len is None else int(seq_len)
    counts = count_params(args)
    states = {dt: model_memory(args, zero_stage, world_size, dt, offload_optimizer,
                               hpz_partition_size=hpz_partition_size,
                               mics_shard_size=mics_shard_size)
              for dt in ("bf16", "fp32")}
    by_stage = {
        str(z): {dt: model_memory(args, z, world_size, dt)["total"] for dt in ("bf16", "fp32")} for z in range(4)
    }
    acts = {dt: activation_memory(args, micro_batch, s, dt, checkpointing, attention, sequence_parallel,
                                  loss_chunk_tokens)
            for dt in ("bf16", "fp32")}
    return {
        "model_args": _args_dict(args),
        "params": counts,
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



def rank_peak_memory(
    args: Union["ModelArgs", str, Path],
    zero_stage: int = 0,
    world_size: int = 1,
    dtype: str = "bf16",
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    activation_checkpointing: Optional[bool] = None,
    device: str = "cuda",
    ds: Optional[Any] = None,
    attention: str = "sdpa",
    zero_overrides: Optional[Dict[str, int]] = None,
    gloo_copies: Optional[bool] = None,
    sequence_parallel: int = 1,
    loss_chunk_tokens: Optional[int] = None,
    hpz_partition_size: Optional[int] = None,
    mics_shard_size: Optional[int] = None,
) -> Dict[str, Any]:
    """Peak bytes one data-parallel rank holds while it builds the model, initialises DeepSpeed
    and trains (model states + activations + DeepSpeed's own buffers and transients), from the
    mechanisms of DeepSpeed 0.19.8 listed in :data:`RANK_PEAK_MECHANISMS` (checked against
    ``llama-bench memory``, docs/benchmarks-memory.md).

    ``ds`` is our :class:`llama_train.config.DeepSpeedConfig` (bucket sizes, persistence
    threshold; default: its defaults); ``zero_overrides`` sets DeepSpeed zero_optimization keys our
    config leaves at DeepSpeed's defaults (sub_group_size, stage3_max_live_parameters,
    stage3_max_reuse_distance) or overrides ours (reduce_bucket_size, stage3_prefetch_bucket_size,
    stage3_param_persistence_threshold). ``device="cpu"`` counts what a CPU rank's resident set
    shows (untouched bucket pages are not resident; gloo's reduce-scatter copies); ``"cuda"``
    counts allocations (whole buckets). ``gloo_copies`` (default: ``device == "cpu"``): count
    the copies gloo itself makes in a reduce-scatter or all-gather; a simulated rank
    (``comm.simulate_ranks``), whose collectives are answered in place, has none. Returns bytes: ``total`` (the peak; on CPU host and device
    together), ``device`` and ``host`` at the peak, ``peak_phase``, ``phases`` {name: bytes},
    ``breakdown`` {term: bytes} of the peak phase, ``unpartitioned`` (the terms of the peak that do
    not shrink with N), plus n_params and the settings.

    ZeRO-3 only (default: ``ds.zeropp.hpz_partition_size`` and ``ds.mics_shard_size``, else
    off): ``hpz_partition_size`` H > 1 adds hpZ's secondary weight partition, p Psi/H, from
    the build (zero.Init cuts it beside the primary one) through each step (DeepSpeed drops it
    after the step and after a save, and cuts it again as forward releases each parameter);
    ``mics_shard_size`` M partitions the model states over M ranks instead of N (not measured:
    the installed DeepSpeed has no MiCS)."""
    args, p, hpz_partition_size, mics_shard_size, shard = _rank_settings(
        args, dtype, zero_stage, world_size, offload_optimizer, offload_params, device, ds,
        hpz_partition_size, mics_shard_size)
    sizes = _zero_sizes(args, ds, zero_overrides)
    act = activation_memory(args, micro_batch, seq_len, dtype, activation_checkpointing, attention,
                            sequence_parallel, loss_chunk_tokens)
    acts = act["total"] + act["backward_transient"]  # backward's start (chunked: forward's end)
    # MiCS: partitions and the reduce-scatter span the shard group (``shard``), not the world
    t = _rank_terms(args, p, shard, sizes, acts, device == "cpu", offload_optimizer,
                    device == "cpu" if gloo_copies is None else gloo_copies)
    phases, peak, checkpoint = _rank_phases(t, p, zero_stage, hpz_partition_size,
                                            offload_optimizer, offload_params)
    return {
        **peak,
        "n_params": t.psi,
        "bytes_per_param": peak["total"] / t.psi,
        "zero_stage": zero_stage, "world_size": world_size, "dtype": dtype,
        "micro_batch": micro_batch,
        "hpz_partition_size": int(hpz_partition_size), "mics_shard_size": int(mics_shard_size),
        "loss_chunk_tokens": act["loss_chunk_tokens"],
        "seq_len": acts and activation_memory(args, micro_batch, seq_len, dtype)["seq_len"],
        "offload_optimizer": bool(offload_optimizer), "offload_params": bool(offload_params),
        "device_kind": device, "ds_buckets": sizes,
        "phase_terms": {k: {term: float(b) for term, b in v.items()} for k, v in phases.items()},
        "checkpoint_phases": {k: float(sum(v.values())) for k, v in checkpoint.items()},
    }


def _rank_settings(model: Union["ModelArgs", str, Path], dtype: str, zero_stage: int,
                   world_size: int, offload_optimizer: bool, offload_params: bool, device: str,
                   ds: Optional[Any], hpz_partition_size: Optional[int],
                   mics_shard_size: Optional[int]) -> tuple:
    """rank_peak_memory's checks and hpZ/MiCS defaults, apart: (args, p, hpz, mics, shard)."""
    args = _resolve_args(model)
    p = _check_dtype(dtype)
    _check_zero(zero_stage, world_size, offload_optimizer)
    if hpz_partition_size is None:
        hpz_partition_size = ds.zeropp.hpz_partition_size if ds is not None else 1
    if mics_shard_size is None:
        mics_shard_size = ds.mics_shard_size if ds is not None else 0
    shard = _check_groups(zero_stage, world_size, hpz_partition_size, mics_shard_size)
    if offload_params and zero_stage != 3:
        raise ScalingError("offload_params needs ZeRO stage 3 (parameter offload exists only there)")
    if device not in ("cpu", "cuda"):
        raise ScalingError(f"device={device!r}: 'cpu' or 'cuda'")
    return args, p, hpz_partition_size, mics_shard_size, shard


def _rank_phases(t: Any, p: int, zero_stage: int, hpz_partition_size: int,
                 offload_optimizer: bool, offload_params: bool) -> tuple:
    """rank_peak_memory's phases of ``t`` (hpZ's term added): (phases, peak, checkpoint)."""
    if hpz_partition_size > 1:
        t.hpz = p * t.psi / hpz_partition_size
    if zero_stage == 0:
        phases, unpart = _zero0_phases(t)
    elif zero_stage in (1, 2):
        phases, unpart = _zero12_phases(t, zero_stage)
    else:
        phases, unpart = _zero3_phases(t)
    peak = _peak_of(phases, unpart, offload_optimizer, offload_params)
    return phases, peak, _checkpoint_phases(t, zero_stage)


def deepspeed_estimate(args: Union["ModelArgs", str, Path], zero_stage: int, world_size: int,
                       offload_optimizer: bool = False, offload_params: bool = False) -> Dict[str, Any]:
    """DeepSpeed's own model-state estimators (``estimate_zero2_model_states_mem_needs``, used by
    ``..._all_cold`` for ZeRO-1/2, and ``estimate_zero3_model_states_mem_needs`` for ZeRO-3), for
    one node of ``world_size`` ranks, through :mod:`llama_train.engine.estimates`. Bytes: gpu
    (per rank), cpu (per node), per_rank_cpu_ranks (gpu + cpu / ranks: what a CPU rank would
    hold). ZeRO-0 has no estimator (None)."""
    from llama_train.engine.estimates import zero_model_states_mem_needs
    from llama_train.model.args import count_params, param_shapes

    args = _resolve_args(args)
    psi = count_params(args)["total"]
    largest = None
    if zero_stage == 3:  # the largest module's parameters: each module holds one parameter
        largest = max(math.prod(shape) for _, shape in param_shapes(args))
    try:
        est = zero_model_states_mem_needs(zero_stage, psi, world_size, largest_layer_params=largest,
                                          offload_optimizer=offload_optimizer,
                                          offload_params=offload_params)
    except ImportError as exc:  # pragma: no cover - DeepSpeed is a dependency
        return {"gpu": None, "cpu": None, "per_rank_cpu_ranks": None, "function": f"unavailable: {exc}"}
    if est is None:
        return {"gpu": None, "cpu": None, "per_rank_cpu_ranks": None, "function": None}
    gpu, cpu = est["gpu"], est["cpu"]
    return {"gpu": float(gpu), "cpu": float(cpu), "per_rank_cpu_ranks": float(gpu + cpu / world_size),
            "function": est["function"], "additional_buffer_factor": 1.5}


FIT_ORDER = ("higher ZeRO stage", "activation checkpointing", "smaller micro-batch",
             "optimizer offload", "param offload")


def fit_advice(args: Union["ModelArgs", str, Path], limit_bytes: float, **cfg: Any) -> Dict[str, Any]:
    """Does ``rank_peak_memory(args, **cfg)`` fit in ``limit_bytes`` per rank (the accelerator's
    memory; on ``device="cpu"`` the rank's RAM)? If not, the cheapest change that fits, trying
    :data:`FIT_ORDER` one change at a time (the lowest higher ZeRO stage first; micro-batch halved
    down to 1, the global batch kept by more accumulation), then the changes accumulated in that
    order, then two changes together, then three, ... Returns fits, predicted, and suggestion
    {change, settings, predicted} or None (then ``closest``: all changes together)."""
    args = _resolve_args(args)
    cfg = dict(cfg)
    cfg.setdefault("zero_stage", 0)
    cfg.setdefault("micro_batch", 1)

    def measure(c: Dict[str, Any]) -> float:
        r = rank_peak_memory(args, **c)
        return r["total"] if c.get("device", "cuda") == "cpu" else r["device"]

    def options(c: Dict[str, Any]):
        for stage in range(c["zero_stage"] + 1, 4):
            yield FIT_ORDER[0] + f" (ZeRO-{stage})", dict(c, zero_stage=stage)
        if not c.get("activation_checkpointing"):
            yield FIT_ORDER[1], dict(c, activation_checkpointing=True)
        mb = c["micro_batch"]
        while mb > 1:
            mb //= 2
            yield (FIT_ORDER[2] + f" ({mb}, {c['micro_batch'] // mb}x the accumulation)",
                   dict(c, micro_batch=mb))
        if c["zero_stage"] >= 1 and not c.get("offload_optimizer"):
            yield FIT_ORDER[3], dict(c, offload_optimizer=True)
        if not c.get("offload_params"):
            yield FIT_ORDER[4] + " (needs ZeRO-3)", dict(c, zero_stage=3, offload_optimizer=True,
                                                      offload_params=True)

    predicted = measure(cfg)
    out: Dict[str, Any] = {"fits": predicted <= limit_bytes, "predicted": predicted,
                           "limit": float(limit_bytes), "suggestion": None, "settings": cfg}
    if out["fits"]:
        return out
    for change, c in options(cfg):
        if measure(c) <= limit_bytes:
            out["suggestion"] = {"change": change, "settings": c, "predicted": measure(c)}
            return out
    # nothing alone: two changes, then three, ... (kinds in FIT_ORDER, each kind's options
    # cheapest first), the first combination that fits
    from itertools import combinations, product

    kinds = {k: [(ch, c) for ch, c in options(cfg) if ch.startswith(k)] for k in FIT_ORDER}
    kinds = {k: v for k, v in kinds.items() if v}
    last = None
    for r in range(2, len(kinds) + 1):
        for ks in combinations(kinds, r):
            for combo in product(*(kinds[k] for k in ks)):
                c = dict(cfg)
                for _, cand in combo:
                    c.update({k: v for k, v in cand.items() if v != cfg.get(k)})
                if c.get("offload_params") or c.get("offload_optimizer"):
                    c["zero_stage"] = max(c["zero_stage"], 3 if c.get("offload_params") else 1)
                last = (" + ".join(ch for ch, _ in combo), c)
                if measure(c) <= limit_bytes:
                    out["suggestion"] = {"change": last[0], "settings": c, "predicted": measure(c)}
                    return out
    out["closest"] = {"change": last[0], "settings": last[1], "predicted": measure(last[1])} if last else None
    return out
