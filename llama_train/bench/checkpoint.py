"""``llama-bench checkpoint``: what a save costs the training loop, asynchronous against
synchronous against no save at all, on the same run.

    llama-bench checkpoint                       # 2 ranks, ZeRO-3, 260M params, 3 rounds
    llama-bench checkpoint --rounds 2 --steps 10 --save-every 2 --json out.json

Each round launches the same ``llama-train`` job (the real ``deepspeed`` launcher, one process
per rank) three times, in a rotating order so that load from other jobs hits every mode alike:

* **async**: ``trainer.async_save=true``, a checkpoint every ``--save-every`` steps;
* **sync**: ``trainer.async_save=false``, the same checkpoints;
* **never**: no checkpoint until the last step (every mode saves there, outside the timed loop).

Then (``--no-resume`` skips it) the async run's last checkpoint is resumed for one step, on the
same world size and on one rank (DeepSpeed's universal conversion, cold), and the ``resume``
event's seconds are printed: verifying the checkpoint, converting it, loading it.

From each run's ``metrics.jsonl``: the loop's wall time (step 1's record to the last step's, so
start-up and the final save are outside it, the saves in between inside), and per save its
``checkpoint`` event: the seconds the loop was blocked (``blocked_s``) and the seconds until the
checkpoint was durable (``durable_s``: renamed into place, manifest written, fsynced). Figures
are medians over rounds; the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from llama_train.bench import COUNT, TIMEOUT_S, check_options, report_or_exit
from llama_train.bounds import Range
from llama_train.proc import free_port
from llama_train.records import METRICS_FILE, read_metrics

MODES = ("async", "sync", "never")
BIN = Path(sys.executable).parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-bench checkpoint",
        description="Seconds a checkpoint save blocks the training loop and seconds until it is "
                    "durable, trainer.async_save=true against false against no save, "
                    "interleaved over rounds of real launches.")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=22)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--nprocs", type=int, default=2, help="ranks (processes) per run")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list among {MODES}")
    p.add_argument("--workdir", default=None,
                   help="where the runs write (default: a temp dir, removed afterwards); each "
                        "run's checkpoints are removed once read, but the async run's")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra llama-train override for every run (repeatable)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed first launch (data prepared, op built already)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="skip the resume timings (same world size, and one rank)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    p.add_argument("--from-json", metavar="PATH", help="re-print a saved report's table")
    return p


OPTIONS = {
    "dim": COUNT, "n_layers": COUNT, "n_heads": COUNT,
    "nprocs": Range(1, 4096, integer=True, fix="ranks per run"),
    "steps": COUNT, "save_every": COUNT, "seq_len": COUNT, "micro_batch": COUNT,
    "rounds": COUNT, "timeout": TIMEOUT_S,
}


def overrides(args, mode: str, out: Path, resume: Optional[Path] = None) -> List[str]:
    """The llama-train command line of one run of ``mode`` (``resume``: continue that
    checkpoint for one more step instead of starting over)."""
    save_every = args.save_every if mode != "never" else 10 * args.steps
    start = ["trainer.on_existing=overwrite", "trainer.resume=never"] if resume is None else \
        [f"trainer.resume={resume}"]
    return [
        "model=small", f"model.dim={args.dim}", f"model.n_layers={args.n_layers}",
        f"model.n_heads={args.n_heads}", "data.max_documents=600", "data.num_proc=1",
        f"trainer.seq_len={args.seq_len}", f"trainer.micro_batch={args.micro_batch}",
        f"trainer.max_steps={args.steps + (resume is not None)}", "trainer.log_every=1",
        f"trainer.eval_every={10 * args.steps}", "trainer.eval_sequences=2",
        f"trainer.save_every={save_every}", "trainer.keep_last=2",
        f"trainer.async_save={'false' if mode == 'sync' else 'true'}", *start,
        "sample.tokens=1", "tracking.wandb.mode=disabled", "tracking.console=false",
        f"deepspeed.zero_stage={args.zero_stage}", "deepspeed.precision=fp32",
        f"trainer.output_dir={out}", *args.override]


def _launch(args, nprocs: int, argv: List[str], log: Path, what: str) -> float:
    """One ``deepspeed`` launch; its wall seconds. RuntimeError with the log's tail if it
    fails."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port",
           str(free_port()), "--module", "llama_train.train", *argv]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                              timeout=args.timeout, start_new_session=True)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"the {what} run exited {proc.returncode} (log {log}):\n{tail}")
    return time.perf_counter() - t0


