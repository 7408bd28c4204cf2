"""``llama-plan``: the command line of :mod:`llama_train.scaling` (compute-optimal,
inference-optimal, model-info, shape, fit), with its tables and SI formatting."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from llama_train.scaling.approach2 import DEFAULT_WINDOW as WINDOW
from llama_train.scaling.laws import FITS, ScalingError
from llama_train.scaling.memory import FIT_ORDER
from llama_train.scaling.memory import _args_dict, deepspeed_estimate, fit_advice, model_info, rank_peak_memory
from llama_train.scaling.planners import compute_optimal, inference_optimal, shape_for_params
from llama_train.scaling.runs import REPEAT_HALF_LIFE
from llama_train.util import jsonable
from llama_train.bounds import SEED_MAX, Range, check_options


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
    _other_default(ns, res, "inference-optimal", ns.flops)
    return res


# Each subcommand's default loss law (--fit). They differ, so the compute-optimal model of one
# budget differs between them (1.82B vs 2.28B params at 3e20 FLOPs was seen); each output names
# the other's default and what it gives, so two tables are never compared unawares.
DEFAULT_FIT = {"compute-optimal": "chinchilla", "inference-optimal": "sardana"}


def _other_default(ns: argparse.Namespace, res: Dict[str, Any], other: str,
                   flops: Optional[float]) -> None:
    fit = DEFAULT_FIT[other]
    if flops is None or ns.fit == fit:
        return
    alt = compute_optimal(flops, fit)
    res["other_default_fit"] = {"command": f"llama-plan {other}", "fit": fit,
                                "n_params": alt["n_params"], "n_tokens": alt["n_tokens"],
                                "loss": alt["loss"]}
    if not ns.json:
        print(f"note: `llama-plan {other}` defaults to --fit {fit}; with it the compute-optimal "
              f"model of {flops:.3g} FLOPs is {_si(alt['n_params'])} params x "
              f"{_si(alt['n_tokens'])} tokens (pred. loss {alt['loss']:.4f}). Pass the same --fit "
              f"to both to compare them.")


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
    _other_default(ns, res, "compute-optimal", ns.flops)
    return res


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
          + ("" if t["traffic_exact"] else " (hpZ/MiCS/qwZ/qgZ: planned from DeepSpeed's design, "
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


def _fit_each(ns: argparse.Namespace, path: Path, conventions, repro: str):
    """analyse_runs for each parameter convention: (analyses, reports, extra outputs)."""
    from llama_train.scaling.fit import analyse_runs
    from llama_train.scaling.plots import plot_isoflops
    from llama_train.scaling.runs import load_runs, write_runs_csv

    analyses, reports, extra = {}, {}, {}
    for i, conv in enumerate(conventions):
        runs, skipped = load_runs(path, params=conv)
        if ns.min_flops:
            def budget(r):  # the nominal budget it was planned on, else its own FLOPs
                return r.budget if r.budget is not None else r.flops
            skipped += [{"run": r.run, "reason": f"budget {budget(r):g} < --min-flops {ns.min_flops:g}"}
                        for r in runs if budget(r) < ns.min_flops]
            runs = [r for r in runs if budget(r) >= ns.min_flops]
        for r in runs:
            r.repeat_half_life = ns.repeat_half_life
        if i == 0 and ns.csv:  # before any check, so a sweep too small to fit can still be exported
            extra["csv"] = str(write_runs_csv(runs, ns.csv, params=conv))
        if len(runs) < 5:
            raise ScalingError(
                f"fit: {len(runs)} usable run(s) under {path} with {conv} params (need >= 5: run dirs with "
                f"metrics.jsonl holding a val_loss and run_info.json, or CSV rows); skipped: {skipped[:5]}")
        an = analyse_runs(runs, params=conv, top_k=ns.top_k, bootstrap=ns.bootstrap, bootstrap_a3=ns.bootstrap_a3,
                          bootstrap_top_k=ns.bootstrap_top_k, seed=ns.seed, window=ns.window,
                          name=(path.stem if path.is_file() else path.name) or "fitted")
        rep = {**an.to_dict(), "source": str(path), "runs": [vars(r) for r in runs], "skipped": skipped,
               "command": repro}
        if ns.out:
            out = Path(ns.out) if i == 0 else Path(ns.out).with_name(f"{Path(ns.out).stem}.{conv}{Path(ns.out).suffix}")
            rep["plot"] = str(plot_isoflops(runs, an.approach3.law if an.approach3 else None, out, an.approach2,
                                            approach3_ci=an.approach3_bootstrap, params=conv))
        analyses[conv], reports[conv] = an, rep
    return analyses, reports, extra


def _ci(v, fmt="{:.4g}"):
    return f"[{fmt.format(v[0])}, {fmt.format(v[1])}]" if v else "n/a"


def _boot_line(b, what):
    if b is None:
        return f"  bootstrap: off ({what} 0)"
    why = ", ".join(f"{k} {v}" for k, v in sorted(b.failures.items()))
    return (f"  bootstrap: {b.n_resamples} resamples of the runs within each budget, seed {b.seed}; "
            f"{b.n_failed} failed{f' ({why})' if why else ''}; intervals are the 2.5/97.5 percentiles of the "
            f"{b.n_resamples - b.n_failed} others" + ("" if b.ci else " (none: fewer than 10 succeeded)")
            + ("\n  WARNING: over 10% of the resamples failed; the interval covers only those that did, so it is "
               "too narrow (a budget with few runs or sizes is the usual cause: sample more sizes)"
               if b.n_failed > 0.1 * b.n_resamples else ""))


def _noise_line(nm) -> str:
    """Approach 3's misses against the seeds' spread: which one limits its intervals."""
    per = ", ".join(f"{c:.3g} {100 * m:+.1f}%" for c, m in nm.budget_residual)
    if nm.seed_sd is None:
        seeds = "no point was run with two seeds, so the seeds' share of it is unknown"
    else:
        seeds = (f"one run's seed sd {nm.seed_sd:.4f} (pooled over {nm.repeated_points} points run with 2+ seeds, "
                 f"{nm.dof} dof)" + ("; the law misses by more than the seeds differ there: more seeds at those points "
                                     "narrow its intervals little" if nm.rms_residual > 2 * nm.seed_sd else ""))
    return f"  misfit: rms log residual {nm.rms_residual:.4f}, mean per budget (law over runs) {per}; {seeds}"


def _print_analysis(an, rep: Dict[str, Any], path: Path, conv: str, several: bool,
                    ns: argparse.Namespace) -> None:
    """One parameter convention's fits as tables (llama-plan fit without --json)."""
    from llama_train.scaling.approach2 import FLAG_TEXT, REFUSALS

    a2, a3, law = an.approach2, an.approach3, an.approach3.law if an.approach3 else None
    if several:
        print(f"=== N = {conv} parameters ===")
    print(f"{len(an.runs)} runs from {path} (N = {conv} parameters), {len(an.groups)} IsoFLOP budget(s)")
    rows = []
    for p in a2.parabolas:
        n3 = law.optimal(p.flops) if law else None
        rows.append([f"{p.flops:.3g}", p.n_runs, f"{_si(p.n_min)}-{_si(p.n_max)}",
                     _si(p.n_opt) if p.n_opt else "-", f"[{_si(p.n_opt_ci[0])}, {_si(p.n_opt_ci[1])}]" if p.n_opt_ci else "-",
                     f"{p.loss_at_min:.4f}" if p.loss_at_min is not None else "-",
                     _si(n3[0]) if n3 else "-", f"{law.loss(*n3):.4f}" if n3 else "-",
                     "yes" if p.used else "NO", ", ".join(p.flags) or "-"])
    print(_table(rows, ["budget (FLOPs)", "runs", "N range", "A2 N_opt", "95% CI", "A2 loss@min",
                        "A3 N_opt", "A3 loss", "used", "flags"]))
    flags = sorted({f for p in a2.parabolas for f in p.flags})
    for f in flags:
        print(f"  {f}: {FLAG_TEXT[f]}" + (" (budget not used by Approach 2)" if f in REFUSALS else " (warning)"))
    near = f" over the runs within {ns.window} sizes of its best" if ns.window is not None else ""
    print(f"Approach 2 (Hoffmann et al. Sec. 3.2: parabola of loss in ln N per budget{near}, power laws over "
          f"{len(a2.used)} of {len(a2.parabolas)} budgets):")
    if a2.n_opt_law:
        bci = a2.bootstrap.ci if a2.bootstrap else {}
        print(f"  N_opt = k_N C^a: a = {a2.n_opt_law.exponent:.4f}  95% CI {_ci(bci.get('a'), '{:.4f}')}  "
              f"k_N = {a2.n_opt_law.k:.4g}")
        print(f"  D_opt = k_D C^b: b = {a2.d_opt_law.exponent:.4f}  95% CI {_ci(bci.get('b'), '{:.4f}')}  "
              f"k_D = {a2.d_opt_law.k:.4g}  (D_opt = C/(6 N_opt), so b = 1 - a)")
        print(_boot_line(a2.bootstrap, "--bootstrap"))
    else:
        print(f"  no power law: {a2.error}")
    if law:
        bci = an.approach3_bootstrap.ci if an.approach3_bootstrap else {}
        print(f"Approach 3 (App. D.2): L(N,D) = E + A/N^alpha + B/D^beta on {a3.n_points} runs, Huber "
              f"delta={a3.delta:g} on log loss, best of {a3.n_starts} L-BFGS starts; rms log residual "
              f"{a3.rms_log_residual:.4f}; repeated tokens discounted with R*={an.runs[0].repeat_half_life:g}"
              f" ({sum(r.effective_tokens < r.tokens for r in an.runs)} runs read their data more than once)")
        print(_table([[k, f"{getattr(law, k):.5g}", _ci(bci.get(k))] for k in ("E", "A", "B", "alpha", "beta")]
                     + [["a = beta/(alpha+beta)", f"{law.a:.4f}", _ci(bci.get("a"), "{:.4f}")],
                        ["b = alpha/(alpha+beta)", f"{law.b:.4f}", _ci(bci.get("b"), "{:.4f}")]],
                     ["", "value", "95% CI"]))
        print(f"  compute-optimal: N_opt ∝ C^{law.a:.4f}, D_opt ∝ C^{law.b:.4f}, G={law.G:.4g}")
        b = an.approach3_bootstrap
        print(_boot_line(b, "--bootstrap-a3") + (f"; {ns.bootstrap_top_k} L-BFGS starts per refit "
                                                f"(+ the full-data optimum)" if b else ""))
        print(_noise_line(an.noise))
    else:
        print(f"Approach 3: no fit: {an.approach3_error}")
    if rep["skipped"]:
        print(f"skipped {len(rep['skipped'])} run(s): "
              + "; ".join(f"{s['run']}: {s['reason']}" for s in rep["skipped"][:10]))
    if ns.out:
        print(f"plot: {rep['plot']}")


