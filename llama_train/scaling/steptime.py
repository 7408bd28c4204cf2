"""A step-time model, stated as one: compute from a peak and an efficiency, each collective of
:func:`llama_train.scaling.traffic.planned_traffic` from the ring formulas, and the step with
full and with no overlap of the two.

Plain Python. Its input, the bytes of every collective, is exact (``tests/scaling/test_traffic.py``);
the times are not checked: a gloo benchmark of 2 and 4 ranks against the formulas with the
bandwidth ``llama-bench allreduce`` measures (``tests/scaling/test_steptime.py`` ``gloo_check``) varied
3-10x between runs on a loaded 2-core host, and NVLink, InfiniBand, NCCL's algorithms, the
hierarchical placement and how much traffic overlaps compute cannot be measured here at all (the
truth lies between the two step times printed; docs/scale-out.md).

Units: bandwidths in bytes per second inside; on the command line the intra-node bandwidth is
given in GB/s (gigaBYTES, as NVLink is quoted: 900 GB/s per H100/H200) and the inter-node one
in Gb/s (gigaBITS, as NICs are quoted: 400 Gb/s = 50 GB/s per GPU).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from llama_train.scaling.laws import ScalingError
from llama_train.scaling.memory import _resolve_args
from llama_train.scaling.traffic import planned_traffic

if TYPE_CHECKING:
    from llama_train.model.args import ModelArgs

# Dense bf16 datasheet peaks, FLOP/s per GPU: llama_train.engine.flops' table (which needs torch
# and a device to read; tests/scaling/test_steptime.py checks the two agree)
DATASHEET_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                  "A10": 125e12, "4090": 165e12, "V100": 125e12}
# The MFU the GPU check measured (docs/benchmarks-gpu.md, ~1B model, 1 x H200, seq 2048)
MEASURED_MFU = {"eager": 0.407, "compiled": 0.519}
NVLINK_GBYTES = 900.0  # GB/s per GPU (H100/H200 NVLink 4, both directions together)
NETWORK_GBITS = 400.0  # Gb/s per GPU (one 400G NIC per GPU, InfiniBand NDR or RoCE)
RECOMPUTE = 4 / 3  # activation checkpointing: one more forward (2 of the 6 FLOPs per param)


def ring_time(kind: str, nbytes: float, group: int, per_node: int, intra_bps: float,
              inter_bps: float) -> float:
    """Seconds one collective of ``nbytes`` (the whole buffer, S) takes in a group of ``group``
    ranks, ``per_node`` of them on each node (bandwidths in bytes/s per GPU):

    * all-gather, reduce-scatter: (n-1)/n * S / B on one node; across k = n/l nodes,
      hierarchically: (l-1)/l * S / B_intra within the node, then (k-1)/k * S / (l B_inter)
      across nodes (each of the node's l GPUs moves its 1/l of the buffer on its own NIC);
    * all-reduce: twice that (a reduce-scatter, then an all-gather): 2(n-1)/n * S / B in a node;
    * all-to-all: (l-1)/n of S within the node over NVLink, (n-l)/n of it across over the NIC,
      one after the other;
    * broadcast: S / B (pipelined), B the slowest link the group spans."""
    n, lo = int(group), max(1, min(int(per_node), int(group)))
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = n // lo
    if kind in ("all_gather", "reduce_scatter", "all_reduce"):
        t = (lo - 1) / lo * nbytes / intra_bps + (k - 1) / k * nbytes / (lo * inter_bps)
        return 2 * t if kind == "all_reduce" else t
    if kind == "all_to_all":
        return (lo - 1) / n * nbytes / intra_bps + (n - lo) / n * nbytes / inter_bps
    return nbytes / (inter_bps if k > 1 else intra_bps)


def members_per_node(row: Dict[str, Any], gpus_per_node: int) -> int:
    """How many of a collective's ranks share a node, ranks numbered node by node: groups of
    consecutive ranks (the world, hpZ's and MiCS's shard groups, sequence groups) fill nodes;
    a group of ranks ``stride`` apart (MiCS's replicas) has max(1, G / stride) per node."""
    stride = int(row.get("stride", 1))
    g = int(row["group_size"])
    return max(1, min(g, gpus_per_node // stride if stride > 1 else gpus_per_node))


def step_time(
    model: Union["ModelArgs", str, Path],
    *,
    world_size: int,
    zero_stage: int,
    gpus_per_node: int = 8,
    intra_node_gbytes: float = NVLINK_GBYTES,
    inter_node_gbits: float = NETWORK_GBITS,
    peak_flops: float = DATASHEET_PEAK["H100"],
    mfu: float = MEASURED_MFU["eager"],
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    grad_accum: int = 1,
    checkpointing: bool = False,
    dtype: str = "bf16",
    sequence_parallel: int = 1,
    **traffic_options: Any,
) -> Dict[str, Any]:
    """One optimizer step of one rank: compute seconds (model FLOPs of its tokens / (peak x
    mfu), x 4/3 with activation checkpointing), each planned collective's seconds
    (:func:`ring_time`), the step with full overlap (the larger of the two) and with none (their
    sum), and the MFU each gives. ``traffic_options`` go to
    :func:`~llama_train.scaling.traffic.planned_traffic` (hpZ, MiCS, quantization, ``ds``)."""
    from llama_train.model.args import flops_per_token

    args = _resolve_args(model)
    s = args.max_seq_len if seq_len is None else int(seq_len)
    if not (gpus_per_node >= 1 and intra_node_gbytes > 0 and inter_node_gbits > 0
            and peak_flops > 0 and 0 < mfu <= 1):
        raise ScalingError("gpus_per_node >= 1, bandwidths and peak > 0, 0 < mfu <= 1")
    if world_size > gpus_per_node and world_size % gpus_per_node:
        raise ScalingError(f"world_size={world_size} fills no whole nodes of gpus_per_node="
                           f"{gpus_per_node}")
    plan = planned_traffic(args, world_size=world_size, zero_stage=zero_stage, dtype=dtype,
                           grad_accum=grad_accum, micro_batch=micro_batch, seq_len=s,
                           sequence_parallel=sequence_parallel, checkpointing=checkpointing,
                           gpus_per_node=gpus_per_node, **traffic_options)
    intra, inter = intra_node_gbytes * 1e9, inter_node_gbits * 1e9 / 8
    # tokens one rank computes per step: its share of micro_batch x seq_len x grad_accum per
    # data-parallel rank (sequence parallel ranks split each sequence)
    tokens = micro_batch * s * grad_accum / sequence_parallel
    model_flops = flops_per_token(args, s) * tokens
    compute = model_flops * (RECOMPUTE if checkpointing else 1.0) / (peak_flops * mfu)
    rows: List[Dict[str, Any]] = []
    for r in plan["collectives"]:
        lo = members_per_node(r, gpus_per_node)
        rows.append({**r, "per_node": lo,
                     "seconds": ring_time(r["kind"], r["bytes"], r["group_size"], lo, intra,
                                          inter)})
    comm = sum(r["seconds"] for r in rows)
    overlap, no_overlap = max(compute, comm), compute + comm
    return {
        "compute_s": compute, "comm_s": comm,
        "step_time_s": {"overlap": overlap, "no_overlap": no_overlap},
        "mfu": {"overlap": model_flops / (overlap * peak_flops),
                "no_overlap": model_flops / (no_overlap * peak_flops)},
        "tokens_per_s_per_gpu": {"overlap": tokens / overlap, "no_overlap": tokens / no_overlap},
        "collectives": rows, "traffic_bytes_per_step": plan["bytes_per_kind"],
        "traffic_exact": plan["exact"], "model_flops": model_flops, "tokens_per_rank": tokens,
        "settings": {"world_size": world_size, "gpus_per_node": gpus_per_node,
                     "intra_node_GBps": intra_node_gbytes,
                     "inter_node_Gbps": inter_node_gbits, "inter_node_GBps": inter / 1e9,
                     "peak_flops": peak_flops, "mfu": mfu, "zero_stage": zero_stage,
                     "checkpointing": bool(checkpointing), "micro_batch": micro_batch,
                     "seq_len": s, "grad_accum": grad_accum, "dtype": dtype,
                     **{k: v for k, v in traffic_options.items() if k != "ds"}},
    }


# -- --recommend --------------------------------------------------------------------------------
def choices(gpus_per_node: int, world_size: int) -> Dict[str, Dict[str, Any]]:
    """The layouts ``--recommend`` weighs: ZeRO-2, ZeRO-3, and ZeRO-3 with hpZ (a secondary
    weight partition in each node), hpZ + qwZ + qgZ, MiCS (shards within a node)."""
    g = min(gpus_per_node, world_size)
    out: Dict[str, Dict[str, Any]] = {"ZeRO-2": {"zero_stage": 2}, "ZeRO-3": {"zero_stage": 3}}
    if world_size > gpus_per_node:  # with one node, hpZ and MiCS equal ZeRO-3
        out["hpZ"] = {"zero_stage": 3, "hpz_partition_size": g}
        out["hpZ+qwZ+qgZ"] = {"zero_stage": 3, "hpz_partition_size": g,
                              "quantized_weights": True, "quantized_gradients": True}
        out["MiCS"] = {"zero_stage": 3, "mics_shard_size": g}
    return out


def _peak_bytes(model, choice: Dict[str, Any], checkpointing: bool, **kw: Any) -> float:
    """The planner's per-rank peak (:func:`llama_train.scaling.memory.rank_peak_memory`), with
    hpZ's and MiCS's sizes where it takes them."""
    from llama_train.scaling.memory import rank_peak_memory

    accepted = inspect.signature(rank_peak_memory).parameters
    extra = {k: choice[k] for k in ("hpz_partition_size", "mics_shard_size")
             if k in choice and k in accepted}
    return rank_peak_memory(model, zero_stage=choice["zero_stage"],
                            activation_checkpointing=checkpointing, **extra, **kw)["total"]


def recommend(model: Union["ModelArgs", str, Path], *, world_size: int, gpu_mem_bytes: float,
              gpus_per_node: int = 8, micro_batch: int = 1, seq_len: Optional[int] = None,
              dtype: str = "bf16", sequence_parallel: int = 1, **time_options: Any
              ) -> Dict[str, Any]:
    """Each choice (:func:`choices`) with and without activation checkpointing: the planner's
    peak memory, whether it fits ``gpu_mem_bytes``, the step time with and without overlap;
    ``best``: the fitting one with the shortest step (no overlap: the pessimistic figure,
    which is where the layouts differ), ties to the less exotic (listed first)."""
    rows = []
    for name, choice in choices(gpus_per_node, world_size).items():
        for ckpt in (False, True):
            peak = _peak_bytes(model, choice, ckpt, world_size=world_size, dtype=dtype,
                               micro_batch=micro_batch, seq_len=seq_len,
                               sequence_parallel=sequence_parallel)
            t = step_time(model, world_size=world_size, gpus_per_node=gpus_per_node,
                          micro_batch=micro_batch, seq_len=seq_len, dtype=dtype,
                          checkpointing=ckpt, sequence_parallel=sequence_parallel,
                          **choice, **time_options)
            rows.append({"choice": name, "checkpointing": ckpt, "settings": choice,
                         "peak_bytes": peak, "fits": peak <= gpu_mem_bytes,
                         "step_time_s": t["step_time_s"], "mfu": t["mfu"],
                         "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"],
                         "traffic_bytes_per_step": t["traffic_bytes_per_step"],
                         "inter_node_bytes": sum(r["bytes"] for r in t["collectives"]
                                                 if r["group_size"] > r["per_node"]),
                         "exact_traffic": t["traffic_exact"]})
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["step_time_s"]["no_overlap"]) if fitting else None
    return {"rows": rows, "best": best, "why": _why(best, rows, gpu_mem_bytes)}


def _why(best: Optional[Dict[str, Any]], rows: List[Dict[str, Any]], limit: float) -> str:
    gib = 2 ** 30
    if best is None:
        low = min(rows, key=lambda r: r["peak_bytes"])
        return (f"nothing fits {limit / gib:.0f} GiB per GPU: the smallest peak is "
                f"{low['choice']}{' + checkpointing' if low['checkpointing'] else ''} at "
                f"{low['peak_bytes'] / gib:.1f} GiB; use more GPUs, a shorter sequence or "
                f"sequence parallelism")
    ck = " with activation checkpointing" if best["checkpointing"] else ""
    out = [f"{best['choice']}{ck}: fits ({best['peak_bytes'] / gib:.1f} GiB <= "
           f"{limit / gib:.0f} GiB) and has the shortest predicted step "
           f"({best['step_time_s']['overlap']:.3g}-{best['step_time_s']['no_overlap']:.3g} s, MFU "
           f"{100 * best['mfu']['no_overlap']:.0f}-{100 * best['mfu']['overlap']:.0f}%)"]
    faster = [r for r in rows if not r["fits"]
              and r["step_time_s"]["no_overlap"] < best["step_time_s"]["no_overlap"]]
    if faster:
        f = min(faster, key=lambda r: r["step_time_s"]["no_overlap"])
        out.append(f"{f['choice']}{' + checkpointing' if f['checkpointing'] else ''} would be "
                   f"faster but needs {f['peak_bytes'] / gib:.1f} GiB")
    if not best["exact_traffic"]:
        out.append("its traffic (MiCS/qwZ/qgZ) is planned from DeepSpeed's design, not "
                   "counted on this code path")
    return "; ".join(out)
