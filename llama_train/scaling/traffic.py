"""Planned traffic: every collective one rank runs per optimizer step, from the model's shape.

Plain Python (no torch, no DeepSpeed): the figures are DeepSpeed 0.19.8's, found by counting
what a rank runs (:mod:`llama_train.comm.counting`: a simulated rank's ``MirrorGroup`` and a
real 2- and 4-rank gloo launch), then written down here term by term; ``tests/scaling/test_traffic.py``
checks the three agree byte for byte at ZeRO-1, 2 and 3, in fp32 and bf16, with gradient
accumulation and with sequence parallelism, and with ZeRO++'s hpZ (a simulated rank and
``tests/engine/test_zeropp.py``'s two-"node" launch).

Conventions (the counter's): the bytes of a collective are those of the whole buffer it is
about, ``S`` in the ring formulas (:mod:`llama_train.scaling.steptime`): an all-reduce's tensor,
an all-gather's output, a reduce-scatter's input, an all-to-all's input. Phases: ``forward``,
``backward`` (DeepSpeed's step between micro-batches included), ``step`` (after the last
backward: our loss all-reduce and DeepSpeed's optimizer step).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from llama_train.scaling.laws import ScalingError
from llama_train.scaling.memory import _check_dtype, _resolve_args, _zero_sizes, sequence_parallel_traffic

if TYPE_CHECKING:
    from llama_train.model.args import ModelArgs

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
PHASES = ("forward", "backward", "step")

# The scalar all-reduces of each step, measured (tests/scaling/test_traffic.py counts them):
LOSS_ALL_REDUCE = 3 * 8  # ours (TrainModule._all_ranks): loss sum, non-finite flag, stop flag, float64
# DeepSpeed's optimizer step: two scalars (gradient norm, overflow), fp32 at ZeRO-1/2, 8 bytes each
# at ZeRO-3; ZeRO-1/2 in bf16 add a one-byte flag
DS_STEP_SCALARS = {1: [4, 4], 2: [4, 4], 3: [8, 8]}
BF16_ZERO12_FLAG = 1
ZERO12_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: a flat group pads to 2 N elements
QUANT_GROUP = 2048  # elements per fp32 scale of ZeRO++'s int8/int4 blocks (an estimate: see below)

FORMULA = """\
Per rank and optimizer step; Psi params, N ranks (all of them: ZeRO partitions over the
sequence-parallel ranks too), p bytes/element of the model dtype (bf16 2, fp32 4; gradients and
their collectives in the same dtype), a = grad_accum micro-batches, pad_k(x) = ceil(x/k)*k.
  ZeRO-1: backward  all_reduce(N)  Psi*p          once (at the last micro-batch)
          step      all_gather(N)  sum over the 2 optimizer groups of pad_2N(group)*p
  ZeRO-2: backward  all_reduce(N)  a*Psi*p        every micro-batch (DeepSpeed's buckets, whole)
          step      all_gather(N)  as ZeRO-1
  ZeRO-3: forward   all_gather(N)  a*sum pad_N(numel)*p over non-persistent params
          backward  all_gather(N)  the same again (stage3_max_reuse_distance=0: all released)
          backward  reduce_scatter(N) a*sum pad_N(numel)*p over all params
          step      all_gather(N)  sum pad_N(numel)*p over persistent params (numel <= threshold)
  every stage, step: all_reduce(N) 24 B (our loss) + DeepSpeed's scalars (4+4 B at ZeRO-1/2,
          +1 B in bf16; 8+8 B at ZeRO-3)
  sequence parallel s: all_to_all(s) a * scaling.sequence_parallel_traffic bytes, forward and
          backward (and the recomputed forward with activation checkpointing)
  hpZ h (ZeRO-3; counted): the same bytes, W = sum pad_N(numel)*p over non-persistent params,
          but only the first micro-batch's forward gathers over N: releasing a parameter cuts
          its secondary partition (pad_N(numel)/h elements) and every later gather until the
          optimizer step drops it (DeepSpeed's invalidate_secondary_tensor) goes within h:
          forward all_gather(N) W, forward all_gather(h) (a-1)*W, backward all_gather(h) a*W;
          reduce-scatter and persistent all-gather over N as ZeRO-3
  MiCS m (planned from DeepSpeed's design, not counted: this DeepSpeed has no MiCS):
          all-gathers and reduce-scatter within m ranks, then an all_reduce over N/m replicas
          of the Psi/m gradient shard once per step
  qwZ (idem: no CPU quantizer): all-gathers of int8 weights, 1 B/element + a 4 B scale per
          2048 elements
  qgZ (idem): the reduce-scatter becomes int4 all-to-alls, within the node (Psi/2 B) then
          across nodes (Psi/(2G) B)"""


def _pad(x: int, k: int) -> int:
    return -(-x // k) * k


def _decays(name: str, ndim: int, decay_embeddings: bool, decay_norms: bool) -> bool:
    """:func:`llama_train.job.optim.decays` on a name and a rank (that module imports torch)."""
    is_embedding = name.startswith("tok_embeddings.")
    is_norm_or_bias = ndim < 2 or name.endswith(".bias") or "norm" in name.rsplit(".", 1)[0]
    return not ((is_embedding and not decay_embeddings) or (is_norm_or_bias and not decay_norms))


def optimizer_groups(args: "ModelArgs", decay_embeddings: bool = False,
                     decay_norms_and_biases: bool = False) -> List[int]:
    """Elements of our AdamW groups (:func:`llama_train.job.optim.param_groups`): decayed, then the
    rest (if any). ZeRO-1/2 flatten and partition each separately."""
    from llama_train.model.args import param_shapes

    decay = rest = 0
    for name, shape in param_shapes(args):
        n = math.prod(shape)
        if _decays(name, len(shape), decay_embeddings, decay_norms_and_biases):
            decay += n
        else:
            rest += n
    return [decay] + ([rest] if rest else [])


def _row(rows: List[Dict[str, Any]], phase: str, kind: str, group: int, nbytes: float,
         tensors: int, what: str, stride: int = 1) -> None:
    """One planned collective; ``stride``: its ranks' distance (1: consecutive ranks; MiCS's
    replica groups: the shard size), which places it on nodes (scaling.steptime)."""
    if group > 1 and nbytes:
        rows.append({"phase": phase, "kind": kind, "group_size": int(group),
                     "bytes": int(round(nbytes)), "tensors": int(tensors), "what": what,
                     "stride": int(stride)})


def planned_traffic(
    model: Union["ModelArgs", str, Path],
    *,
    world_size: int,
    zero_stage: int,
    dtype: str = "bf16",
    grad_accum: int = 1,
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    sequence_parallel: int = 1,
    checkpointing: Optional[bool] = None,
    ds: Optional[Any] = None,
    zero_overrides: Optional[Dict[str, int]] = None,
    decay_embeddings: bool = False,
    decay_norms_and_biases: bool = False,
    hpz_partition_size: Optional[int] = None,
    mics_shard_size: Optional[int] = None,
    quantized_weights: Optional[bool] = None,
    quantized_gradients: Optional[bool] = None,
    gpus_per_node: Optional[int] = None,
) -> Dict[str, Any]:
    """The collectives one rank of ``world_size`` runs per optimizer step (:data:`FORMULA`).

    ``ds`` is our :class:`llama_train.config.DeepSpeedConfig` (its persistence threshold and
    reuse distance; default: its defaults), ``zero_overrides`` as for
    :func:`llama_train.scaling.memory.rank_peak_memory`. DeepSpeed's bucket sizes split the
    collectives into calls but do not change their bytes, so only ZeRO-3's persistence
    threshold (which parameters are never gathered) enters the bytes. ``hpz_partition_size``,
    ``mics_shard_size``, ``quantized_weights`` and ``quantized_gradients`` (ZeRO++ and MiCS,
    ZeRO-3 only; default: ``ds.zeropp`` and ``ds.mics_shard_size``, else off): hpZ is counted
    (exact); MiCS, qwZ and qgZ are planned from DeepSpeed's design, not counted (``exact`` is
    then False); ``gpus_per_node`` places qgZ's two all-to-alls.

    Returns ``collectives`` (rows: phase, kind, group_size, bytes, tensors, what),
    ``bytes_per_kind``, ``bytes_per_phase``, ``total_bytes``, ``exact`` and the settings."""
    args = _resolve_args(model)
    p = _check_dtype(dtype)
    n, a, sp = _check_ranks(zero_stage, world_size, grad_accum, sequence_parallel)
    h, m, quantized_weights, quantized_gradients, exact = _check_zeropp(
        zero_stage, n, ds, hpz_partition_size, mics_shard_size, quantized_weights,
        quantized_gradients)
    g_node = int(gpus_per_node or n)
    from llama_train.model.args import count_params

    psi = count_params(args)["total"]
    rows: List[Dict[str, Any]] = []
    if zero_stage in (1, 2):
        scalars = _zero12_rows(rows, args, psi, n, a, p, zero_stage, dtype, decay_embeddings,
                               decay_norms_and_biases)
    else:
        scalars = _zero3_rows(rows, args, n, a, p, h, m, quantized_weights, quantized_gradients,
                              g_node, ds, zero_overrides)
    _row(rows, "step", "all_reduce", n, LOSS_ALL_REDUCE + sum(scalars), 1 + len(scalars),
         "the loss, non-finite and stop flags (ours); DeepSpeed's norm and overflow scalars")
    if sp > 1:
        _sequence_rows(rows, args, a, sp, micro_batch, seq_len, dtype, checkpointing)
    return {
        "collectives": rows,
        "bytes_per_kind": bytes_per(rows, "kind"),
        "bytes_per_phase": bytes_per(rows, "phase"),
        "total_bytes": sum(r["bytes"] for r in rows),
        "exact": exact,
        "n_params": psi, "world_size": n, "zero_stage": zero_stage, "dtype": dtype,
        "grad_accum": a, "sequence_parallel": sp, "hpz_partition_size": h,
        "mics_shard_size": m, "quantized_weights": bool(quantized_weights),
        "quantized_gradients": bool(quantized_gradients), "formula": FORMULA,
    }


def _check_ranks(zero_stage: int, world_size: int, grad_accum: int,
                 sequence_parallel: int) -> Tuple[int, int, int]:
    """planned_traffic's stage and rank-count checks, apart: (world_size, grad_accum, sp) ints."""
    n, a, sp = int(world_size), int(grad_accum), int(sequence_parallel)
    if zero_stage not in (1, 2, 3):
        raise ScalingError(f"zero_stage={zero_stage!r}: traffic is planned for ZeRO 1, 2 and 3")
    if n < 1 or a < 1 or sp < 1 or n % sp:
        raise ScalingError(f"world_size={world_size}, grad_accum={grad_accum}, sequence_parallel="
                           f"{sequence_parallel}: positive integers, sequence_parallel dividing "
                           f"world_size")
    return n, a, sp