def _planned_count(path: Path) -> str:
    """--params auto: the count every run's budget was planned on when they all recorded the
    same one (RunInfo.count, the CSV's count column), else total (Chinchilla's N)."""
    from llama_train.scaling.runs import load_runs

    runs, _ = load_runs(path, params="total")
    counts = {r.count for r in runs}
    return counts.pop() if len(counts) == 1 and None not in counts else "total"


def _cmd_fit(ns: argparse.Namespace) -> Dict[str, Any]:
    """Approach 2 and 3 on a sweep directory or runs CSV, with bootstrap intervals; table or JSON."""
    import shlex

    path = Path(ns.sweep_dir)
    if ns.params == "auto":
        ns.params = _planned_count(path)
    if ns.window == 0:
        ns.window = None
    conventions = ["total", "non_embedding"] if ns.params == "both" else [ns.params]
    repro = "llama-plan fit " + shlex.join([
        str(path), "--params", ns.params, "--window", str(ns.window or 0),
        "--top-k", str(ns.top_k or 0), "--bootstrap", str(ns.bootstrap),
        "--bootstrap-a3", str(ns.bootstrap_a3), "--bootstrap-top-k", str(ns.bootstrap_top_k), "--seed", str(ns.seed),
        "--repeat-half-life", f"{ns.repeat_half_life:g}", *(["--min-flops", f"{ns.min_flops:g}"] if ns.min_flops else [])])
    if not (ns.repeat_half_life > 0 and math.isfinite(ns.repeat_half_life)):
        raise ScalingError(f"--repeat-half-life={ns.repeat_half_life:g} must be a finite number > 0 "
                           f"(R* of Muennighoff et al.'s discount of repeated tokens; theirs is {REPEAT_HALF_LIFE:g})")
    if ns.window is not None and ns.window < 0:
        raise ScalingError(f"--window={ns.window} must be >= 0 (sizes either side of the best run; 0: all runs)")
    for k in ("bootstrap", "bootstrap_a3"):
        if getattr(ns, k) < 0:
            raise ScalingError(f"--{k.replace('_', '-')}={getattr(ns, k)} must be >= 0")
    analyses, reports, extra = _fit_each(ns, path, conventions, repro)
    first = analyses[conventions[0]]
    if ns.save_fit:
        if first.approach3 is None:
            raise ScalingError(f"--save-fit: Approach 3 gave no fit ({first.approach3_error})")
        import yaml

        Path(ns.save_fit).parent.mkdir(parents=True, exist_ok=True)  # configs/scaling/ is new
        Path(ns.save_fit).write_text(yaml.safe_dump(first.approach3.law.to_dict(), sort_keys=False))
        extra["saved_fit"] = ns.save_fit
    if ns.params == "both":
        res = {"params_convention": "both", "by_params": reports, "command": repro, **extra,
               "comparison": {c: {"approach2_a": r["approach2"].get("a"), "approach2_a_ci": r["approach2"].get("a_ci"),
                                  "approach3_a": r["approach3"].get("a"), "approach3_a_ci": r["approach3"].get("a_ci")}
                              for c, r in reports.items()}}
    else:
        res = {**reports[conventions[0]], **extra}
    if ns.json:
        return res

    for conv in conventions:
        _print_analysis(analyses[conv], reports[conv], path, conv, len(conventions) > 1, ns)
    if ns.params == "both":
        print("=== compare parameter counts ===")
        print(_table([[c, f"{v['approach2_a']:.4f}" if v["approach2_a"] is not None else "-",
                       _ci(v["approach2_a_ci"], "{:.4f}"),
                       f"{v['approach3_a']:.4f}" if v["approach3_a"] is not None else "-",
                       _ci(v["approach3_a_ci"], "{:.4f}")] for c, v in res["comparison"].items()],
                     ["N", "A2 a", "95% CI", "A3 a", "95% CI"]))
    if ns.csv:
        print(f"runs written to {extra['csv']} (reads back as: llama-plan fit {extra['csv']})")
    if ns.save_fit:
        print(f"Approach 3 fit ({conventions[0]} params) saved to {ns.save_fit} (use it with --fit {ns.save_fit})")
    print(f"reproduce: {repro}")
    return res


