"""``llama-bench memory``: each rank's PEAK memory under ZeRO 0-3 (and ZeRO-3 + offload), against
the planner's prediction.

    llama-bench memory                                   # tiny model, bf16, ZeRO 0-3, 1 and 2 ranks
    llama-bench memory --dim 1024 --n-layers 16 --n-heads 16 --vocab 32000 \\
        --stages 0,1,2,3,3off --nprocs 1,2,4,8 --json mem.json
    llama-bench memory --from-json mem.json               # re-print (and re-predict) a saved sweep

For each configuration and rank count the DeepSpeed launcher starts ``N`` ranks of
``llama_train.bench._memory_worker``: the model is built by ``llama_train.engine.build``'s
``build_model`` (the trainer's path), the engine by its ``initialize``, and a few steps run
(micro-batch 1, short sequences).
Each rank records its peak resident memory per phase (build, initialize, each step) above its
idle baseline (VmRSS after imports and the process group's start; on CUDA
``max_memory_allocated``); the table shows the max over ranks beside
``llama_train.scaling.rank_peak_memory``. Points whose predicted total (N ranks x (idle +
predicted peak)) exceeds ``--mem-fraction`` of MemAvailable are listed as skipped, not run.
For ZeRO-3 the partitioned part of the peak (measured peak minus the planner's unpartitioned
terms) is fitted to ``a N^b`` over the rank counts that ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from llama_train.bench import COUNT, TIMEOUT_S, check_options, report_or_exit
from llama_train.bounds import Range
from llama_train.bench._memory_worker import CATEGORIES
from llama_train.proc import free_port, kill_session, remove_ds_shm

MB = 2**20
CONFIGS = {"0": (0, False), "1": (1, False), "2": (2, False), "3": (3, False), "3off": (3, True)}
IDLE_GUESS = 300 * MB  # a rank's idle RSS before any point has run (measured: ~255 MiB)


def _ints(text: str, flag: str) -> List[int]:
    try:
        vals = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"llama-bench memory: {flag}={text!r} must be a comma list of integers") from None
    if not vals or any(v < 1 for v in vals):
        raise SystemExit(f"llama-bench memory: {flag}={text!r} must list integers >= 1")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-bench memory",
        description="Per-rank peak memory under ZeRO 0-3 (+offload), DeepSpeed launcher, CPU ranks, "
                    "against llama-plan's per-rank peak prediction.")
    p.add_argument("--preset", default=None, help="model preset (configs/model/<name>.yaml); "
                   "default tiny unless shape flags are given")
    p.add_argument("--dim", type=int, help="model by shape: width (with --n-layers, --n-heads)")
    p.add_argument("--n-layers", type=int)
    p.add_argument("--n-heads", type=int)
    p.add_argument("--n-kv-heads", type=int)
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (shape flags only)")
    p.add_argument("--stages", default="0,1,2,3",
                   help="comma list of 0, 1, 2, 3, 3off (ZeRO-3 + offload_params + offload_optimizer)")
    p.add_argument("--nprocs", default="1,2", help="comma list of rank counts, e.g. 1,2,4,8")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                   help="ranks sharing each sequence (parallel.sequence); rank counts it does not "
                        "divide are skipped")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per point (>= 2)")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="skip a point whose predicted total exceeds this share of MemAvailable")
    p.add_argument("--timeout", type=float, default=900, help="seconds per point")
    p.add_argument("--malloc", default="mmap", choices=["mmap", "default"],
                   help="mmap: MALLOC_MMAP_THRESHOLD_=65536 in the ranks (freed tensors leave the "
                        "resident set); default: glibc's own heuristics")
    p.add_argument("--ds-zero", action="append", default=[], metavar="KEY=N",
                   help="set a DeepSpeed zero_optimization key after build_ds_config, e.g. "
                        "stage3_max_reuse_distance=0 (repeatable; the planner gets it too)")
    p.add_argument("--from-json", metavar="PATH", help="re-print a saved report (predictions redone)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH (or to stdout, without the table)")
    return p


def model_args_of(args: argparse.Namespace):
    from llama_train.errors import BadInput
    from llama_train.model import ModelArgs, load_preset

    shape = [args.dim, args.n_layers, args.n_heads]
    if any(v is not None for v in shape):
        if args.preset is not None or any(v is None for v in shape):
            raise SystemExit("llama-bench memory: give either --preset or all of --dim, "
                             "--n-layers, --n-heads (and optionally --n-kv-heads, --vocab)")
        try:
            return ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                             n_kv_heads=args.n_kv_heads, vocab_size=args.vocab,
                             max_seq_len=max(args.seq_len, 64))
        except BadInput as e:  # ModelArgs' ConfigError
            raise SystemExit(f"llama-bench memory: {e}") from None
    try:
        return load_preset(args.preset or "tiny")
    except BadInput as e:  # ConfigError: no such preset, or its values
        raise SystemExit(f"llama-bench memory: --preset: {e}") from None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.from_json:
        return args
    shape = Range(1, integer=True, optional=True)
    check_options("memory", args, {
        "dim": shape, "n_layers": shape, "n_heads": shape, "n_kv_heads": shape,
        "vocab": COUNT, "micro_batch": COUNT, "seq_len": COUNT, "sequence_parallel": COUNT,
        "steps": Range(2, integer=True, fix="the second step is counted"),
        "mem_fraction": Range(0, 1, lo_open=True, fix="the share of MemAvailable a point "
                                                      "may be predicted to use"),
        "timeout": TIMEOUT_S})
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not args.stages or any(s not in CONFIGS for s in args.stages):
        raise SystemExit(f"llama-bench memory: --stages={args.stages} must be among "
                         f"{', '.join(CONFIGS)}")
    args.nprocs = _ints(args.nprocs, "--nprocs")
    try:
        args.ds_zero = {k: int(float(v)) for k, v in (kv.split("=", 1) for kv in args.ds_zero)}
    except ValueError:
        raise SystemExit(f"llama-bench memory: --ds-zero {args.ds_zero}: use KEY=NUMBER") from None
    sp = args.sequence_parallel
    if sp < 1 or args.seq_len % sp:
        raise SystemExit(f"llama-bench memory: --sequence-parallel={sp} must be a positive "
                         f"divisor of --seq-len={args.seq_len}")
    args.model = model_args_of(args)
    if args.seq_len > args.model.max_seq_len:
        raise SystemExit(f"llama-bench memory: --seq-len={args.seq_len} exceeds the model's "
                         f"max_seq_len={args.model.max_seq_len}")
    return args


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def predict(model_args, config: str, world: int, precision: str, micro_batch: int,
            seq_len: int, ds_zero: Optional[Dict[str, int]] = None,
            sequence_parallel: int = 1) -> Dict[str, Any]:
    """The planner's per-rank peak for one point (CPU ranks: host and device are one pool)."""
    from llama_train.scaling import rank_peak_memory

    stage, off = CONFIGS[config]
    return rank_peak_memory(model_args, zero_stage=stage, world_size=world, dtype=precision,
                            micro_batch=micro_batch, seq_len=seq_len, offload_optimizer=off,
                            offload_params=off, device="cpu", zero_overrides=ds_zero or None,
                            sequence_parallel=sequence_parallel)