def _check_zeropp(zero_stage: int, n: int, ds: Optional[Any], hpz_partition_size: Optional[int],
                  mics_shard_size: Optional[int], quantized_weights: Optional[bool],
                  quantized_gradients: Optional[bool]) -> Tuple[int, int, bool, bool, bool]:
    """planned_traffic's ZeRO++/MiCS settings checked, apart: (h, m, qwZ, qgZ, exact)."""
    h, m, quantized_weights, quantized_gradients = _zeropp_settings(
        ds, hpz_partition_size, mics_shard_size, quantized_weights, quantized_gradients)
    extras = h > 1 or m > 0 or quantized_weights or quantized_gradients
    # counted: ZeRO-1/2/3, sequence parallelism, hpZ; planned from the design: MiCS, qwZ, qgZ
    exact = not (m > 0 or quantized_weights or quantized_gradients)
    if extras and zero_stage != 3:
        raise ScalingError("hpZ, MiCS, qwZ and qgZ partition ZeRO-3's weights: zero_stage=3")
    for name, size in (("hpz_partition_size", h), ("mics_shard_size", m or 1)):
        if size < 1 or n % size:
            raise ScalingError(f"{name}={size} must divide world_size={n}")
    if h > 1 and m:
        raise ScalingError("hpZ and MiCS are alternatives: give one of hpz_partition_size, "
                           "mics_shard_size")
    return h, m, quantized_weights, quantized_gradients, exact


