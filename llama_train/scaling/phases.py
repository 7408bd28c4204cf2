"""The phases of one rank's peak memory under DeepSpeed 0.19.8 (:data:`RANK_PEAK_MECHANISMS`):
build, initialize, forward, backward and step of ZeRO-0, ZeRO-1/2 and ZeRO-3 (with hpZ and MiCS),
a checkpoint's save and load beside them, each a dict of terms in bytes. What
:func:`llama_train.scaling.memory.rank_peak_memory` takes the largest of; plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

from llama_train.scaling.laws import ScalingError

if TYPE_CHECKING:
    from llama_train.model.args import ModelArgs


RANK_PEAK_MECHANISMS = """\
Per-rank peak = the largest of the phases below; Psi params, N ranks, p bytes/element of the model
dtype, g of DeepSpeed's gradient buffers (= p), B = reduce_bucket_size elements, A activations
(activation_memory). On CPU ranks only touched pages count: a bucket holds min(B, Psi) elements.
build      ZeRO-0/1/2: engine.build_model materialises the whole model in fp32 on every rank (4 Psi).
           ZeRO-3: the bf16 partition (p Psi/N) + one parameter gathered whole to initialise it,
           and (bf16/fp16) its values drawn in fp32 before one rounding (Transformer.init_param):
           (p + 4) x the largest parameter (6.3 GB for llama3_70b's 1.05e9-element embedding).
ZeRO-0     (bf16: DeepSpeed's FP16_UnfusedOptimizer; fp32: torch AdamW) model p Psi, grads p Psi,
           fp32 master 4 Psi and its fp32 grads 4 Psi (bf16 only), Adam moments 8 Psi, all whole:
           20 Psi (bf16), 16 Psi (fp32); N > 1 adds the flat all-reduce copy of the grads.
ZeRO-1/2   (stage_1_and_2.py) the bf16 model as one flat buffer (p Psi, whole), fp32 master
           partition 4 Psi/N, moments 8 Psi/N, gradient partition g Psi/N; in backward the
           contiguous ipg bucket g min(B, Psi); ZeRO-1 has no backward hooks, so every full
           grad (g Psi) exists before reduce_gradients reduces them; in step() the flat bf16 copy of the gradient
           partition and its fp32 conversion (g + 4) Psi/N (stage_1_and_2.py, step ->
           flatten_dense_tensors_aligned / .to(fp32)); then the updated partitions are all-gathered
           into the flat model, which gloo does through a full-size copy (p Psi, CPU ranks only).
ZeRO-3     (stage3.py) bf16 partition p Psi/N, flat bf16 gradient partitions g Psi/N
           (grad_partitions_flat_buffer), fp32 master 4 Psi/N, moments 8 Psi/N, ipg bucket
           g min(B, Psi) (_setup_for_real_optimizer); initialize also gathers each parameter
           whole once (create_reduce_and_remove_grad_hooks), beside the partitions: + p x the
           largest parameter. The Adam moments appear in the first step(), so the first
           forward and backward hold 8 Psi/N less than later ones. step(): _prepare_fp32_grad_for_sub_group
           flattens the gradient partition (g Psi/N) and converts it to fp32 (4 Psi/N) while the
           moments exist: +(g + 4) min(Psi/N, sub_group_size). From the second step on the
           parameter coordinator has a trace and, with stage3_max_reuse_distance and
           stage3_max_live_parameters (DeepSpeed defaults 1e9 elements) above Psi, keeps every
           parameter gathered from its forward use to its backward use: the whole model,
           p min(Psi, max_live), is resident at the start of backward, beside the activations
           (in general the last max_reuse_distance/2 elements of the forward, at least the
           largest param, plus the prefetch bucket);
           each full bucket is reduce-scattered through a concatenated copy (g min(B, Psi)) and,
           on gloo, a clone plus ring buffers ((1 + 1/N) g min(B, Psi); a param larger than the
           bucket is reduced alone, so at least its size): with B < Psi the first
           bucket goes early in backward, beside all of that; with B >= Psi once, at the end,
           when the activations and gathered params are gone. Small parameters
           (<= stage3_param_persistence_threshold elements) stay whole on every rank.
ZeRO-3     + offload_optimizer + offload_params: the same host-side tensors, plus the fp32
           gradient partition kept for the CPU Adam (4 Psi/N) instead of the step's transient;
           on a CPU rank host and device are one pool, so offload saves nothing there.
ZeRO-3     + hpZ (deepspeed.zeropp.hpz_partition_size H): a second partition of the weights over
           H ranks (partition_parameters.py _partition_param_sec), p Psi/H, cut by zero.Init and
           again as forward releases each parameter, dropped after each step and save
           (stage3.py invalidate_secondary_tensor): in every phase but the save.
ZeRO-3     + MiCS (deepspeed.mics_shard_size M): the partitions above over M ranks, not N
           (DeepSpeed <= 0.19.6 only; not measured here).
"""


@dataclass
class _RankTerms:
    """What the phases of :func:`rank_peak_memory` are written in (:data:`RANK_PEAK_MECHANISMS`):
    Psi, N, p and g bytes/element, whether the rank is a CPU one, A, B (``bucket``: on CPU at most
    Psi), Psi/N, the largest parameter, the persistent parameters' elements, the buckets."""

    psi: int
    n: int
    p: int
    g: int
    cpu: bool
    acts: float
    bucket: int
    part: float
    largest: int
    persistent: int
    sizes: Dict[str, int]
    offload_optimizer: bool
    gloo: bool = False  # gloo's own reduce-scatter / all-gather copies are counted
    hpz: float = 0.0  # bytes of hpZ's secondary weight partition (ZeRO-3), p Psi / H


def _zero_sizes(args: "ModelArgs", ds: Optional[Any],
                zero_overrides: Optional[Dict[str, int]]) -> Dict[str, int]:
    """DeepSpeed's bucket and ZeRO-3 sizes as our config gives them, with ``zero_overrides``."""
    from llama_train.config import DeepSpeedConfig

    ds = ds if ds is not None else DeepSpeedConfig()
    sizes = ds.zero_sizes(args.dim)  # what engine.ds_config.build_ds_config gives DeepSpeed
    for key, value in (zero_overrides or {}).items():
        key = key if key in sizes else "stage3_" + key
        if key not in sizes:
            raise ScalingError(f"zero_overrides: unknown key {key!r}; known: {sorted(sizes)}")
        sizes[key] = int(value)
    return sizes


def _rank_terms(args: "ModelArgs", p: int, world_size: int, sizes: Dict[str, int], acts: float,
                cpu: bool, offload_optimizer: bool, gloo: bool) -> _RankTerms:
    from llama_train.model.args import count_params, param_shapes

    psi = count_params(args)["total"]
    bucket = min(sizes["reduce_bucket_size"], psi) if cpu else sizes["reduce_bucket_size"]
    shapes = [math.prod(shape) for _, shape in param_shapes(args)]
    persistent = sum(k for k in shapes if k <= sizes["stage3_param_persistence_threshold"])
    # g: DeepSpeed's gradient buffers follow the model dtype (grad_accum_dtype unset)
    return _RankTerms(psi=psi, n=world_size, p=p, g=p, cpu=cpu, acts=acts, bucket=bucket,
                      part=psi / world_size, largest=max(shapes), persistent=persistent,
                      sizes=sizes, offload_optimizer=offload_optimizer, gloo=gloo)


Phases = Dict[str, Dict[str, float]]


def _zero0_phases(t: _RankTerms) -> Tuple[Phases, Set[str]]:
    psi, p, g, acts = t.psi, t.p, t.g, t.acts
    phases: Phases = {}
    # bf16/fp16: FP16_UnfusedOptimizer builds an fp32 master copy with fp32 grads and runs
    # its first step in initialize (moments exist from there), beside the model and its grads
    master = 8.0 * psi if p < 4 else 0.0
    phases["build"] = {"fp32 model": 4.0 * psi}
    phases["initialize"] = {"model": p * psi, "grads": g * psi, "fp32 master + grads": master,
                            "moments": 8.0 * psi}
    # backward writes the grads as it frees the activations: the larger of the two
    phases["backward"] = {"model": p * psi, "fp32 master + grads": master, "moments": 8.0 * psi,
                          "grads or activations": max(g * psi, acts)}
    return phases, set(phases["backward"]) | set(phases["initialize"])


def _zero12_phases(t: _RankTerms, zero_stage: int) -> Tuple[Phases, Set[str]]:
    psi, n, p, g, acts, part, bucket = t.psi, t.n, t.p, t.g, t.acts, t.part, t.bucket
    phases: Phases = {}
    states = {"model (flat)": p * psi, "fp32 master": 4.0 * part, "moments": 8.0 * part}
    phases["build"] = {"fp32 model": 4.0 * psi}
    # flatten_dense_tensors_aligned copies the whole bf16 model (both alive), then the fp32
    # master partition and initialize_optimizer_states' zero fp32 grad partition
    init = {"model": p * psi, "flat copy": p * psi}
    init2 = {"model (flat)": p * psi, "fp32 master": 4.0 * part, "fp32 grad partition": 4.0 * part}
    # before that, deepspeed.initialize casts the fp32 model to bf16 parameter by parameter:
    # the fp32 model and one parameter's bf16 copy (measured at llama3_8b's shapes, 4 layers,
    # 64 ranks: 8.15 GiB against 7.16 for the flat copy alone)
    cast = {"fp32 model": 4.0 * psi, "bf16 copy of the largest": p * t.largest} if p < 4 else {}
    phases["initialize"] = max(init, init2, cast, key=lambda d: sum(d.values()))
    ipg = g * bucket
    phases["forward"] = {**states, "activations": acts}
    if zero_stage == 1:
        # no backward hooks: autograd leaves every full grad in param.grad (g Psi); then
        # reduce_gradients (stage_1_and_2.py) reduces them bucket by bucket into the partition
        phases["backward"] = {**states, "full grads": g * psi, "grad partition": g * part,
                              "ipg bucket": ipg}
    else:  # stage 2: each grad is reduced as soon as its bucket fills, then freed
        # except a parameter larger than the bucket: its whole gradient is kept until the step
        # and copied into the partition (copy_grads_in_partition) beside it. The embedding's
        # comes last, when the activations are gone: 2 g x the largest parameter instead of
        # them (measured: 1.96 GiB at llama3_8b's shapes, 4 layers, 64 ranks)
        phases["backward"] = {**states, "grad partition": g * part, "ipg bucket": ipg,
                              "reduce copy": g * bucket if n > 1 else 0.0,
                              "activations or the largest grad + its copy":
                                  max(acts, 2.0 * g * t.largest) if n > 1 else acts}
    if t.offload_optimizer:
        phases["step"] = {**states, "grad partition": g * part, "fp32 grads": 4.0 * part}
    else:
        phases["step"] = {**states, "grad partition": g * part,
                          "step: flat + fp32 grads": (g + 4.0) * part}
    if n > 1:  # the largest parameter's whole gradient, kept until the step (ZeRO-1 and 2)
        phases["step"]["largest grad (kept)"] = g * t.largest
    if n > 1 and t.gloo:
        # after the step each rank's updated bf16 partition is gathered into the flat model
        # (runtime/utils.py all_gather_into_tensor_dp_groups); gloo gathers into a new flat
        # tensor of the output's size and copies it back: a second p Psi for a moment
        phases["all-gather"] = {**states, "all-gather copy (gloo)": p * psi}
    return phases, {"model (flat)", "model", "flat copy", "fp32 model", "ipg bucket",
                    "reduce copy", "activations", "full grads", "all-gather copy (gloo)"}


def _zero3_phases(t: _RankTerms) -> Tuple[Phases, Set[str]]:
    psi, n, p, g, acts, part, bucket = t.psi, t.n, t.p, t.g, t.acts, t.part, t.bucket
    sizes, largest = t.sizes, t.largest
    z = {"sub_group_size": sizes["sub_group_size"],
         "max_live_parameters": sizes["stage3_max_live_parameters"],
         "max_reuse_distance": sizes["stage3_max_reuse_distance"]}
    phases: Phases = {}
    states = {"param partition": p * part, "grad partitions": g * part, "fp32 master": 4.0 * part,
              "moments": 8.0 * part, "persistent params": p * t.persistent}
    if t.offload_optimizer:
        states["fp32 grads (offload)"] = 4.0 * part
    ipg = g * bucket
    phases["build"] = {"param partition": p * part, "gathered param": p * largest,
                       "fp32 init draw": 4.0 * largest if p < 4 else 0.0}
    # initialize: the fp32 master and a transient fp32 gradient buffer (initialize_optimizer_
    # states), then the gradient partitions, and each parameter gathered whole once more while
    # its gradient hook is registered (create_reduce_and_remove_grad_hooks: all_gather, then
    # partition): measured at 64 ranks on llama3_8b, 1.93 GiB against 1.40 without that term
    with_buffer = {"param partition": p * part, "fp32 master": 4.0 * part,
                   "fp32 grad buffer": 4.0 * part, "grad partitions": g * part}
    with_hooks = {"param partition": p * part, "fp32 master": 4.0 * part,
                  "grad partitions": g * part, "gathered param": p * largest}
    if t.offload_optimizer:  # the fp32 gradient buffers of CPU Adam, made in initialize
        with_hooks["fp32 grads (offload)"] = 4.0 * part
    phases["initialize"] = max(with_buffer, with_hooks, key=lambda d: sum(d.values()))
    # a param used at forward position x (elements) is used again in backward after about
    # 2 (Psi - x) elements: the last max_reuse_distance / 2 elements of the forward stay
    # gathered (capped by max_live_parameters), plus the module in use (at least the largest
    # param) and the prefetch bucket; never more than the whole model
    kept = min(z["max_reuse_distance"] // 2, z["max_live_parameters"])
    live = min(psi, max(kept, largest) + sizes["stage3_prefetch_bucket_size"])
    # a parameter larger than the bucket is reduced on its own: the copies hold at least it
    reduced = max(bucket, largest) if bucket < psi else bucket
    rs = (g * reduced * ((2.0 + 1.0 / n) if t.gloo else 1.0)) if n > 1 else 0.0
    phases["forward"] = {**states, "gathered params": p * live, "activations": acts}
    if bucket < psi:  # the first bucket is reduced early in backward, beside it all
        phases["backward"] = {**states, "ipg bucket": ipg, "gathered params": p * live,
                              "activations": acts, "reduce-scatter copies": rs}
    else:  # one bucket, reduced at the end, when activations and gathered params are gone
        phases["backward"] = {**states, "gathered params": p * live, "activations": acts}
        phases["backward end"] = {**states, "ipg bucket": ipg, "reduce-scatter copies": rs}
    step = dict(states, **{"ipg bucket": ipg})
    if not t.offload_optimizer:
        step["step: flat + fp32 grads"] = (g + 4.0) * min(part, z["sub_group_size"])
    phases["step"] = step
    if t.hpz:  # hpZ: cut at every partition (zero.Init's, forward's releases), dropped after the step
        for terms in phases.values():
            terms[HPZ_TERM] = t.hpz
    return phases, {"persistent params", "ipg bucket", "gathered params", "gathered param",
                    "fp32 init draw",
                    "reduce-scatter copies", "activations", HPZ_TERM}


HPZ_TERM = "hpZ secondary partition"


def _checkpoint_phases(t: _RankTerms, zero_stage: int) -> Phases:
    """A checkpoint's save and a resume's load, beside the training peak (not part of it): the
    save writes the states (and the ipg bucket, resident since initialize) in place; the load
    holds this rank's optimizer file (fp32 master and moments, 12 Psi/N) while it is copied in,
    and under ZeRO-1/2 the whole 16-bit module state dict (p Psi) too. Measured within 0.95-1.06
    at 64-1024 ranks (docs/benchmarks-scale.md). ZeRO-0: not modelled (empty)."""
    part, p, g = t.part, t.p, t.g
    if zero_stage == 3:
        states = {"param partition": p * part, "grad partitions": g * part,
                  "fp32 master": 4.0 * part, "moments": 8.0 * part,
                  "persistent params": p * t.persistent}
        if t.offload_optimizer:
            states["fp32 grads (offload)"] = 4.0 * part
    elif zero_stage in (1, 2):
        states = {"model (flat)": p * t.psi, "grad partition": g * part,
                  "fp32 master": 4.0 * part, "moments": 8.0 * part}
    else:
        return {}
    states["ipg bucket"] = g * t.bucket  # allocated in initialize, resident from then on
    load = {**states, "optimizer file": 12.0 * part}
    if zero_stage == 3 and t.hpz:  # a resume loads before the first step: still there
        load[HPZ_TERM] = t.hpz
    if zero_stage in (1, 2):
        load["module state dict"] = p * t.psi
    return {"save": states, "load": load}


def _peak_of(phases: Phases, unpart: Set[str], offload_optimizer: bool,
             offload_params: bool) -> Dict[str, Any]:
    """The phase with the most bytes, split into device and host (offloaded terms)."""
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak = max(totals, key=totals.get)
    br = phases[peak]
    host_terms = set()
    if offload_optimizer:
        host_terms |= {"fp32 master", "moments", "fp32 grads (offload)", "fp32 grads"}
    if offload_params:
        host_terms |= {"param partition"}
    host = sum(v for k, v in br.items() if k in host_terms)
    return {
        "total": float(totals[peak]),
        "device": float(totals[peak] - host),
        "host": float(host),
        "peak_phase": peak,
        "phases": {k: float(v) for k, v in totals.items()},
        "breakdown": {k: float(v) for k, v in br.items()},
        "unpartitioned": float(sum(v for k, v in br.items() if k in unpart)),
    }
