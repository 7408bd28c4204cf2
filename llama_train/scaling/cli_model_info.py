"""``llama-plan model-info``: counts, model-state and activation memory, the per-rank peak with
DeepSpeed's estimator beside it and ``--gpu-mem`` advice, traffic and step time, and
``--recommend`` (:mod:`llama_train.scaling.memory`, :mod:`.traffic`, :mod:`.steptime`).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Sequence

from llama_train.scaling.cli_format import _gib, _si, _table
from llama_train.scaling.laws import ScalingError
from llama_train.scaling.memory import FIT_ORDER
from llama_train.scaling.memory import deepspeed_estimate, fit_advice, model_info, rank_peak_memory


# --json keys renamed without notice (issue 53 counted the model instead of building it on the
# meta device): still written, with the same values as what replaced them, until removed
DEPRECATED_KEYS = {
    "meta_param_count": "params.total (the count no longer needs a meta-device build)",
    "meta_build_seconds": "seconds model-info took to count the model from its shape (no model "
                          "is built since issue 53); no replacement key",
}


def _cmd_model_info(ns: argparse.Namespace) -> Dict[str, Any]:
    import time

    t0 = time.perf_counter()
    res = model_info(ns.model, zero_stage=ns.zero_stage, world_size=ns.world_size, micro_batch=ns.micro_batch,
                     seq_len=ns.seq_len, offload_optimizer=ns.offload_optimizer,
                     checkpointing=True if ns.activation_checkpointing else None, attention=ns.attention,
                     sequence_parallel=ns.sequence_parallel, loss_chunk_tokens=ns.loss_chunk_tokens)
    res["meta_param_count"] = res["params"]["total"]
    res["meta_build_seconds"] = time.perf_counter() - t0
    res["deprecated"] = dict(DEPRECATED_KEYS)
    if not ns.json:
        a, c = res["model_args"], res["params"]
        print(f"model {ns.model}: dim={a['dim']} n_layers={a['n_layers']} n_heads={a['n_heads']} "
              f"n_kv_heads={a['n_kv_heads'] or a['n_heads']} head_dim={a['head_dim']} ffn={a['ffn_hidden_dim']} vocab={a['vocab_size']}"
              f"{' tied' if a['tie_embeddings'] else ''}")
        print(_table([["total", f"{c['total']:,}", _si(c["total"])],
                      ["embedding", f"{c['embedding']:,}", _si(c["embedding"])],
                      ["non-embedding", f"{c['non_embedding']:,}", _si(c["non_embedding"])]],
                     ["parameters", "count", ""]))
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
        sp = f", {ns.sequence_parallel} ranks sharing each sequence" if ns.sequence_parallel > 1 else ""
        chunk = act["bf16"]["loss_chunk_tokens"]
        print(f"\nactivations per micro-batch per rank (b={ns.micro_batch}, s={res['seq_len']}{sp}, "
              f"checkpointing={'on' if act['bf16']['checkpointing'] else 'off'}, attention={ns.attention}, "
              f"loss {f'in chunks of {chunk} tokens' if chunk else 'over the whole logits'}):")
        rows = [[k] + [_gib(act[dt][k]) for dt in ("bf16", "fp32")] for k in ("per_layer", "layers", "recompute", "head", "total")]
        rows.append(["+ logits" + (" chunk" if chunk else " grad")]
                    + [_gib(act[dt]["backward_transient"]) for dt in ("bf16", "fp32")])
        print(_table(rows, ["", "bf16", "fp32"]))
        print(f"per GPU (model states + activations): bf16 {_gib(res['per_gpu_total']['bf16'])}, "
              f"fp32 {_gib(res['per_gpu_total']['fp32'])}")
    _peak_and_advice(ns, res)
    _traffic_and_step_time(ns, res)
    if ns.recommend:
        _recommend(ns, res)
    return res


def _time_options(ns: argparse.Namespace) -> Dict[str, Any]:
    from llama_train.scaling.steptime import DATASHEET_PEAK, MEASURED_MFU

    return dict(gpus_per_node=ns.gpus_per_node, intra_node_gbytes=ns.intra_node_gbps,
                inter_node_gbits=ns.inter_node_gbps,
                peak_flops=(ns.peak_tflops * 1e12 if ns.peak_tflops else DATASHEET_PEAK[ns.gpu]),
                mfu=ns.mfu if ns.mfu is not None else MEASURED_MFU[ns.efficiency],
                grad_accum=ns.grad_accum, zero_overrides=_ds_zero(ns.ds_zero) or None)


def _traffic_and_step_time(ns: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Planned bytes per collective kind and the step-time model (scaling.traffic, steptime):
    ``traffic_bytes_per_step`` and ``step_time_s`` (overlap, no_overlap) in --json."""
    from llama_train.scaling.steptime import step_time

    if ns.zero_stage == 0:
        return
    extra = {k: v for k, v in (("hpz_partition_size", ns.hpz_partition_size),
                                ("mics_shard_size", ns.mics_shard_size),
                                ("quantized_weights", ns.quantized_weights),
                                ("quantized_gradients", ns.quantized_gradients)) if v}
    t = step_time(ns.model, world_size=ns.world_size, zero_stage=ns.zero_stage,
                  micro_batch=ns.micro_batch, seq_len=ns.seq_len, dtype=ns.dtype,
                  checkpointing=bool(ns.activation_checkpointing),
                  sequence_parallel=ns.sequence_parallel, **_time_options(ns), **extra)
    res["traffic_bytes_per_step"] = t["traffic_bytes_per_step"]
    res["step_time_s"] = t["step_time_s"]
    res["step_time"] = t
    if ns.json:
        return
    st = t["settings"]
    print(f"\ntraffic and step time per rank ({ns.world_size} ranks, {st['gpus_per_node']} per node; "
          f"{st['intra_node_GBps']:g} GB/s within a node, {st['inter_node_Gbps']:g} Gb/s = "
          f"{st['inter_node_GBps']:g} GB/s per GPU between nodes; a model, see docs/scale-out.md):")
    rows = [[r["phase"], r["kind"], r["group_size"], _gib(r["bytes"]), f"{r['seconds'] * 1e3:.2f}",
             r["what"]] for r in t["collectives"]]
    print(_table(rows, ["phase", "collective", "ranks", "bytes", "ms", "what"]))
    print("per kind: " + ", ".join(f"{k} {_gib(v)}" for k, v in t["traffic_bytes_per_step"].items())
          + ("" if t["traffic_exact"] else " (MiCS/qwZ/qgZ: planned from DeepSpeed's design, "
             "not counted)"))
    print(f"compute {t['compute_s']:.3f} s ({t['tokens_per_rank']:,.0f} tokens at "
          f"{st['peak_flops'] / 1e12:g} TFLOP/s x MFU {st['mfu']:.3g}"
          f"{', x4/3 recomputation' if st['checkpointing'] else ''}), collectives "
          f"{t['comm_s']:.3f} s")
    print(f"step time: {t['step_time_s']['overlap']:.3f} s with full overlap, "
          f"{t['step_time_s']['no_overlap']:.3f} s with none -> MFU "
          f"{100 * t['mfu']['no_overlap']:.1f}-{100 * t['mfu']['overlap']:.1f}%, "
          f"{t['tokens_per_s_per_gpu']['no_overlap']:,.0f}-{t['tokens_per_s_per_gpu']['overlap']:,.0f} "
          f"tok/s per GPU")


