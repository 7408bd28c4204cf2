"""``llama-bench memory``: what DeepSpeed really holds per rank under ZeRO 0-3, against the plan.

    llama-bench memory                                  # tiny model, 2 CPU ranks, stages 0 1 2 3
    llama-bench memory --preset small --stages 3 --json mem.json

For each stage the DeepSpeed launcher starts ``--nprocs`` ranks of
``llama_train.bench._memory_worker`` (gloo, fp32), which build the model and engine as
``llama-train`` does, train two steps and count every tensor storage reachable from the
parameters and the engine's optimizer, by category. The table puts those bytes beside
``llama_train.scaling.model_memory(args, stage, world, dtype="fp32")`` (``llama-plan
model-info``) and the textbook 16 bytes/param/N of ZeRO-3 (4 param + 4 grad + 8 Adam moments;
fp32 on CPU has the same 16 as bf16 mixed precision's 2 + 2 + 12), with peak RSS per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from llama_train.bench._memory_worker import CATEGORIES
from llama_train.bench import report_or_exit
from llama_train.proc import free_port, kill_session, remove_ds_shm

MB = 2**20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-bench memory",
        description="Per-rank model-state bytes and peak RSS under ZeRO 0-3 (DeepSpeed launcher, "
                    "CPU, fp32) against llama-plan's analytic model.")
    p.add_argument("--preset", default="tiny", help="model preset (configs/model/<name>.yaml)")
    p.add_argument("--stages", default="0,1,2,3", help="comma list of ZeRO stages")
    p.add_argument("--nprocs", type=int, default=2, help="ranks (CPU processes)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600, help="seconds per stage")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH (or to stdout, without the table)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    try:
        args.stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"llama-bench memory: --stages={args.stages!r} must be a comma list of "
                         "0, 1, 2, 3") from None
    if not args.stages or any(s not in (0, 1, 2, 3) for s in args.stages):
        raise SystemExit(f"llama-bench memory: --stages={args.stages} must be among 0, 1, 2, 3")
    for name in ("nprocs", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"llama-bench memory: --{name.replace('_', '-')} must be >= 1")
    from llama_train.model import load_preset

    try:
        margs = load_preset(args.preset)
    except ValueError as e:
        raise SystemExit(f"llama-bench memory: --preset: {e}") from None
    if args.seq_len > margs.max_seq_len:
        raise SystemExit(f"llama-bench memory: --seq-len={args.seq_len} exceeds the {args.preset} "
                         f"preset's max_seq_len={margs.max_seq_len}")
    return args


def run_stage(args: argparse.Namespace, stage: int, out: Path) -> List[dict]:
    """Launch the ranks for one stage; their JSON results, rank order."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    env.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.nprocs),
           "--master_port", str(port), "--module", "llama_train.bench._memory_worker",
           "--preset", args.preset, "--stage", str(stage), "--micro-batch", str(args.micro_batch),
           "--seq-len", str(args.seq_len), "--out", str(out)]
    log = out.parent / f"zero{stage}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_session(proc)
            remove_ds_shm("127.0.0.1", port, args.nprocs)
    files = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if rc != 0 or len(files) != args.nprocs:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        why = f"timed out after {args.timeout:.0f}s" if rc is None else f"exit {rc}"
        raise RuntimeError(f"ZeRO-{stage}: {why}, {len(files)}/{args.nprocs} rank results: "
                           f"{shlex.join(cmd)}\n--- {log} (tail) ---\n{tail}")
    return [json.loads(p.read_text()) for p in files]


def analytic(preset: str, stage: int, world: int) -> Dict[str, Any]:
    """``llama-plan model-info``'s numbers for this stage (fp32), and 16*Psi/N."""
    from llama_train.model import count_params, load_preset

    margs = load_preset(preset)
    psi = count_params(margs)["total"]
    out: Dict[str, Any] = {"n_params": psi, "zero3_16psi_over_n": 16.0 * psi / world}
    try:
        from llama_train.scaling import model_memory
    except ImportError as e:  # pragma: no cover - scaling is part of the package
        out["model_memory_error"] = f"llama_train.scaling.model_memory unavailable: {e}"
        return out
    mm = model_memory(margs, zero_stage=stage, world_size=world, dtype="fp32")
    out["model_memory"] = mm
    # the plain 4 + 4 + 8 bytes/param accounting, partitioned like the stage
    out["model_memory_no_master"] = model_memory(margs, zero_stage=stage, world_size=world,
                                                 dtype="fp32", master_copy=False)
    return out