def measure_resume(args, work: Path) -> Dict[str, Any]:
    """Resume the async run's last checkpoint for one step: on its own world size, and on one
    rank (DeepSpeed's universal conversion first, made cold). The ``resume`` event's seconds:
    picking and verifying the checkpoint (sha256 of every file), the conversion, the load."""
    from llama_train.checkpoint import UNIVERSAL_TAG, find_latest

    ckpt, _ = find_latest(work / "async" / "checkpoints", checksums=False)
    if ckpt is None:
        raise RuntimeError(f"no checkpoint in {work / 'async'} to resume")
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    out: Dict[str, Any] = {"checkpoint": str(ckpt), "checkpoint_bytes": size}
    for name, nprocs in (("same_world", args.nprocs), ("one_rank", 1)):
        shutil.rmtree(ckpt / UNIVERSAL_TAG, ignore_errors=True)
        run = work / f"resume-{name}"
        shutil.rmtree(run, ignore_errors=True)
        wall = _launch(args, nprocs, overrides(args, "async", run, resume=ckpt),
                       work / f"resume-{name}.log", f"resume ({name})")
        event = [r for r in read_metrics(run / METRICS_FILE) if r.get("event") == "resume"][-1]
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
        out[name] = {"ranks": nprocs, "job_wall_s": wall,
                     **{k: event.get(k) for k in ("verify_s", "convert_s", "load_s")}}
    shutil.rmtree(ckpt / UNIVERSAL_TAG, ignore_errors=True)
    return out