def _common(p: argparse.ArgumentParser, fit: Optional[str] = "chinchilla") -> None:
    """--json, and --fit (the loss law) for the subcommands that use one."""
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    if fit:
        fits = ", ".join(f"{k} ({v.source.split(',')[0]})" for k, v in FITS.items())
        p.add_argument("--fit", default=fit,
                       help=f"loss-law constants (default {fit}): {fits}; or a YAML file with "
                            f"E, A, B, alpha, beta")


def _add_compute_optimal(sub) -> None:
    p = sub.add_parser("compute-optimal", help="loss-optimal N, D for a training budget (Hoffmann et al. 2022)")
    p.add_argument("--flops", type=_float, required=True, help="training budget C in FLOPs (C = 6 N D)")
    _common(p, fit=DEFAULT_FIT["compute-optimal"])
    p.set_defaults(func=_cmd_compute_optimal)


def _add_inference_optimal(sub) -> None:
    p = sub.add_parser("inference-optimal", help="lifetime-cost-optimal N, D at a fixed loss (Sardana et al. 2024)")
    p.add_argument("--flops", type=_float, help="target quality = the compute-optimal model of this budget")
    p.add_argument("--reference-params", type=_float, help="target quality = this model size ...")
    p.add_argument("--reference-tokens", type=_float, help="... trained on this many tokens (default: compute-optimal)")
    p.add_argument("--loss", type=float, help="target quality as a predicted loss")
    p.add_argument("--inference-tokens", type=_float, required=True, help="lifetime inference tokens D_inf")
    # Sardana et al.'s own constants, so their worked figures come out without a flag
    _common(p, fit=DEFAULT_FIT["inference-optimal"])
    p.set_defaults(func=_cmd_inference_optimal)