def _zeropp_settings(ds: Optional[Any], hpz_partition_size: Optional[int],
                     mics_shard_size: Optional[int], quantized_weights: Optional[bool],
                     quantized_gradients: Optional[bool]) -> Tuple[int, int, bool, bool]:
    """(hpZ size, MiCS size, qwZ, qgZ): as given, else ``ds``'s (``ds.zeropp``,
    ``ds.mics_shard_size``), else off."""
    zeropp = getattr(ds, "zeropp", None)
    if hpz_partition_size is None:
        hpz_partition_size = getattr(zeropp, "hpz_partition_size", 1)
    if mics_shard_size is None:
        mics_shard_size = getattr(ds, "mics_shard_size", 0)
    if quantized_weights is None:
        quantized_weights = bool(getattr(zeropp, "quantized_weights", False))
    if quantized_gradients is None:
        quantized_gradients = bool(getattr(zeropp, "quantized_gradients", False))
    return (int(hpz_partition_size or 1), int(mics_shard_size or 0), quantized_weights,
            quantized_gradients)


def _zero12_rows(rows: List[Dict[str, Any]], args: "ModelArgs", psi: int, n: int, a: int,
                 p: float, zero_stage: int, dtype: str, decay_embeddings: bool,
                 decay_norms_and_biases: bool) -> List[int]:
    """ZeRO-1/2's collectives into ``rows``; returns DeepSpeed's step scalars (bytes)."""
    every = a if zero_stage == 2 else 1
    _row(rows, "backward", "all_reduce", n, every * psi * p, every,
         "gradients, whole, in reduce buckets" + (" every micro-batch" if every > 1 else ""))
    groups = optimizer_groups(args, decay_embeddings, decay_norms_and_biases)
    _row(rows, "step", "all_gather", n,
         sum(_pad(k, ZERO12_ALIGNMENT * n) for k in groups) * p, len(groups),
         f"updated weights: each optimizer group's flat buffer padded to "
         f"{ZERO12_ALIGNMENT}N elements")
    return DS_STEP_SCALARS[zero_stage] + ([BF16_ZERO12_FLAG] if dtype == "bf16" else [])