def run_point(args: argparse.Namespace, config: str, nprocs: int, out: Path) -> List[dict]:
    """Launch the ranks of one point; their JSON results, rank order."""
    from dataclasses import asdict

    stage, off = CONFIGS[config]
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    env.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    # glibc keeps freed chunks below its (dynamic, up to 32 MiB) mmap threshold in the heap, so
    # VmHWM would carry the history of the allocator, not the tensors alive at the peak. A fixed
    # 64 KiB threshold returns every freed tensor buffer to the OS: the CPU analogue of
    # torch.cuda.max_memory_allocated. (--malloc default keeps glibc's behaviour.)
    if args.malloc == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs),
           "--master_port", str(port), "--module", "llama_train.bench._memory_worker",
           "--model-json", json.dumps(asdict(args.model)), "--stage", str(stage),
           "--precision", args.precision, "--micro-batch", str(args.micro_batch),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--out", str(out),
           "--ds-zero", json.dumps(args.ds_zero),
           "--sequence-parallel", str(args.sequence_parallel)]
    if off:
        cmd.append("--offload")
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_session(proc)
            remove_ds_shm("127.0.0.1", port, nprocs)
    files = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if rc != 0 or len(files) != nprocs:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        why = f"timed out after {args.timeout:.0f}s" if rc is None else f"exit {rc}"
        raise RuntimeError(f"{label(config)} N={nprocs}: {why}, {len(files)}/{nprocs} rank "
                           f"results: {shlex.join(cmd)}\n--- {log} (tail) ---\n{tail}")
    return [json.loads(p.read_text()) for p in files]


