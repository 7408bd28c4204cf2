"""``llama-bench train``'s report: per-side medians over rounds, MFU against llama-train's own
peak (and the model-shape matmul throughput beside it), the paired ours/hf ratio, and the table
printed from it."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


# peak_flops keys renamed on 2026-11-28 (the bench stopped timing a square 1024^3 matmul per round
# and divides by llama-train's own peak): still written, with what replaces each; to be removed
DEPRECATED_PEAK_KEYS = {
    "square_1024": "value (the MFU denominator; how it was found: kind, source)",
    "square_1024_per_round": "value (decided once before the first round, so the same each "
                             "round); model_shapes_per_round for a matmul timed per round",
}


def summarize_side(runs: List[dict], tokens_per_step: int, fpt: float, peak: float,
                   model_shapes: float) -> dict:
    """One side over its rounds: pooled median step time, tokens/s, MFU (against ``peak``, the
    figure llama-train divides by, and against ``model_shapes``), data-wait share."""
    steps = [t for r in runs for t in r["step_times"]]
    med = statistics.median(steps)
    tps = tokens_per_step / med
    waits = [w for r in runs for w in (r.get("data_wait") or [])]
    side = {
        "step_time_s": {"median": med, "min": min(steps), "max": max(steps),
                        "per_round_median": [statistics.median(r["step_times"]) for r in runs]},
        "tokens_per_s": tps,
        "mfu": fpt * tps / peak,
        "mfu_vs_model_shapes": fpt * tps / model_shapes,
        "data_wait_s": _median(waits),
        "data_wait_share": (_median(waits) / med) if waits else None,
        "loss_step1": runs[0]["losses"][0],
        # step 1 pays one-off costs (allocations; with --compile the compilation itself)
        "step1_s_median": _median([r["warmup_step_times"][0] for r in runs
                                   if r["warmup_step_times"]]),
        "mem_gb": max(r["mem_gb"] for r in runs),
        "wall_s_per_run": _median([r["wall_s"] for r in runs]),
    }
    if "optimizer" in runs[0]:
        side["optimizer"] = runs[0]["optimizer"]
    logged = {r["logged_peak_flops"] for r in runs if r.get("logged_peak_flops") is not None}
    if logged:  # ours: the peak in its run_info.json, i.e. what its own logged mfu divides by
        side["logged_peak_flops"] = sorted(logged)
    return side


def build_report(args, command: str, device: str, precision: str, model_args, fpt: float,
                 peak, shapes_runs: List[float], ours: List[dict], hf: List[dict],
                 loader: Dict[str, float], num_workers: int,
                 load: List[Sequence[float]]) -> dict:
    """The report: settings, the peaks, both sides, their ratios. ``peak`` is the
    :class:`llama_train.engine.flops.PeakFlops` llama-train would divide by (``value``, ``kind``,
    ``source``); ``shapes_runs`` the model-shape throughput per round (the max is used: a low
    reading under load would inflate MFU/shapes)."""
    import torch

    tokens_per_step = args.micro_batch * args.seq_len
    shapes = max(shapes_runs)
    report: Dict[str, Any] = {
        "bench": "train",
        "command": command,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "threads": args.threads, "device": device, "torch": torch.__version__,
                    "loadavg_start": list(load[0]), "loadavg_end": list(load[-1])},
        "settings": {"preset": args.preset, "micro_batch": args.micro_batch,
                     "seq_len": args.seq_len, "tokens_per_step": tokens_per_step,
                     "precision": precision, "zero_stage": args.zero_stage,
                     "compile": args.compile, "steps": args.steps, "warmup": args.warmup,
                     "rounds": args.rounds, "interleave": args.interleave,
                     "data_num_workers": num_workers, "peak_flops": args.peak_flops,
                     "overrides": list(args.override)},
        "model_args": asdict(model_args),
        "flops_per_token": fpt,
        "peak_flops": {"value": peak.value, "kind": peak.kind, "source": peak.source,
                       "used_for_mfu": "value: llama-train's peak "
                                       "(llama_train.engine.flops.PeakFlops): "
                                       "trainer.peak_flops (--peak-flops), else the datasheet "
                                       "figure of a known GPU, else the cached matmul measurement",
                       "model_shapes_per_round": list(shapes_runs), "model_shapes": shapes,
                       "used_for_mfu_vs_model_shapes": "model_shapes (max over rounds)",
                       # the keys before 2026-11-28, kept for readers of older reports: the MFU
                       # denominator under its old names (no square matmul is timed any more)
                       "square_1024": peak.value,
                       "square_1024_per_round": [peak.value] * len(shapes_runs),
                       "deprecated": DEPRECATED_PEAK_KEYS},
        "loader_alone_s_per_batch": loader,
    }
    if ours:
        report["ours"] = summarize_side(ours, tokens_per_step, fpt, peak.value, shapes)
    if hf:
        report["hf"] = summarize_side(hf, tokens_per_step, fpt, peak.value, shapes)
    if ours and hf:
        paired = [statistics.median(h["step_times"]) / statistics.median(o["step_times"])
                  for o, h in zip(ours, hf)]
        report["ratio_ours_over_hf"] = {
            "tokens_per_s": report["ours"]["tokens_per_s"] / report["hf"]["tokens_per_s"],
            "paired_per_round": paired,
            "paired_median": statistics.median(paired),
        }
        report["loss_step1_abs_diff"] = abs(ours[0]["losses"][0] - hf[0]["losses"][0])
    return report


def format_table(r: dict) -> str:
    """The printed report."""
    s, pk = r["settings"], r["peak_flops"]
    lines = [f"llama-bench train: {s['preset']}, {s['micro_batch']} x {s['seq_len']} tokens/step, "
             f"{s['precision']}, ZeRO-{s['zero_stage']}, {r['machine']['threads']} threads on "
             f"{r['machine']['device']}, {s['rounds']} rounds x {s['steps']} steps "
             f"(+{s['warmup']} warm-up), interleaved by {s['interleave']}, "
             f"compile={s['compile']}",
             f"FLOPs/token {r['flops_per_token']:.4g}; MFU peak {pk['value'] / 1e9:.1f} GFLOP/s "
             f"(llama-train's; {pk['kind']}: {pk['source']}); MFU/shapes peak: model-shape "
             f"matmuls {pk['model_shapes'] / 1e9:.1f} GFLOP/s",
             "",
             f"{'':6} {'step s (median)':>15} {'min':>7} {'tokens/s':>9} {'MFU':>6} "
             f"{'MFU/shapes':>10} {'data wait':>10} {'step1 s':>8} {'loss@1':>8} {'mem GB':>7}"
             "  optimizer"]
    for name in ("ours", "hf"):
        if name not in r:
            continue
        x = r[name]
        wait = (f"{100 * x['data_wait_share']:.2f}%" if x["data_wait_share"] is not None
                else "n/a")
        opt = x.get("optimizer", "DeepSpeed engine")
        lines.append(f"{name:6} {x['step_time_s']['median']:15.4f} {x['step_time_s']['min']:7.4f} "
                     f"{x['tokens_per_s']:9.0f} {100 * x['mfu']:5.1f}% "
                     f"{100 * x['mfu_vs_model_shapes']:9.1f}% {wait:>10} "
                     f"{x['step1_s_median'] or float('nan'):8.3f} {x['loss_step1']:8.4f} "
                     f"{x['mem_gb']:7.2f}  {opt}")
    over = [n for n in ("ours", "hf") if n in r and r[n]["mfu"] > 1.0]
    if over:  # never true: the peak is too low for this machine, as llama-train warns
        lines.append(f"MFU above 100% ({', '.join(over)}): the peak of {pk['value']:.3g} FLOP/s "
                     f"({pk['kind']}) is too low for this machine; pass --peak-flops with its "
                     "per-device peak")
    logged = r.get("ours", {}).get("logged_peak_flops", [])
    if any(abs(v - pk["value"]) > 1e-9 * pk["value"] for v in logged):
        lines.append(f"note: llama-train's own log (run_info.json) used a peak of "
                     f"{', '.join(f'{v:.4g}' for v in logged)} FLOP/s, not {pk['value']:.4g}: "
                     "its logged mfu differs from this table's")
    if "ratio_ours_over_hf" in r:
        q = r["ratio_ours_over_hf"]
        lines += ["", f"ours / hf tokens/s: {q['tokens_per_s']:.3f} (pooled medians); paired per "
                      f"round {', '.join(f'{v:.3f}' for v in q['paired_per_round'])}; "
                      f"|loss@1 ours - hf| = {r['loss_step1_abs_diff']:.2e}"]
    lines.append("loader alone (back-to-back next(), s/batch): " + ", ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in r["loader_alone_s_per_batch"].items()))
    la = r["machine"]
    lines.append(f"load average start {la['loadavg_start'][0]:.2f}, end {la['loadavg_end'][0]:.2f}")
    lines.append(f"reproduce: {r['command']}")
    return "\n".join(lines)