def _zero3_rows(rows: List[Dict[str, Any]], args: "ModelArgs", n: int, a: int, p: float, h: int,
                m: int, quantized_weights: bool, quantized_gradients: bool, g_node: int,
                ds: Optional[Any], zero_overrides: Optional[Dict[str, int]]) -> List[int]:
    """ZeRO-3's collectives (with hpZ, MiCS, qwZ, qgZ) into ``rows``; returns DeepSpeed's step
    scalars (bytes)."""
    from llama_train.model.args import param_shapes

    sizes = _zero_sizes(args, ds, zero_overrides)
    threshold = sizes["stage3_param_persistence_threshold"]
    shard = m or n  # MiCS partitions within m ranks, ZeRO-3 within all
    numels = [math.prod(shape) for _, shape in param_shapes(args)]
    gathered = [k for k in numels if k > threshold]
    kept = [k for k in numels if k <= threshold]
    gathered_elems = sum(_pad(k, shard) for k in gathered)
    w_bytes = (gathered_elems * (1 + 4 / QUANT_GROUP) if quantized_weights
               else gathered_elems * p)
    tag = " (int8 + scales)" if quantized_weights else ""
    if h > 1:
        # hpZ: a released parameter keeps a secondary partition within its h ranks until
        # the optimizer step drops it, so only the first micro-batch's forward gathers
        # over all N; the later forwards and every backward gather the same bytes within h
        _row(rows, "forward", "all_gather", shard, w_bytes, len(gathered),
             f"non-persistent weights, each padded to a multiple of {shard}{tag}: the "
             f"first micro-batch (hpZ's secondary partition is cut as each is released)")
        _row(rows, "forward", "all_gather", h, (a - 1) * w_bytes, (a - 1) * len(gathered),
             f"the later micro-batches' forwards, from hpZ's secondary partition within "
             f"{h} ranks")
    else:
        _row(rows, "forward", "all_gather", shard, a * w_bytes, a * len(gathered),
             f"non-persistent weights, each padded to a multiple of {shard}{tag}")
    _row(rows, "backward", "all_gather", h if h > 1 else shard, a * w_bytes,
         a * len(gathered),
         "the same again for the backward" + (f", from hpZ's secondary partition within "
                                               f"{h} ranks" if h > 1 else ""))
    grad_elems = sum(_pad(k, shard) for k in numels)
    if quantized_gradients:
        intra = min(g_node, shard)
        q = grad_elems * (0.5 + 4 / QUANT_GROUP)
        _row(rows, "backward", "all_to_all", intra, a * q, a * len(numels),
             "qgZ: int4 gradients exchanged within the node")
        _row(rows, "backward", "all_to_all", shard // intra, a * q / intra, a * len(numels),
             "qgZ: the node's reduced 1/G exchanged across nodes", stride=intra)
    else:
        _row(rows, "backward", "reduce_scatter", shard, a * grad_elems * p, a * len(numels),
             f"gradients, every parameter padded to a multiple of {shard}")
    if m:
        _row(rows, "step", "all_reduce", n // m, grad_elems / m * p, 1,
             f"MiCS: the gradient shard averaged over the {n // m} replicas", stride=m)
    _row(rows, "step", "all_gather", shard, sum(_pad(k, shard) for k in kept) * p,
         len(kept), f"updated persistent weights (numel <= {threshold})")
    return DS_STEP_SCALARS[3]


