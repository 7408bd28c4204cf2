"""``llama-bench train``: tokens/s of our training path side by side with a plain Hugging Face loop.

    llama-bench train                                   # CPU target: small, fp32, 8 x 256, 1 process
    llama-bench train --rounds 5 --steps 12 --json out.json
    llama-bench train --profile                         # top ops of one training step, then exit
    llama-bench train --precision bf16 --float8         # ours with FP8 linears (GPU sm_89+)

A/B over ``--rounds`` pairs of runs. By default (``--interleave step``) the two runs of a round
live at once and their steps alternate under the bench's control (ours step 1, hf step 1, ours
step 2, ...; ``llama_train.bench.lockstep``), so that a burst of load from other jobs hits both
sides alike; ``--interleave run`` runs one whole run after the other instead (A B A B ...).

* **ours**: the real entry point, ``llama_train.train.main()`` (Hydra config, DeepSpeed engine, the
  loop of ``llama-train``), in its own process, with one hook (``lockstep.TurnsHook``) that takes
  its lock-step turn before each step, outside the step's timer. Per-step times and data waits
  come from its ``metrics.jsonl`` (``step_time_s``, ``data_wait_s``);
* **hf**: ``transformers.LlamaForCausalLM`` of the same shape and initial weights in a plain
  PyTorch loop with AdamW, fed by the same ``TrainLoader`` (``llama_train.bench.hf_baseline``;
  same batches: the step-1 losses of both must agree), same dtype and thread count.

Both report the median of per-step times after ``--warmup`` discarded steps. MFU uses one FLOPs
formula (``llama_train.model.flops_per_token``) and the peak ``llama-train`` itself divides by,
from the same class (``llama_train.engine.flops.PeakFlops``, decided once before the first round):
``--peak-flops`` (``trainer.peak_flops``) when given, else the datasheet dense bf16 figure of a
known GPU, else this machine's matmul measured once and cached per thread count; the report
says which. A square matmul timed here before each round read 43.7 TFLOP/s on an H200 (its
first call's overhead) against the 989 of the datasheet: MFU 1176%. The achieved throughput of
the model's own matmul shapes (forward and both backward products), measured before each round
(max over rounds), is reported beside it as ``MFU/shapes``, because skinny shapes such as
2048 x 384 x 1024 run below a square matmul's peak (``llama_train.bench.peaks``).
The report and its table: ``llama_train.bench.report``; ``--profile``: ``llama_train.bench.profile``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from llama_train.bench import COUNT, COUNT0, THREADS, TIMEOUT_S, check_options, report_or_exit
from llama_train.bench.hf_baseline import RESULT_FILE, run_hf
from llama_train.bench.lockstep import Side, run_ours
from llama_train.bench.peaks import mfu_peak, model_shapes_flops
from llama_train.bench.profile import profile
from llama_train.bench.report import build_report, format_table
from llama_train.bench.settings import (compose_config, resolve_device, resolve_precision,
                                        train_overrides)
from llama_train.bounds import Range
from llama_train.proc import free_port, remove_ds_shm
from llama_train.records import METRICS_FILE, RUN_INFO_FILE, RunInfo, read_metrics, step_records


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-bench train",
        description="Training tokens/s and MFU of llama-train's DeepSpeed path against a plain "
                    "Hugging Face transformers loop, interleaved A/B.")
    p.add_argument("--preset", default="small", help="model preset (configs/model/<name>.yaml)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="discarded steps at the start of each run")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (each: one run of both)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for both (default: all cores, os.cpu_count())")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--peak-flops", type=float, default=None, metavar="FLOP/S",
                   help="per-device peak for MFU, as trainer.peak_flops (passed to ours too); "
                        "default: llama-train's, i.e. the datasheet bf16 figure of a known GPU, "
                        "else this machine's cached matmul measurement")
    p.add_argument("--compile", action="store_true",
                   help="trainer.compile=true for ours and torch.compile of each HF decoder layer")
    p.add_argument("--float8", action="store_true",
                   help="float8.enabled=true for ours (FP8 linears, torchao; precision auto "
                        "becomes bf16); hf stays bf16. Ours bf16 vs ours FP8: run with and "
                        "without it. On CPU add --override float8.emulate=true: numerics only, "
                        "the emulated matmul says nothing about FP8 speed")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra llama-train override (repeatable), e.g. data.max_documents=600; "
                        "model.* overrides change both models")
    p.add_argument("--interleave", choices=("step", "run"), default="step",
                   help="step: both runs live at once, their steps alternate (ours, hf, ours, "
                        "...) so both meet the same load; run: one whole run after the other")
    p.add_argument("--only", choices=("ours", "hf"), default=None, help="run one side only")
    p.add_argument("--work-dir", default=None, help="run directories (default: a temp dir, removed)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH (or to stdout, without the table)")
    p.add_argument("--profile", type=int, nargs="?", const=25, default=None, metavar="N",
                   help="instead of the A/B: torch.profiler over 3 steps of each side, top N ops")
    # internal modes: the two sides' own processes
    p.add_argument("--ours-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_options("train", args, {
        "micro_batch": COUNT, "seq_len": COUNT, "steps": COUNT, "warmup": COUNT0,
        "rounds": COUNT, "threads": THREADS,
        "peak_flops": Range(0, 1e18, lo_open=True, optional=True,
                            fix="one device's peak FLOP/s"),
        "timeout": TIMEOUT_S, "profile": Range(1, integer=True, optional=True,
                                               fix="the top N ops")})
    for ov in args.override:
        if "=" not in ov or ov.startswith("="):
            raise SystemExit(f"llama-bench train: --override {ov!r} must look like KEY=VALUE, "
                             "e.g. --override data.max_documents=600")
    args.threads = args.threads or os.cpu_count() or 1
    return args


def canonical_args(args: argparse.Namespace) -> List[str]:
    """The options that reproduce this run (printed with the report)."""
    out = ["--preset", args.preset, "--micro-batch", str(args.micro_batch), "--seq-len",
           str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--rounds", str(args.rounds), "--threads", str(args.threads), "--device", args.device,
           "--precision", args.precision, "--zero-stage", str(args.zero_stage)]
    if args.peak_flops is not None:
        out += ["--peak-flops", repr(args.peak_flops)]
    if args.compile:
        out.append("--compile")
    if args.float8:
        out.append("--float8")
    out += ["--interleave", args.interleave]
    if args.only:
        out += ["--only", args.only]
    for ov in args.override:
        out += ["--override", ov]
    return out


# --------------------------------------------------------------------------------------------
# Runs: one round of both sides, each in its own process
# --------------------------------------------------------------------------------------------


def _env(threads: int, device: str) -> Dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("WANDB_SILENT", "true")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def ours_cmd(overrides: List[str], out: Path) -> List[str]:
    return [sys.executable, "-m", "llama_train.bench.train", "--ours-worker", "--",
            *overrides, f"trainer.output_dir={out}"]


def hf_cmd(spec: dict, out: Path) -> List[str]:
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return [sys.executable, "-m", "llama_train.bench.train", "--hf-worker", str(spec_path)]


def read_ours(args, out: Path, wall: float) -> dict:
    """Per-step times and data waits of a `llama-train` run from its metrics.jsonl, warm-up
    steps dropped (the lock-step turns are outside ``step_time_s``)."""
    by_step = {r.step: r for r in step_records(read_metrics(out / METRICS_FILE)) if "step_time_s" in r}
    total = args.warmup + args.steps
    missing = [s for s in range(1, total + 1) if s not in by_step]
    if missing:
        raise RuntimeError(f"{out}/metrics.jsonl lacks steps {missing}: was trainer.log_every "
                           "overridden? The bench needs every step logged.")
    if any("data_wait_s" not in by_step[s] for s in range(1, total + 1)):
        raise RuntimeError(f"{out}/metrics.jsonl: logged steps lack data_wait_s (the bench needs "
                           "llama-train's per-step data wait)")
    measured = range(args.warmup + 1, total + 1)
    try:  # the peak its own logged mfu used: the report checks it is the bench's
        logged_peak = (RunInfo.read(out / RUN_INFO_FILE).peak_flops or {}).get("value")
    except (OSError, ValueError, TypeError, AttributeError):
        logged_peak = None
    return {
        "logged_peak_flops": logged_peak,
        "step_times": [by_step[s]["step_time_s"] for s in measured],
        "warmup_step_times": [by_step[s]["step_time_s"] for s in range(1, args.warmup + 1)],
        "data_wait": [by_step[s]["data_wait_s"] for s in measured],
        "losses": [by_step[s]["loss"] for s in range(1, total + 1)],
        "mem_gb": max(by_step[s].get("mem_gb", 0.0) for s in measured),
        "wall_s": wall,
    }


def read_hf(args, out: Path, wall: float) -> dict:
    res = json.loads((out / RESULT_FILE).read_text())
    w = args.warmup
    return {"step_times": res["step_times"][w:], "warmup_step_times": res["step_times"][:w],
            "data_wait": res["data_wait"][w:],
            "losses": res["losses"], "mem_gb": res["mem_gb"], "optimizer": res["optimizer"],
            "wall_s": wall}


def run_round(args, overrides: List[str], spec: dict, work: Path, r: int,
              env: Dict[str, str]) -> Dict[str, dict]:
    """One round: `ours` then `hf` (each a whole run), or both at once in lock step."""
    lockstep = args.interleave == "step" and args.only is None
    names = [n for n in ("ours", "hf") if args.only in (None, n)]
    outs = {n: work / f"{n}-{r}" for n in names}
    cmds = {"ours": lambda: ours_cmd(overrides, outs["ours"]), "hf": lambda: hf_cmd(spec, outs["hf"])}
    results: Dict[str, dict] = {}
    readers = {"ours": read_ours, "hf": read_hf}
    port = free_port()  # ours' process group; known here so its shm file can be removed
    envs = {"ours": {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, "hf": env}
    if not lockstep:
        for n in names:
            side = Side(n, cmds[n](), work / f"{n}-{r}.log", envs[n], lockstep=False)
            try:
                results[n] = readers[n](args, outs[n], side.wait(args.timeout))
            finally:
                side.kill()
                remove_ds_shm("127.0.0.1", port, 1)
        return results
    sides: List[Side] = []
    try:
        for n in names:
            sides.append(Side(n, cmds[n](), work / f"{n}-{r}.log", envs[n], lockstep=True))
        for side in sides:  # both started up: nothing else of theirs runs during the steps
            side.turn(args.timeout, go=False)
        for _ in range(args.warmup + args.steps):
            for side in sides:
                side.turn(args.timeout)
        for side in sides:
            results[side.name] = readers[side.name](args, outs[side.name], side.wait(args.timeout))
    finally:
        for side in sides:
            side.kill()
        remove_ds_shm("127.0.0.1", port, 1)
    return results


# --------------------------------------------------------------------------------------------
# The loader on its own, and the whole bench
# --------------------------------------------------------------------------------------------


def measure_loader(prepared_dir: str, seq_len: int, micro_batch: int, seed: int,
                   num_workers: int, batches: int = 20) -> Dict[str, float]:
    """Median seconds per micro-batch of back-to-back next() (no compute in between): the
    loader's cost when nothing hides it, for 0 workers and for the configured workers."""
    from llama_train.data import TrainLoader

    out = {}
    for workers in sorted({0, num_workers}):
        loader = TrainLoader(prepared_dir, seq_len=seq_len, global_batch=micro_batch,
                             micro_batch=micro_batch, seed=seed, num_workers=workers)
        it = iter(loader)
        next(it)  # start-up (worker spawn) is not a per-batch cost
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            next(it)
            times.append(time.perf_counter() - t0)
        close = getattr(loader, "close", None)
        if close:
            close()
        out[f"workers={workers}"] = statistics.median(times)
    return out