def summarize_stage(stage: int, ranks: List[dict], plan: Dict[str, Any]) -> dict:
    """Rank-0 bytes (ranks agree up to padding), the max over ranks, and the comparisons."""
    r0 = ranks[0]["bytes"]
    worst = {c: max(r["bytes"][c] for r in ranks) for c in CATEGORIES}
    optimizer = worst["fp32_master"] + worst["adam_moments"]
    model_state = worst["params"] + worst["grads"] + optimizer
    row: Dict[str, Any] = {
        "stage": stage,
        "measured": worst,
        "measured_rank0": r0,
        "measured_optimizer": optimizer,
        "measured_model_state": model_state,
        "measured_with_buckets": model_state + worst["buckets"] + worst["other"],
        "opt_state_bytes_engine_helper": max(r["opt_state_bytes_engine_helper"] or 0 for r in ranks),
        "rss_peak": max(r["rss_peak"] for r in ranks),
        "rss_baseline": max(r["rss_baseline"] for r in ranks),
        "zero3_persistent_params": ranks[0]["zero3_persistent_params"],
        "largest_rank0": ranks[0]["largest"],
        "zero_config": ranks[0]["ds_config_zero"],
        "zero3_16psi_over_n": plan["zero3_16psi_over_n"],
    }
    mm = plan.get("model_memory")
    if mm:
        row["analytic"] = {k: mm[k] for k in ("params", "grads", "optimizer_states", "total")}
        row["analytic_no_master_total"] = plan["model_memory_no_master"]["total"]
        row["optimizer_vs_analytic"] = optimizer / mm["optimizer_states"] if mm["optimizer_states"] else None
        row["model_state_vs_analytic"] = model_state / mm["total"]
    row["model_state_vs_16psi_over_n"] = model_state / plan["zero3_16psi_over_n"]
    if stage == 3:
        # What DeepSpeed keeps beyond 16*Psi/N: its fp32 master copy of the partition (4*Psi/N)
        # and a whole copy of every persistent small param on every rank (4 B/element, fp32).
        # Also params gathered whole at the moment of counting (in use at the end of backward).
        persistent = 4.0 * ranks[0]["zero3_persistent_params"]["numel"]
        gathered = 4.0 * max(r["zero3_gathered_numel"] for r in ranks)
        master = worst["fp32_master"]
        rest = model_state - master - persistent - gathered
        row["zero3_check"] = {
            "master_copy_bytes": master,
            "persistent_whole_copy_bytes": persistent,
            "gathered_in_use_bytes": gathered,
            "state_minus_extras": rest,
            "ratio_to_16psi_over_n": rest / plan["zero3_16psi_over_n"],
        }
    return row


def format_table(report: dict) -> str:
    lines = [f"llama-bench memory: {report['preset']} ({report['n_params']:,} params), "
             f"{report['nprocs']} CPU ranks, fp32, micro-batch {report['micro_batch']} x "
             f"{report['seq_len']}; MB per rank (max over ranks)",
             "",
             f"{'ZeRO':>4} {'params':>8} {'grads':>8} {'master':>8} {'moments':>8} "
             f"{'buckets':>8} {'other':>7} | {'state':>8} {'plan':>8} {'ratio':>6} | "
             f"{'16Psi/N':>8} {'ratio':>6} | {'RSS base':>8} {'peak':>6}"]
    for row in report["stages"]:
        m = row["measured"]
        plan = row.get("analytic", {}).get("total")
        lines.append(
            f"{row['stage']:>4} {m['params'] / MB:8.2f} {m['grads'] / MB:8.2f} "
            f"{m['fp32_master'] / MB:8.2f} {m['adam_moments'] / MB:8.2f} {m['buckets'] / MB:8.2f} "
            f"{m['other'] / MB:7.2f} | {row['measured_model_state'] / MB:8.2f} "
            f"{(plan or float('nan')) / MB:8.2f} {row.get('model_state_vs_analytic') or float('nan'):6.3f} | "
            f"{row['zero3_16psi_over_n'] / MB:8.2f} {row['model_state_vs_16psi_over_n']:6.3f} | "
            f"{row['rss_baseline'] / MB:8.0f} {row['rss_peak'] / MB:6.0f}")
    lines += ["", "state = params + grads + master + moments; plan = llama_train.scaling."
                  "model_memory(dtype='fp32'); buckets/other are DeepSpeed's extra buffers;",
              "RSS base = after imports and process group, before the model; peak = getrusage "
              "max RSS of the rank (model, engine, activations of one step, allocator slack)"]
    for row in report["stages"]:
        if row["stage"] != 3:
            continue
        p, z = row["zero3_persistent_params"], row["zero3_check"]
        lines.append(f"ZeRO-3 keeps {p['count']} small params whole on every rank "
                     f"({p['numel']:,} elements, stage3_param_persistence_threshold="
                     f"{row['zero_config'].get('stage3_param_persistence_threshold')}): "
                     f"{z['persistent_whole_copy_bytes'] / MB:.2f} MB; an fp32 master copy of "
                     f"its partition: {z['master_copy_bytes'] / MB:.2f} MB; params gathered for "
                     f"use when counted: {z['gathered_in_use_bytes'] / MB:.2f} MB")
        lines.append(f"ZeRO-3 state without those three: {z['state_minus_extras'] / MB:.2f}"
                     f" MB = {z['ratio_to_16psi_over_n']:.3f} x 16*Psi/N")
    lines.append(f"reproduce: {report['command']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    from llama_train.model import count_params, load_preset

    psi = count_params(load_preset(args.preset))["total"]
    report: Dict[str, Any] = {
        "bench": "memory", "preset": args.preset, "n_params": psi, "nprocs": args.nprocs,
        "micro_batch": args.micro_batch, "seq_len": args.seq_len, "dtype": "fp32",
        "command": "llama-bench memory " + shlex.join(
            ["--preset", args.preset, "--stages", ",".join(map(str, args.stages)), "--nprocs",
             str(args.nprocs), "--micro-batch", str(args.micro_batch), "--seq-len",
             str(args.seq_len)]),
        "stages": [],
    }
    with tempfile.TemporaryDirectory(prefix="llama-bench-memory-") as tmp:
        for stage in args.stages:
            t0 = time.perf_counter()
            ranks = run_stage(args, stage, Path(tmp) / f"zero{stage}")
            row = summarize_stage(stage, ranks, analytic(args.preset, stage, args.nprocs))
            row["wall_s"] = time.perf_counter() - t0
            report["stages"].append(row)
            print(f"ZeRO-{stage}: model state {row['measured_model_state'] / MB:.2f} MB/rank "
                  f"({row['wall_s']:.0f}s)", file=sys.stderr, flush=True)
    return report



def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    report_or_exit("memory", run, args, format_table)


if __name__ == "__main__":
    main()
