"""``llama-bench train``'s report: per-side medians over rounds, MFU against the measured peaks,
the paired ours/hf ratio, and the table printed from it."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize_side(runs: List[dict], tokens_per_step: int, fpt: float, peaks: dict) -> dict:
    """One side over its rounds: pooled median step time, tokens/s, MFU, data-wait share."""
    steps = [t for r in runs for t in r["step_times"]]
    med = statistics.median(steps)
    tps = tokens_per_step / med
    waits = [w for r in runs for w in (r.get("data_wait") or [])]
    side = {
        "step_time_s": {"median": med, "min": min(steps), "max": max(steps),
                        "per_round_median": [statistics.median(r["step_times"]) for r in runs]},
        "tokens_per_s": tps,
        "mfu": fpt * tps / peaks["square_1024"],
        "mfu_vs_model_shapes": fpt * tps / peaks["model_shapes"],
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
    return side


def build_report(args, command: str, device: str, precision: str, model_args, fpt: float,
                 peaks_runs: List[dict], ours: List[dict], hf: List[dict],
                 loader: Dict[str, float], num_workers: int,
                 load: List[Sequence[float]]) -> dict:
    """The report: settings, peaks (the max over rounds is used), both sides, their ratios."""
    import torch

    tokens_per_step = args.micro_batch * args.seq_len
    peaks = {k: max(p[k] for p in peaks_runs) for k in peaks_runs[0]}
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
                     "data_num_workers": num_workers,
                     "overrides": list(args.override)},
        "model_args": asdict(model_args),
        "flops_per_token": fpt,
        "peak_flops": {"square_1024_per_round": [p["square_1024"] for p in peaks_runs],
                       "model_shapes_per_round": [p["model_shapes"] for p in peaks_runs],
                       "square_1024": peaks["square_1024"], "model_shapes": peaks["model_shapes"],
                       "used_for_mfu": "square_1024 (max over rounds), as llama-train"},
        "loader_alone_s_per_batch": loader,
    }
    if ours:
        report["ours"] = summarize_side(ours, tokens_per_step, fpt, peaks)
    if hf:
        report["hf"] = summarize_side(hf, tokens_per_step, fpt, peaks)
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
    s = r["settings"]
    lines = [f"llama-bench train: {s['preset']}, {s['micro_batch']} x {s['seq_len']} tokens/step, "
             f"{s['precision']}, ZeRO-{s['zero_stage']}, {r['machine']['threads']} threads on "
             f"{r['machine']['device']}, {s['rounds']} rounds x {s['steps']} steps "
             f"(+{s['warmup']} warm-up), interleaved by {s['interleave']}, "
             f"compile={s['compile']}",
             f"FLOPs/token {r['flops_per_token']:.4g}; matmul peak: square 1024^3 "
             f"{r['peak_flops']['square_1024'] / 1e9:.1f} GFLOP/s, model shapes "
             f"{r['peak_flops']['model_shapes'] / 1e9:.1f} GFLOP/s",
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