def _add_model_info(sub) -> None:
    p = sub.add_parser("model-info", help="params, FLOPs/token, ZeRO model-state and activation memory of a model")
    p.add_argument("--model", required=True, help="preset name (configs/model) or a model yaml path")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks of the job (ZeRO partitions over all of them)")
    p.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                   help="ranks sharing each sequence (parallel.sequence): activations per rank")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per forward")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer state in host memory")
    p.add_argument("--activation-checkpointing", action="store_true", help="force per-block recomputation on")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--loss-chunk-tokens", type=int, default=None, metavar="N",
                   help="the loss over N tokens at a time (0: whole logits); default: the "
                        "model's model.loss_chunk_tokens (null: on from a 32000-token vocabulary)")
    p.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload (with --offload-optimizer)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="for the per-rank peak")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: count what a CPU rank's resident set shows (llama-bench memory)")
    p.add_argument("--gpu-mem", type=float, default=None, metavar="GIB",
                   help="memory per rank: say whether the config fits and, if not, the cheapest change that does")
    p.add_argument("--ds-zero", action="append", default=[], metavar="KEY=N",
                   help="a DeepSpeed zero_optimization knob, e.g. stage3_max_reuse_distance=0 (repeatable)")
    t = p.add_argument_group("traffic and step time (ZeRO 1-3; docs/scale-out.md)")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    t.add_argument("--intra-node-gbps", type=float, default=900.0, metavar="GBYTES",
                   help="GPU-to-GPU bandwidth within a node in GB/s, gigaBYTES per second per GPU "
                        "(default 900: H100/H200 NVLink 4, both directions)")
    t.add_argument("--inter-node-gbps", type=float, default=400.0, metavar="GBITS",
                   help="network bandwidth between nodes in Gb/s, gigaBITS per second per GPU, as "
                        "NICs are sold (default 400: one 400G NIC per GPU = 50 GB/s)")
    t.add_argument("--gpu", default="H100", choices=["H100", "H200", "A100", "L40S", "A10", "4090",
                                                     "V100"],
                   help="the datasheet dense bf16 peak of this GPU (default H100: 989 TFLOP/s)")
    t.add_argument("--peak-tflops", type=float, default=None, help="a peak instead of --gpu's, TFLOP/s")
    t.add_argument("--efficiency", default="eager", choices=["eager", "compiled"],
                   help="the MFU our GPU check measured (eager 40.7%%, compiled 51.9%%, 1 x H200)")
    t.add_argument("--mfu", type=float, default=None, help="a compute efficiency (0-1) instead")
    t.add_argument("--hpz-partition-size", type=int, default=0, metavar="H",
                   help="ZeRO++ hpZ: a secondary weight partition over H ranks (one node)")
    t.add_argument("--mics-shard-size", type=int, default=0, metavar="M",
                   help="MiCS: shard within groups of M ranks")
    t.add_argument("--quantized-weights", action="store_true", help="ZeRO++ qwZ: int8 all-gathers")
    t.add_argument("--quantized-gradients", action="store_true",
                   help="ZeRO++ qgZ: int4 gradient all-to-alls instead of the reduce-scatter")
    t.add_argument("--recommend", action="store_true",
                   help="which of ZeRO-2, ZeRO-3, hpZ, hpZ+qwZ+qgZ, MiCS, with or without "
                        "activation checkpointing, fits --gpu-mem (default 80 GiB) and is fastest")
    _common(p, fit=False)
    p.set_defaults(func=_cmd_model_info)