def run_once(args, mode: str, out: Path, log: Path) -> Dict[str, Any]:
    """One launch; its figures from metrics.jsonl."""
    wall = _launch(args, args.nprocs, overrides(args, mode, out), log, mode)
    records = read_metrics(out / METRICS_FILE)
    steps = {r["step"]: r for r in records if "loss" in r}
    saves = [r for r in records if r.get("event") == "checkpoint" and r["step"] < args.steps]
    return {"mode": mode, "job_wall_s": wall,
            "loop_s": steps[args.steps]["time"] - steps[1]["time"],
            "blocked_s": [r["blocked_s"] for r in saves],
            "durable_s": [r["durable_s"] for r in saves],
            "waited_s": [r["waited_s"] for r in saves],
            "final_loss": steps[args.steps]["loss"]}


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def make_report(args) -> Dict[str, Any]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise RuntimeError(f"--modes={args.modes}: use a comma list among {', '.join(MODES)}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: List[Dict[str, Any]] = []
    if args.warmup:  # untimed: the data prepared, DeepSpeed's CPU op built, before round 1
        print("warm-up launch (not timed) ...", file=sys.stderr, flush=True)
        run_once(argparse.Namespace(**{**vars(args), "steps": 1}), "never", work / "warmup",
                 work / "warmup.log")
        shutil.rmtree(work / "warmup", ignore_errors=True)
    load = [os.getloadavg()]
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]  # rotate: no mode always first
        for mode in order:
            out = work / f"{mode}"
            print(f"round {r + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            runs.append({**run_once(args, mode, out, work / f"{mode}-{r + 1}.log"), "round": r})
            load.append(os.getloadavg())
            if mode != "async":  # several GB each; the async run's are resumed below
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
    import json

    n = json.loads((work / modes[0] / "run_info.json").read_text())["params"]["total"]
    resume = measure_resume(args, work) if args.resume and "async" in modes else None
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return summarize({
        "bench": "checkpoint",
        "command": "llama-bench checkpoint " + " ".join(shlex.quote(a) for a in args.argv),
        "params": n, "nprocs": args.nprocs, "zero_stage": args.zero_stage, "steps": args.steps,
        "save_every": args.save_every, "modes": modes,
        "loadavg": [list(x) for x in (load[0], load[-1])], "cpu_count": os.cpu_count(),
        "workdir": str(work), "runs": runs, "resume": resume,
        "launch": "deepspeed --num_gpus {} --module llama_train.train {}".format(
            args.nprocs, " ".join(overrides(args, "async", work / "async")))})


def summarize(report: Dict[str, Any]) -> Dict[str, Any]:
    """The report with its per-mode medians (``summary``) and ratios, from its ``runs``."""
    runs = report["runs"]
    modes = report.get("modes") or list(dict.fromkeys(x["mode"] for x in runs))
    summary: Dict[str, Any] = {}
    for mode in modes:
        mine = [x for x in runs if x["mode"] == mode]
        summary[mode] = {
            "loop_s": _median([x["loop_s"] for x in mine]),
            "loop_s_per_round": [round(x["loop_s"], 2) for x in mine],
            "job_wall_s": _median([x["job_wall_s"] for x in mine]),
            "blocked_s_per_save": _median([b for x in mine for b in x["blocked_s"]]),
            # the first save of a run allocates the host buffers the later ones reuse
            "blocked_s_first_save": _median([x["blocked_s"][0] for x in mine
                                             if x["blocked_s"]]),
            "blocked_s_later_saves": _median([b for x in mine for b in x["blocked_s"][1:]]),
            "durable_s_per_save": _median([d for x in mine for d in x["durable_s"]]),
            "waited_s_per_save": _median([w for x in mine for w in x["waited_s"]]),
            "saves_per_run": len(mine[0]["blocked_s"]),
            "final_loss": [x["final_loss"] for x in mine]}
    ratios = {}
    if "async" in summary and "sync" in summary and summary["sync"]["blocked_s_per_save"]:
        for which in ("per_save", "first_save", "later_saves"):
            ratios[f"blocked_async_over_sync_{which}"] = (
                summary["async"][f"blocked_s_{which}"] / summary["sync"]["blocked_s_per_save"])
    if "never" in summary:
        for mode in ("async", "sync"):
            if mode in summary:
                ratios[f"loop_{mode}_over_never"] = summary[mode]["loop_s"] / \
                    summary["never"]["loop_s"]
    return {**report, "summary": summary, "ratios": ratios}


def format_table(r: Dict[str, Any]) -> str:
    lines = [f"llama-bench checkpoint: {r['params'] / 1e6:.0f}M params, {r['nprocs']} ranks, "
             f"ZeRO-{r['zero_stage']}, {r['steps']} steps, a save every {r['save_every']} "
             f"(medians over rounds)",
             f"{'mode':<7} {'blocked s/save':>15} {'(1st, later)':>14} {'durable s/save':>15} "
             f"{'loop s':>8} {'job s':>7}  loop s per round"]

    def f(x):
        return f"{x:.2f}" if x is not None else "-"

    for mode, s in r["summary"].items():
        split = f"{f(s['blocked_s_first_save'])}, {f(s['blocked_s_later_saves'])}"
        lines.append(f"{mode:<7} {f(s['blocked_s_per_save']):>15} {split:>14} "
                     f"{f(s['durable_s_per_save']):>15} {f(s['loop_s']):>8} "
                     f"{f(s['job_wall_s']):>7}  {s['loop_s_per_round']}")
    for k, v in r["ratios"].items():
        lines.append(f"{k}: {v:.3f}")
    res = r.get("resume")
    if res:
        lines.append(f"resume of {res['checkpoint_bytes'] / 2**30:.2f} GiB checkpoint (one run "
                     f"each): verify s, convert s, load s, job s")
        for name in ("same_world", "one_rank"):
            x = res[name]
            lines.append(f"  {name:<10} ({x['ranks']} rank(s)): {x['verify_s']}, "
                         f"{x['convert_s'] if x['convert_s'] is not None else '-'}, "
                         f"{x['load_s']}, {x['job_wall_s']:.1f}")
    lines.append(f"load average {r['loadavg'][0]} -> {r['loadavg'][1]} on {r['cpu_count']} CPUs")
    lines.append(f"command: {r['command']}")
    lines.append(f"each run: {r['launch']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if not args.from_json:
        check_options("checkpoint", args, OPTIONS)
    if args.from_json:
        import json

        print(format_table(summarize(json.loads(Path(args.from_json).read_text()))))
        return
    report_or_exit("checkpoint", make_report, args, format_table)


if __name__ == "__main__":
    main()