def _recommend(ns: argparse.Namespace, res: Dict[str, Any]) -> None:
    """--recommend: ZeRO-2, ZeRO-3, hpZ, hpZ+qwZ+qgZ, MiCS, each with and without activation
    checkpointing: which fits --gpu-mem (default 80 GiB) and has the fastest predicted step."""
    from llama_train.scaling.steptime import recommend

    mem = (ns.gpu_mem if ns.gpu_mem is not None else 80.0) * 2**30
    opts = _time_options(ns)
    opts.pop("gpus_per_node")
    rec = recommend(ns.model, world_size=ns.world_size, gpu_mem_bytes=mem,
                    gpus_per_node=ns.gpus_per_node, micro_batch=ns.micro_batch,
                    seq_len=ns.seq_len, dtype=ns.dtype, sequence_parallel=ns.sequence_parallel,
                    **opts)
    res["recommend"] = rec
    if ns.json:
        return
    rows = [[r["choice"], "on" if r["checkpointing"] else "off", _gib(r["peak_bytes"]),
             "yes" if r["fits"] else "no", _gib(r["inter_node_bytes"]),
             f"{r['step_time_s']['overlap']:.3f}-{r['step_time_s']['no_overlap']:.3f}",
             f"{100 * r['mfu']['no_overlap']:.0f}-{100 * r['mfu']['overlap']:.0f}%"]
            for r in rec["rows"]]
    print(f"\nchoices for {ns.world_size} GPUs ({ns.gpus_per_node} per node), "
          f"{mem / 2**30:g} GiB each:")
    print(_table(rows, ["choice", "act. ckpt", "peak", "fits", "inter-node bytes", "step s",
                        "MFU"]))
    print(f"recommend: {rec['why']}")