def _sequence_rows(rows: List[Dict[str, Any]], args: "ModelArgs", a: int, sp: int,
                   micro_batch: int, seq_len: Optional[int], dtype: str,
                   checkpointing: Optional[bool]) -> None:
    """DeepSpeed-Ulysses' all-to-alls (:func:`sequence_parallel_traffic`) into ``rows``."""
    t = sequence_parallel_traffic(args, micro_batch=micro_batch, seq_len=seq_len,
                                  sequence_parallel=sp, dtype=dtype,
                                  checkpointing=checkpointing)
    per_pass = t["bytes"] / t["passes"]
    _row(rows, "forward", "all_to_all", sp, a * per_pass, a * t["calls"] // t["passes"],
         "Ulysses: q, k, v and the attention output of every layer")
    _row(rows, "backward", "all_to_all", sp, a * per_pass * (t["passes"] - 1),
         a * t["calls"] * (t["passes"] - 1) // t["passes"],
         "their gradients" + (" and the recomputed forward's" if t["passes"] == 3 else ""))


def bytes_per(rows: List[Dict[str, Any]], key: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for r in rows:
        out[r[key]] = out.get(r[key], 0) + int(r["bytes"])
    return out


def by_key(rows: List[Dict[str, Any]]) -> Dict[tuple, int]:
    """(phase, kind, group_size) -> bytes: how planned and counted traffic are compared."""
    out: Dict[tuple, int] = {}
    for r in rows:
        k = (r["phase"], r["kind"], int(r["group_size"]))
        out[k] = out.get(k, 0) + int(r["bytes"])
    return out