def label(config: str) -> str:
    return "ZeRO-3+offload" if config == "3off" else f"ZeRO-{config}"


def summarize_point(point: dict, model_args, precision: str, micro_batch: int, seq_len: int,
                    ds_zero: Optional[Dict[str, int]] = None) -> dict:
    """The max over ranks of the peak above idle, the planner's figure and their ratio."""
    psi = point["n_params"]
    pred = predict(model_args, point["config"], point["nprocs"], precision, micro_batch, seq_len,
                   ds_zero, point.get("sequence_parallel", 1))
    row = {k: point[k] for k in ("config", "nprocs", "status")}
    row["predicted"] = pred["total"]
    row["predicted_breakdown"] = pred["breakdown"]
    row["predicted_unpartitioned"] = pred["unpartitioned"]
    if point["status"] != "ok":
        row["reason"] = point.get("reason")
        return row
    ranks = point["ranks"]
    worst = max(ranks, key=lambda r: r["peak_above_idle"])
    row.update(
        peak_above_idle=worst["peak_above_idle"],
        peak_rank=worst["rank"],
        peak_phase=worst["peak_phase"],
        peak_bytes_per_param=worst["peak_above_idle"] / psi,
        idle_rss=max(r["idle"]["rss"] for r in ranks),
        phases={ph: max(r["phases"][ph]["peak_above_idle"] for r in ranks)
                for ph in worst["phases"]},
        ratio=worst["peak_above_idle"] / pred["total"],
        optimizer_class=worst.get("optimizer_class"),
        measure=worst.get("measure"),
        hwm_reset=all(r.get("hwm_reset", False) for r in ranks),
    )
    if point.get("sequence_parallel", 1) > 1 and all(r.get("all_to_all") for r in ranks):
        row["all_to_all"] = _exchanges(ranks, model_args, precision, micro_batch, seq_len,
                                       point["sequence_parallel"])
    if "bytes" in worst:
        counted = {c: max(r["bytes"][c] for r in ranks) for c in CATEGORIES}
        row["counted"] = counted
        row["counted_optimizer"] = counted["fp32_master"] + counted["adam_moments"]
    return row


def _exchanges(ranks: List[dict], model_args, precision: str, micro_batch: int, seq_len: int,
               n: int) -> Dict[str, Any]:
    """The last step's all-to-alls (the slowest rank's), beside the planner's count and bytes,
    and an estimate of their time: each planned exchange (q, k, v, out of every layer and pass)
    at the time the same exchange takes alone on these ranks."""
    from llama_train.scaling import sequence_parallel_traffic

    plan = sequence_parallel_traffic(model_args, micro_batch, seq_len, n, precision)
    slow = max(ranks, key=lambda r: r["all_to_all"]["seconds"])["all_to_all"]
    alone = {int(k): max(r["all_to_all"]["alone"][k] for r in ranks) for k in slow["alone"]}
    per_layer = sum(alone[b] for b in plan["call_bytes"])
    return {"calls": slow["calls"], "bytes": slow["bytes"], "seconds": slow["seconds"],
            "wait_seconds": max(r["all_to_all"]["wait_seconds"] for r in ranks),
            "planned_calls": plan["calls"], "planned_bytes": plan["bytes"],
            "alone_seconds": {str(b): t for b, t in alone.items()},
            "estimated_seconds": plan["passes"] * plan["layers"] * per_layer,
            "step_seconds": max(_last_step(r["phases"]).get("seconds", 0.0) for r in ranks)}


def _last_step(phases: Dict[str, Any]) -> Dict[str, Any]:
    return phases[max((k for k in phases if k.startswith("step")), key=lambda k: int(k[4:]))]