def _ds_zero(items: Sequence[str]) -> Dict[str, int]:
    try:
        return {k: int(float(v)) for k, v in (kv.split("=", 1) for kv in items)}
    except ValueError:
        raise ScalingError(f"--ds-zero {list(items)}: use KEY=NUMBER, e.g. stage3_max_reuse_distance=0") from None


def _describe(c: Dict[str, Any]) -> str:
    bits = [f"ZeRO-{c['zero_stage']}", f"micro-batch {c['micro_batch']}"]
    if c.get("activation_checkpointing"):
        bits.append("activation checkpointing")
    if c.get("offload_optimizer"):
        bits.append("optimizer offload")
    if c.get("offload_params"):
        bits.append("param offload")
    return ", ".join(bits)


def _peak_and_advice(ns: argparse.Namespace, res: Dict[str, Any]) -> None:
    """The per-rank peak (rank_peak_memory), DeepSpeed's estimator beside it, and --gpu-mem advice."""
    cfg = dict(zero_stage=ns.zero_stage, world_size=ns.world_size, dtype=ns.dtype, micro_batch=ns.micro_batch,
               seq_len=ns.seq_len, offload_optimizer=ns.offload_optimizer, offload_params=ns.offload_params,
               activation_checkpointing=True if ns.activation_checkpointing else None, device=ns.device,
               attention=ns.attention, zero_overrides=_ds_zero(ns.ds_zero) or None,
               sequence_parallel=ns.sequence_parallel, loss_chunk_tokens=ns.loss_chunk_tokens)
    peak = rank_peak_memory(ns.model, **cfg)
    est = deepspeed_estimate(ns.model, ns.zero_stage, ns.world_size, ns.offload_optimizer, ns.offload_params)
    res["rank_peak"] = peak
    res["deepspeed_estimate"] = est
    if ns.gpu_mem is not None:
        res["fit"] = fit_advice(ns.model, ns.gpu_mem * 2**30, **cfg)
    if ns.json:
        return
    print(f"\nper-rank PEAK ({ns.dtype}, {ns.device} ranks, {_describe(cfg)}, {ns.world_size} rank(s)): "
          f"{_gib(peak['total'])} = {peak['bytes_per_param']:.2f} B/param, in phase '{peak['peak_phase']}'"
          + (f" (device {_gib(peak['device'])}, host {_gib(peak['host'])})" if peak["host"] else ""))
    print(_table([[k, _gib(v)] for k, v in peak["breakdown"].items() if v], ["peak-phase term", "bytes"]))
    print("phases: " + ", ".join(f"{k} {_gib(v)}" for k, v in peak["phases"].items()))
    if est["gpu"] is not None:
        print(f"DeepSpeed's estimator ({est['function'].rsplit('.', 1)[-1]}, buffer factor 1.5 on CPU): "
              f"{_gib(est['gpu'])} per GPU + {_gib(est['cpu'])} CPU per node; model states only, no "
              f"activations, buckets or the step's transients")
    else:
        print("DeepSpeed's estimator: none for ZeRO-0")
    fit = res.get("fit")
    if fit:
        where = "RAM per rank" if ns.device == "cpu" else "GPU memory"
        if fit["fits"]:
            print(f"fits: {_gib(fit['predicted'])} <= {ns.gpu_mem:g} GiB {where}")
        else:
            print(f"does not fit: {_gib(fit['predicted'])} > {ns.gpu_mem:g} GiB {where}")
            sug = fit["suggestion"]
            if sug:
                print(f"cheapest change that fits: {sug['change']} -> {_describe(sug['settings'])}: "
                      f"predicted peak {_gib(sug['predicted'])}")
            else:
                c = fit["closest"]
                print(f"no change in order ({', '.join(FIT_ORDER)}) fits; all of them: {_describe(c['settings'])}: "
                      f"{_gib(c['predicted'])}")