def _add_shape(sub) -> None:
    p = sub.add_parser("shape", help="a LLaMA-shaped ModelArgs for a target parameter count")
    p.add_argument("--params", type=_float, required=True, help="target parameter count (e.g. 1.3e9 or 1.3B)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--count", default="total", choices=["total", "non_embedding"],
                   help="which count must hit the target (Chinchilla: total)")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.02, help="relative tolerance on the count")
    _common(p, fit=False)
    p.set_defaults(func=_cmd_shape)


def _add_fit(sub) -> None:
    p = sub.add_parser("fit", help="fit a sweep's final validation losses: IsoFLOP parabolas (Approach 2) and "
                                   "L(N,D) (Approach 3) with bootstrap intervals; IsoFLOP plot")
    p.add_argument("sweep_dir", metavar="PATH",
                   help="a sweep folder (run dirs, each: metrics.jsonl + run_info.json) or a runs CSV with columns "
                        "flops,params,non_embedding_params,tokens,val_loss,command (flops: the nominal budget)")
    p.add_argument("--out", help="write the IsoFLOP/frontier plot to this PNG")
    p.add_argument("--csv", metavar="OUT", help="write the runs read from PATH to this CSV (PATH for a later fit)")
    p.add_argument("--params", default="auto", choices=["auto", "total", "non_embedding", "both"],
                   help="which N to fit on: auto (default) the count the runs' budgets were planned on "
                        "(scaling.count, recorded by each run), else total; both: fit each and compare the exponents")
    p.add_argument("--save-fit", help="write the Approach 3 constants to this YAML (usable as --fit)")
    p.add_argument("--top-k", type=int, default=64,
                   help="run L-BFGS from the k best of the paper's 4500 initialisations (0 = all)")
    p.add_argument("--bootstrap", type=int, default=200, metavar="N",
                   help="Approach 2 bootstrap resamples (runs resampled within each budget; 0 = none)")
    p.add_argument("--bootstrap-a3", type=int, default=100, metavar="N",
                   help="Approach 3 bootstrap resamples, each an L-BFGS refit (0 = none)")
    p.add_argument("--bootstrap-top-k", type=int, default=10, metavar="K",
                   help="L-BFGS starts per Approach 3 bootstrap refit (plus the full-data optimum)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (same seed, same intervals)")
    p.add_argument("--repeat-half-life", type=float, default=REPEAT_HALF_LIFE, metavar="R",
                   help=f"Approach 3: R* of the discount of repeated tokens, D' = U + U R* (1 - exp(-R/R*)) "
                        f"(Muennighoff et al. 2023; default their {REPEAT_HALF_LIFE:g}; smaller: repeats worth less)")
    p.add_argument("--min-flops", type=float, default=None, metavar="C",
                   help="fit only the budgets of at least C FLOPs (both approaches): leave out the smallest "
                        "budgets when the law is to be used above them and its form misses their tiny models")
    p.add_argument("--window", type=int, default=WINDOW, metavar="K",
                   help=f"Approach 2: fit each budget's parabola to the runs within K sizes either side of "
                        f"its best run (default {WINDOW}; 0: all runs). Far from its minimum an IsoFLOP curve is "
                        f"not a parabola in ln N, and a sweep's over-trained points lie there")
    _common(p, fit=False)
    p.set_defaults(func=_cmd_fit)