def run_bench(args: argparse.Namespace) -> dict:
    """Checks and prepares as llama-train would, decides the MFU peak as llama-train would, then
    ``--rounds`` rounds (model-shape throughput, both sides), the loader alone, and the report."""
    import torch

    from llama_train.config import validate
    from llama_train.data import check_compatible, prepare_data
    from llama_train.errors import BadInput
    from llama_train.model import flops_per_token

    device = resolve_device(args)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("llama-bench train: --device cuda but torch sees no CUDA device")
    precision = resolve_precision(args, device)
    overrides = train_overrides(args, device, precision)
    if args.peak_flops is not None:  # ours logs MFU against the same figure
        overrides.append(f"trainer.peak_flops={args.peak_flops!r}")
    cfg = compose_config(overrides + ["trainer.output_dir=."])
    margs = cfg.model
    try:  # llama-train's own checks, before any process starts
        validate(cfg, 1, device)
    except BadInput as e:  # ConfigError
        raise SystemExit(f"llama-bench train: {e}") from None
    fpt = flops_per_token(margs, args.seq_len)
    prepared = prepare_data(cfg.data, vocab_size=margs.vocab_size)
    check_compatible(prepared.meta, margs.vocab_size, args.seq_len)
    spec = {"model_args": asdict(margs), "seed": cfg.trainer.seed, "device": device,
            "precision": precision, "threads": args.threads, "compile": args.compile,
            "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps,
            "warmup": args.warmup, "prepared_dir": prepared.dir, "data_seed": cfg.data.seed,
            "num_workers": cfg.data.num_workers,
            "optim": asdict(cfg.optim)}
    env = _env(args.threads, device)
    tmp = None
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="llama-bench-train-")
        work = Path(tmp.name)
    load = [os.getloadavg()]
    # before any run, as llama-train at its start: on CPU its cached measurement (per thread
    # count) is measured here if missing, with nothing else running, and `ours` reads it back
    peak = mfu_peak(device, precision, args.threads, cfg.trainer.peak_flops)
    shapes, ours, hf = [], [], []
    try:
        for r in range(args.rounds):
            shapes.append(model_shapes_flops(margs, args.micro_batch * args.seq_len, device,
                                             precision, args.threads))
            res = run_round(args, overrides, spec, work, r, env)
            for name, runs in (("ours", ours), ("hf", hf)):
                if name in res:
                    runs.append(res[name])
            _progress(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {statistics.median(x['step_times']):.4f} s/step" for n, x in res.items()))
        torch.set_num_threads(args.threads)
        loader = measure_loader(prepared.dir, args.seq_len, args.micro_batch, cfg.data.seed,
                                cfg.data.num_workers)
    finally:
        if tmp is not None:
            tmp.cleanup()
    load.append(os.getloadavg())
    command = "llama-bench train " + shlex.join(canonical_args(args))
    return build_report(args, command, device, precision, margs, fpt, peak, shapes, ours, hf,
                        loader, cfg.data.num_workers, load)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--ours-worker":  # hydra overrides follow, untouched by argparse
        rest = argv[1:]
        run_ours(rest[1:] if rest[:1] == ["--"] else rest)
        return
    args = parse_args(argv)
    if args.hf_worker:
        run_hf(args.hf_worker)
        return
    if args.profile is not None:
        print(profile(args, args.profile))
        return
    report_or_exit("train", run_bench, args, format_table)


if __name__ == "__main__":
    main()