def fit_exponent(rows: List[dict]) -> Optional[Dict[str, Any]]:
    """Least squares of log(partitioned part) on log N over the points that ran."""
    pts = [(r["nprocs"], r["peak_above_idle"] - r["predicted_unpartitioned"],
            r["peak_above_idle"]) for r in rows if r["status"] == "ok"]
    pts = [p for p in pts if p[1] > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None

    def fit(xs, ys):
        lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
        mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
        b = sum((a - mx) * (c - my) for a, c in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
        return b, math.exp(my - b * mx)

    b, a = fit([p[0] for p in pts], [p[1] for p in pts])
    b_total, _ = fit([p[0] for p in pts], [p[2] for p in pts])
    return {"b": b, "a": a, "b_total_peak": b_total, "n": [p[0] for p in pts],
            "partitioned_part": [p[1] for p in pts]}


def summarize(report: dict) -> dict:
    from llama_train.model import ModelArgs

    margs = ModelArgs(**report["model_args"])
    for p in report["points"]:
        p.setdefault("sequence_parallel", report.get("sequence_parallel", 1))
    rows = [summarize_point(p, margs, report["precision"], report["micro_batch"],
                            report["seq_len"], report.get("ds_zero")) for p in report["points"]]
    report["rows"] = rows
    report["fits"] = {}
    for config in ("3", "3off"):
        f = fit_exponent([r for r in rows if r["config"] == config])
        if f:
            report["fits"][config] = f
    ok = [r for r in rows if r["status"] == "ok"]
    report["worst_ratio"] = (max(ok, key=lambda r: abs(r["ratio"] - 1))["ratio"] if ok else None)
    return report


def format_table(report: dict) -> str:
    psi = report["n_params"]
    lines = [f"llama-bench memory: {report['model_name']} ({psi:,} params), {report['precision']}, "
             f"micro-batch {report['micro_batch']} x {report['seq_len']}, {report['steps']} steps, "
             f"CPU ranks (DeepSpeed launcher, gloo)"
             + (f", {report['sequence_parallel']} ranks sharing each sequence"
                if report.get("sequence_parallel", 1) > 1 else ""),
             f"machine: {report['machine']}; 1-min load average {report['loadavg_start']:.2f} at "
             f"start, {report.get('loadavg_end', float('nan')):.2f} at end; MemAvailable at start "
             f"{report['mem_available'] / 2**30:.1f} GiB",
             "",
             f"{'config':<15} {'N':>2} | {'peak MiB':>9} {'B/param':>7} {'phase':>10} "
             f"{'idle MiB':>8} | {'plan MiB':>9} {'B/param':>7} {'meas/plan':>9}"]
    for r in report["rows"]:
        head = f"{label(r['config']):<15} {r['nprocs']:>2} | "
        plan = (f"{r['predicted'] / MB:9.0f} {r['predicted'] / psi:7.2f}")
        if r["status"] != "ok":
            lines.append(head + f"{r['status'] + ': ' + (r.get('reason') or ''):<38} | {plan}")
            continue
        lines.append(head + f"{r['peak_above_idle'] / MB:9.0f} {r['peak_bytes_per_param']:7.2f} "
                     f"{r['peak_phase']:>10} {r['idle_rss'] / MB:8.0f} | {plan} {r['ratio']:9.3f}")
    for r in report["rows"]:
        a = r.get("all_to_all")
        if a:
            lines.append(
                f"{label(r['config'])} N={r['nprocs']}: all-to-all in the last step: {a['calls']} "
                f"calls, {a['bytes'] / MB:.1f} MiB (planned {a['planned_calls']}, "
                f"{a['planned_bytes'] / MB:.1f} MiB), {a['seconds']:.3f} s exchanging in a "
                f"{a['step_seconds']:.2f} s step (and up to {a['wait_seconds']:.3f} s before the "
                f"calls, waiting for the other ranks); estimate {a['estimated_seconds']:.3f} s "
                f"(each planned exchange at its time alone: " + ", ".join(
                    f"{int(b) / MB:.2f} MiB {1e3 * t:.2f} ms" for b, t in a["alone_seconds"].items())
                + ")")
    lines += ["",
              "peak = max over ranks and phases (build, initialize, step1, step2, ...) of VmHWM "
              "minus the rank's idle VmRSS (after imports and process-group start, before the "
              "model; VmHWM reset there and per phase); plan = llama_train.scaling."
              "rank_peak_memory (llama-plan model-info)"]
    for config, f in report.get("fits", {}).items():
        lines.append(f"{label(config)}: partitioned part of the peak (measured peak - planned "
                     f"unpartitioned terms) ~ N^b over N={f['n']}: b = {f['b']:.3f} "
                     f"(total peak: b = {f['b_total_peak']:.3f})")
    if report.get("worst_ratio") is not None:
        lines.append(f"worst measured/planned ratio: {report['worst_ratio']:.3f}")
    lines.append(f"reproduce: {report['command']}")
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> str:
    if args.dim is not None:
        model = ["--dim", str(args.dim), "--n-layers", str(args.n_layers), "--n-heads",
                 str(args.n_heads), "--vocab", str(args.vocab)]
        if args.n_kv_heads:
            model += ["--n-kv-heads", str(args.n_kv_heads)]
    else:
        model = ["--preset", args.preset or "tiny"]
    return "llama-bench memory " + shlex.join(
        model + ["--stages", ",".join(args.stages), "--nprocs", ",".join(map(str, args.nprocs)),
                 "--precision", args.precision, "--micro-batch", str(args.micro_batch),
                 "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
        + (["--sequence-parallel", str(args.sequence_parallel)] if args.sequence_parallel > 1
           else [])
        + (["--malloc", args.malloc] if args.malloc != "mmap" else [])
        + [f"--ds-zero={k}={v}" for k, v in args.ds_zero.items()])


def run(args: argparse.Namespace) -> dict:
    if args.from_json:
        return summarize(json.loads(Path(args.from_json).read_text()))
    from dataclasses import asdict

    from llama_train.model import count_params

    psi = count_params(args.model)["total"]
    avail = mem_available()
    report: Dict[str, Any] = {
        "bench": "memory", "model_name": (f"dim {args.model.dim} x {args.model.n_layers} layers, "
                                          f"vocab {args.model.vocab_size}") if args.dim else
        (args.preset or "tiny"),
        "model_args": asdict(args.model), "n_params": psi, "precision": args.precision,
        "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps, "malloc": args.malloc,
        "ds_zero": args.ds_zero, "sequence_parallel": args.sequence_parallel,
        "machine": f"{platform.node()}, {os.cpu_count()} CPU cores, "
                   f"{_mem_total() / 2**30:.0f} GiB RAM, {platform.processor() or platform.machine()}",
        "mem_available": avail, "mem_fraction": args.mem_fraction,
        "loadavg_start": os.getloadavg()[0], "command": _command(args), "points": [],
    }
    idle = IDLE_GUESS
    with tempfile.TemporaryDirectory(prefix="llama-bench-memory-") as tmp:
        for config in args.stages:
            for n in args.nprocs:
                point: Dict[str, Any] = {"config": config, "nprocs": n, "n_params": psi,
                                         "sequence_parallel": args.sequence_parallel}
                if n % args.sequence_parallel:
                    point.update(status="skipped", reason=(
                        f"--sequence-parallel {args.sequence_parallel} does not divide {n} ranks"))
                    report["points"].append(point)
                    continue
                pred = predict(args.model, config, n, args.precision, args.micro_batch,
                               args.seq_len, args.ds_zero, args.sequence_parallel)["total"]
                need = n * (idle + pred)
                if need > args.mem_fraction * avail:
                    point.update(status="skipped", reason=(
                        f"{n} x ({idle / MB:.0f} idle + {pred / MB:.0f} MiB) > "
                        f"{args.mem_fraction:.0%} of {avail / 2**30:.1f} GiB"))
                    report["points"].append(point)
                    print(f"{label(config)} N={n}: skipped ({point['reason']})", file=sys.stderr,
                          flush=True)
                    continue
                t0 = time.perf_counter()
                ranks = run_point(args, config, n, Path(tmp) / f"{config}-n{n}")
                for r in ranks:  # the tensor listing is for eyes, not for the report
                    r.pop("largest", None)
                point.update(status="ok", ranks=ranks, wall_s=time.perf_counter() - t0)
                idle = max(idle, max(r["idle"]["rss"] for r in ranks))
                report["points"].append(point)
                peak = max(r["peak_above_idle"] for r in ranks)
                print(f"{label(config)} N={n}: peak {peak / MB:.0f} MiB/rank above idle, plan "
                      f"{pred / MB:.0f} MiB ({point['wall_s']:.0f}s)", file=sys.stderr, flush=True)
                if args.json and args.json != "-":  # keep what ran if a later point fails
                    Path(args.json).write_text(json.dumps(report, indent=1))
    report["loadavg_end"] = os.getloadavg()[0]
    return summarize(report)


def _mem_total() -> int:
    with open("/proc/meminfo") as fh:
        return int(fh.readline().split()[1]) * 1024


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    report_or_exit("memory", run, args, format_table)


if __name__ == "__main__":
    main()