_FLOPS = Range(0, 1e30, lo_open=True, optional=True, fix="FLOPs, C = 6 N D")
_TOKENS = Range(0, 1e30, lo_open=True, optional=True, fix="tokens")
# Each subcommand's numeric options and their ranges (llama_train.bounds), checked before any
# planning; --repeat-half-life and --zero-stage are checked where they are read and by argparse.
OPTIONS: Dict[str, Dict[str, Range]] = {
    "compute-optimal": {"flops": _FLOPS},
    "inference-optimal": {
        "flops": _FLOPS, "reference_params": Range(0, 1e15, lo_open=True, optional=True),
        "reference_tokens": _TOKENS,
        "loss": Range(0, lo_open=True, optional=True, fix="a predicted loss in nats"),
        "inference_tokens": Range(0, 1e30, fix="lifetime inference tokens")},
    "model-info": {
        "world_size": Range(1, 2**24, integer=True, fix="ranks of the job"),
        "sequence_parallel": Range(1, 2**24, integer=True, fix="ranks sharing each sequence"),
        "micro_batch": Range(1, 2**20, integer=True, fix="sequences per rank per forward"),
        "seq_len": Range(1, 2**24, integer=True, optional=True,
                         fix="leave it out for the model's max_seq_len"),
        "loss_chunk_tokens": Range(0, 2**24, integer=True, optional=True,
                                   fix="tokens per chunk of the loss, 0 for whole logits"),
        "gpu_mem": Range(0, 2**20, lo_open=True, optional=True, fix="GiB per rank"),
        "grad_accum": Range(1, 2**20, integer=True, fix="micro-batches per optimizer step"),
        "gpus_per_node": Range(1, 1024, integer=True, fix="GPUs in one node"),
        "intra_node_gbps": Range(0, 1e6, lo_open=True, fix="GB/s (gigabytes) per GPU"),
        "inter_node_gbps": Range(0, 1e7, lo_open=True, fix="Gb/s (gigabits) per GPU"),
        "peak_tflops": Range(0, 1e6, lo_open=True, optional=True, fix="TFLOP/s per GPU"),
        "mfu": Range(0, 1, lo_open=True, optional=True, fix="a fraction, e.g. 0.4"),
        "hpz_partition_size": Range(0, 2**24, integer=True, fix="ranks of hpZ's group, 0: off"),
        "mics_shard_size": Range(0, 2**24, integer=True, fix="ranks of a MiCS shard group, 0: off")},
    "shape": {
        "params": Range(1, 1e15, fix="a parameter count, e.g. 1.3e9 or 1.3B"),
        "vocab": Range(1, 2**32, integer=True, fix="the vocabulary size"),
        "max_seq_len": Range(1, 2**24, integer=True, fix="positions the RoPE tables cover"),
        "tolerance": Range(0, 1, lo_open=True, hi_open=True,
                           fix="relative error allowed on the count, e.g. 0.02")},
    "fit": {
        "top_k": Range(0, 4500, integer=True, fix="0 starts L-BFGS from all 4500"),
        "bootstrap": Range(0, 10**6, integer=True, fix="resamples, 0 for none"),
        "bootstrap_a3": Range(0, 10**5, integer=True, fix="refits, 0 for none"),
        "bootstrap_top_k": Range(1, 4500, integer=True, fix="L-BFGS starts per refit"),
        "seed": Range(0, SEED_MAX, integer=True),
        "min_flops": Range(0, 1e30, optional=True, fix="FLOPs of the smallest budget fitted"),
        "window": Range(0, integer=True, fix="sizes either side of the best run; 0: all runs")},
}


def build_parser() -> argparse.ArgumentParser:
    """llama-plan's parser: one subcommand each, its flags beside it (_add_<subcommand>)."""
    parser = argparse.ArgumentParser(
        prog="llama-plan",
        description="Scaling-law planner: compute-optimal and inference-optimal model sizes, model memory, shapes, fits.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_compute_optimal, _add_inference_optimal, _add_model_info, _add_shape, _add_fit):
        add(sub)
    parser.set_defaults(subcommands=sub.choices)  # name -> its parser, for its own usage
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # a wrong flag gets the usage of the subcommand it was given to (exit 2)
        ns.subcommands[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        msg = check_options(ns, OPTIONS.get(ns.command, {}))
        if msg is not None:
            raise ScalingError(msg)
        if getattr(ns, "top_k", None) == 0:
            ns.top_k = None
        # --json: stdout holds the JSON alone; whatever else is printed meanwhile goes to
        # stderr (DeepSpeed, imported by model-info, logs "Setting accelerator to CPU" through
        # a handler on stdout unless DS_ACCELERATOR is set)
        with contextlib.redirect_stdout(sys.stderr) if ns.json else contextlib.nullcontext():
            res = ns.func(ns)
        if ns.json:
            print(json.dumps(jsonable(res), indent=2))
    except ScalingError as exc:
        print(f"llama-plan {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `llama-plan ... | head`
        sys.stderr.close()
        return 0
    return 0
