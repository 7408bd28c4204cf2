"""``llama-bench startup``: time from command to the end of step 1, for ``llama-train`` and for
the floor (a plain torch script that does the same first step).

    llama-bench startup                            # tiny model, 1 and 2 ranks, median of 5
    llama-bench startup --baseline /tmp/wt_old     # also another checkout, interleaved
    llama-bench startup --extensions fresh --rounds 1   # as on a machine with no op builds cached

Each round runs, for each rank count, every variant once, in an order rotated by one each round
(so machine noise and order effects hit every variant alike):

* ``ours``: ``llama-train <tiny settings>`` (1 rank, a plain process) or
  ``deepspeed --num_gpus N --module llama_train.train <tiny settings>``; step 1 ends at the
  ``time`` of the first ``metrics.jsonl`` record (unix seconds, written after the step);
* ``ours@baseline`` (``--baseline DIR``): the same commands with ``PYTHONPATH=DIR``, i.e. the
  ``llama_train`` of another checkout (a ``git worktree`` of an older commit);
* ``floor``: :mod:`llama_train.bench._startup_child` in floor mode: import torch, build the same
  model (``llama_train.model``), torch AdamW, one forward/backward/step; with N ranks under the same
  ``deepspeed`` launcher over gloo with DistributedDataParallel.

The time counts from just before the command is started (``time.time()`` in this process), so it
includes the launcher; the CPU seconds of the whole run (every process, to exit) come beside it.
Before the rounds every variant runs once untimed (prepares the data on first use, fills the page
cache) and that first run's time is reported too. Then ``--phase-rounds`` runs of each ``ours``
variant under the probe (:mod:`llama_train.bench._startup_child`) split the time into phases
(median per phase). Every child runs in its own scratch directory with ``DS_ACCELERATOR=cpu`` and
``OMP_NUM_THREADS=--threads``; the load average is taken before every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from llama_train.bench import COUNT, COUNT0, TIMEOUT_S, check_options, report_or_exit
from llama_train.bounds import Range
from llama_train.proc import free_port, kill_session, remove_ds_shm
from llama_train.records import METRICS_FILE, iter_records

# The tiny settings of the tests (tests/helpers.py TINY): a run that takes seconds.
TINY = [
    "model=tiny",
    "data.max_documents=600",
    "data.num_proc=1",
    "trainer.seq_len=64",
    "trainer.micro_batch=2",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=1000",
    "trainer.eval_sequences=8",
    "trainer.save_every=1000",
    "sample.tokens=8",
    "tracking.wandb.mode=disabled",
    "tracking.console=false",
    "deepspeed.precision=fp32",
]
CHILD = "_llama_bench_startup_child"  # the name the child module is copied under
BIN = Path(sys.executable).parent


def _ints(text: str, flag: str) -> List[int]:
    try:
        vals = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"llama-bench startup: {flag}={text!r} must be a comma list of "
                         f"integers") from None
    if not vals or any(v < 1 for v in vals):
        raise SystemExit(f"llama-bench startup: {flag}={text!r} must list integers >= 1")
    return vals


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llama-bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", default="1,2", help="comma list of rank counts (default 1,2)")
    p.add_argument("--rounds", type=int, default=5, help="timed runs of each variant (median)")
    p.add_argument("--phase-rounds", type=int, default=3,
                   help="probe runs of each llama-train variant for the phase split (0: none)")
    p.add_argument("--baseline", metavar="DIR",
                   help="also time the llama_train of this checkout (PYTHONPATH=DIR), e.g. a "
                        "`git worktree add /tmp/wt_old <commit>`")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    p.add_argument("--extensions", choices=["inherit", "fresh"], default="inherit",
                   help="TORCH_EXTENSIONS_DIR of the llama-train runs: inherit (this "
                        "environment's, or torch's default ~/.cache/torch_extensions) or fresh "
                        "(an empty one per run: a machine or container with no op built yet)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for the llama-train runs (repeatable)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--work-dir", help="keep the runs here (default: a temporary dir, removed)")
    p.add_argument("--json", help="also write the report to this file ('-': JSON on stdout only)")
    args = p.parse_args(argv)
    check_options("startup", args, {
        "rounds": COUNT, "phase_rounds": COUNT0,
        "threads": Range(1, 4096, integer=True, fix="OMP_NUM_THREADS of every run"),
        "timeout": TIMEOUT_S})
    args.nprocs_list = _ints(args.nprocs, "--nprocs")
    for o in args.override:
        if "=" not in o:
            raise SystemExit(f"llama-bench startup: --override {o!r} must be KEY=VALUE")
    if args.baseline:
        base = Path(args.baseline).resolve()
        if not (base / "llama_train" / "train.py").is_file():
            raise SystemExit(f"llama-bench startup: --baseline {args.baseline}: no "
                             f"llama_train/train.py there (give a checkout's root)")
        args.baseline = str(base)
    return args


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _overrides(args: argparse.Namespace) -> List[str]:
    return [*TINY, *args.override]


def _floor_spec(overrides: List[str]) -> Dict[str, Any]:
    """The model, batch and lr the llama-train runs train (Hydra composition, as llama-train)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from llama_train.config import load_config
    from llama_train.errors import BadInput
    from llama_train.paths import CONFIG_DIR

    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = load_config(compose("config", overrides=overrides))
    except (HydraException, BadInput) as e:  # Hydra's composition; load_config: ConfigError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"llama-bench startup: the llama-train config does not compose: {first}")
    return {"model": asdict(cfg.model), "micro_batch": cfg.trainer.micro_batch,
            "seq_len": cfg.trainer.seq_len, "lr": cfg.optim.lr}


class Runner:
    """Starts the variants' commands in scratch dirs and reads when their step 1 ended."""

    def __init__(self, args: argparse.Namespace, work: Path, spec: Dict[str, Any]):
        self.args, self.work, self.n = args, work, 0
        self.child_dir = work / "child"
        self.child_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(__file__).with_name("_startup_child.py"), self.child_dir / f"{CHILD}.py")
        self.spec = json.dumps(spec)
        self.loadavg: List[List[float]] = []

    def variants(self) -> List[str]:
        return ["floor", "ours"] + (["ours@baseline"] if self.args.baseline else [])

    def env(self, variant: str, probe: bool) -> Dict[str, str]:
        """Only what differs from the caller's environment (shown in the printed commands)."""
        env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(self.args.threads)}
        path = [str(self.child_dir)] if (probe or variant == "floor") else []
        if variant == "ours@baseline":
            path.append(self.args.baseline)
        path += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
        if path:  # an inherited PYTHONPATH is shown too: it decides which llama_train runs
            env["PYTHONPATH"] = os.pathsep.join(path)
        if variant == "floor":
            env["LLAMA_BENCH_STARTUP_MODE"] = "floor"
            env["LLAMA_BENCH_STARTUP_SPEC"] = self.spec
        elif probe:
            env["LLAMA_BENCH_STARTUP_MODE"] = "probe"
        return env

    def command(self, variant: str, nprocs: int, probe: bool, run_dir: Path,
                port: int) -> List[str]:
        if variant == "floor" or probe:
            target = ["--module", CHILD]
            plain = [sys.executable, "-m", CHILD]
        else:
            target = ["--module", "llama_train.train"]
            script = BIN / "llama-train"
            plain = [str(script)] if script.exists() else [sys.executable, "-m",
                                                           "llama_train.train"]
        rest = [] if variant == "floor" else [*_overrides(self.args),
                                              f"trainer.output_dir={run_dir / 'out'}"]
        if nprocs == 1:
            return [*plain, *rest]
        return [str(BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(port),
                *target, *rest]

    def shown(self, variant: str, nprocs: int, probe: bool = False) -> str:
        """The command as a user would type it (scratch paths as placeholders)."""
        env = self.env(variant, probe)
        env.pop("LLAMA_BENCH_STARTUP_SPEC", None)
        if "PYTHONPATH" in env:
            env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(self.child_dir), "<child dir>")
        cmd = self.command(variant, nprocs, probe, Path("<run dir>"), 29500)
        cmd = [Path(c).name if c in (sys.executable, str(BIN / "llama-train"),
                                     str(BIN / "deepspeed")) else c for c in cmd]
        return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)

    def run(self, variant: str, nprocs: int, probe: bool = False) -> Dict[str, Any]:
        """One run: seconds from command start to the end of step 1 (rank 0), to exit, and the
        child's marks when it wrote them."""
        self.n += 1
        run_dir = self.work / f"run{self.n:03d}-{variant.replace('@', '-')}-{nprocs}"
        run_dir.mkdir(parents=True)
        port = free_port()
        env = {**os.environ, **self.env(variant, probe), "PYTHONUNBUFFERED": "1",
               "LLAMA_BENCH_STARTUP_OUT": str(run_dir / "marks")}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE",
                  "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        if self.args.extensions == "fresh" and variant != "floor":
            env["TORCH_EXTENSIONS_DIR"] = str(run_dir / "torch_extensions")
        cmd = self.command(variant, nprocs, probe, run_dir, port)
        load = list(os.getloadavg())
        self.loadavg.append(load)
        cpu0 = _children_cpu_s()
        with open(run_dir / "log.txt", "w") as log:
            t0 = time.time()
            # cwd: the run dir, so `python -m` never finds this checkout's llama_train first
            proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                kill_session(proc)
            t_exit = time.time()
        cpu = _children_cpu_s() - cpu0
        remove_ds_shm("127.0.0.1", port, nprocs)
        if rc != 0:
            tail = (run_dir / "log.txt").read_text(errors="replace")[-3000:]
            why = f"timed out after {self.args.timeout:g} s" if rc is None else f"exit {rc}"
            raise RuntimeError(f"{variant} on {nprocs} rank(s) {why}: {shlex.join(cmd)}\n{tail}")
        marks = None
        if (run_dir / "marks.0.json").is_file():
            marks = json.loads((run_dir / "marks.0.json").read_text())
        if variant == "floor":
            end = marks["marks"][-1][1]
        else:
            end = next(iter_records(run_dir / "out" / METRICS_FILE)).time
        out = {"to_step1_s": end - t0, "to_exit_s": t_exit - t0, "cpu_s": cpu, "loadavg": load}
        if marks is not None:
            out["phases"] = phases_of(marks, t0, end)
        if not self.args.work_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        return out


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children and their descendants (the
    launcher waits for its ranks, so their time is in it): a run's CPU cost, which another job
    on the machine disturbs much less than its wall time."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def phases_of(marks: Dict[str, Any], t0: float, end: float) -> List[List[Any]]:
    """[[phase, seconds], ...] from the command start through rank 0's marks. The last phase ends
    at `end`, the time the run's total counts to: the step-1 record's own time (its mark comes
    after the record is written and the step line printed, 10-70 ms later on a loaded machine)."""
    out = [["launcher (command -> rank 0 process start)", marks["process_start"] - t0]]
    prev = marks["process_start"]
    for i, (label, t) in enumerate(marks["marks"]):
        t = end if i == len(marks["marks"]) - 1 else t
        out.append([label, t - prev])
        prev = t
    return out


def _stats(xs: List[float]) -> Dict[str, Any]:
    return {"median": _median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def median_phases(runs: List[List[List[Any]]]) -> List[Dict[str, Any]]:
    """Median seconds of each phase over runs, in the order the phases first appear."""
    order: List[str] = []
    values: Dict[str, List[float]] = {}
    for run in runs:
        for label, s in run:
            if label not in values:
                order.append(label)
                values[label] = []
            values[label].append(s)
    return [{"phase": k, "median_s": _median(values[k]), "runs": values[k]} for k in order]


def make_report(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    from llama_train import engine

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="llama-bench-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        runner = Runner(args, work, _floor_spec(_overrides(args)))
        variants = runner.variants()
        load_start = list(os.getloadavg())
        results: Dict[str, Dict[str, Any]] = {}
        timed: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
        for n in args.nprocs_list:
            key = str(n)
            results[key], timed[key] = {}, {v: [] for v in variants}
            for v in variants:  # untimed first run: data prepared, caches warm
                results[key][v] = {"first_run_s": runner.run(v, n)["to_step1_s"]}
        for r in range(args.rounds):
            for n in args.nprocs_list:
                k = r % len(variants)
                for v in variants[k:] + variants[:k]:
                    timed[str(n)][v].append(runner.run(v, n))
        phases: Dict[str, Dict[str, Any]] = {}
        for n in args.nprocs_list:
            key = str(n)
            for v in variants:
                runs = timed[key][v]
                res = results[key][v]
                res["to_step1_s"] = _stats([x["to_step1_s"] for x in runs])
                res["to_exit_s"] = _stats([x["to_exit_s"] for x in runs])
                res["cpu_s"] = _stats([x["cpu_s"] for x in runs])
            floor = results[key]["floor"]["to_step1_s"]["median"]
            for v in variants:
                res = results[key][v]
                res["over_floor_s"] = res["to_step1_s"]["median"] - floor
            if "ours@baseline" in variants:  # per round, so both saw the same machine
                paired = [a["to_step1_s"] - b["to_step1_s"] for a, b in
                          zip(timed[key]["ours"], timed[key]["ours@baseline"])]
                results[key]["ours"]["minus_baseline_paired_s"] = _stats(paired)
            phases[key] = {"floor": median_phases([x["phases"] for x in timed[key]["floor"]])}
            probe_runs: Dict[str, List[Any]] = {v: [] for v in variants if v != "floor"}
            for r in range(args.phase_rounds):
                for v in probe_runs:
                    probe_runs[v].append(runner.run(v, n, probe=True))
            for v, runs in probe_runs.items():
                if runs:
                    phases[key][v] = median_phases([x["phases"] for x in runs])
                    phases[key][v + " (probe run total)"] = _stats([x["to_step1_s"]
                                                                    for x in runs])
        commands = {str(n): {v: runner.shown(v, n) for v in variants} for n in args.nprocs_list}
        probe_cmds = {str(n): runner.shown("ours", n, probe=True) for n in args.nprocs_list}

        return {
            "bench": "startup",
            "command": "llama-bench startup " + shlex.join(_forwarded(args)),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "deepspeed": engine.deepspeed_version(), "loadavg_start": load_start,
                        "loadavg_end": list(os.getloadavg()),
                        "loadavg_1min_median": _median([x[0] for x in runner.loadavg])},
            "settings": {"nprocs": args.nprocs_list, "rounds": args.rounds,
                         "phase_rounds": args.phase_rounds, "threads": args.threads,
                         "extensions": args.extensions, "baseline": args.baseline,
                         "overrides": _overrides(args),
                         "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR")},
            "commands": commands,
            "probe_commands": probe_cmds,
            "results": results,
            "phases": phases,
        }
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def _forwarded(args: argparse.Namespace) -> List[str]:
    out = ["--nprocs", args.nprocs, "--rounds", str(args.rounds), "--phase-rounds",
           str(args.phase_rounds), "--threads", str(args.threads)]
    if args.baseline:
        out += ["--baseline", args.baseline]
    if args.extensions != "inherit":
        out += ["--extensions", args.extensions]
    for o in args.override:
        out += ["--override", o]
    return out


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(r: Dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"llama-bench startup: command -> end of step 1, median of {r['settings']['rounds']} "
             f"(load average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at "
             f"end, median {m['loadavg_1min_median']:.2f}; {m['cpu_count']} CPUs, torch "
             f"{m['torch']}, deepspeed {m['deepspeed']}; OMP_NUM_THREADS={r['settings']['threads']}"
             f", extensions: {r['settings']['extensions']})", "",
             f"{'ranks':>5}  {'variant':<14} {'median s':>8} {'min':>6} {'max':>6} "
             f"{'over floor':>10} {'exit s':>7} {'first run':>9} {'CPU s':>6}"]
    for n, res in r["results"].items():
        for v, x in res.items():
            t = x["to_step1_s"]
            lines.append(f"{n:>5}  {v:<14} {t['median']:8.2f} {t['min']:6.2f} {t['max']:6.2f} "
                         f"{x['over_floor_s']:+10.2f} {x['to_exit_s']['median']:7.2f} "
                         f"{x['first_run_s']:9.2f} {x['cpu_s']['median']:6.2f}")
        if "minus_baseline_paired_s" in res["ours"]:
            d = res["ours"]["minus_baseline_paired_s"]
            runs = ", ".join(f"{x:+.2f}" for x in d["runs"])
            lines.append(f"{'':>5}  ours - ours@baseline, paired by round: median "
                         f"{d['median']:+.2f} s ({runs})")
    for n, ph in r["phases"].items():
        cols = [v for v in ph if not v.endswith("(probe run total)") and v != "floor"]
        if not cols:
            continue
        labels: List[str] = []  # a phase only one variant has goes after the one before it there
        for v in cols:
            prev = -1
            for p in ph[v]:
                if p["phase"] not in labels:
                    labels.insert(prev + 1, p["phase"])
                prev = labels.index(p["phase"])
        lines += ["", f"phases, {n} rank(s), rank 0 (median s of {r['settings']['phase_rounds']} "
                      f"probe runs):",
                  f"  {'phase':<72} " + " ".join(f"{v:>13}" for v in cols)]
        for lab in labels:
            vals = []
            for v in cols:
                hit = next((p["median_s"] for p in ph[v] if p["phase"] == lab), None)
                vals.append(f"{_s(hit):>13}")
            lines.append(f"  {lab[:72]:<72} " + " ".join(vals))
        lines.append(f"  {'probe run total (command -> step 1 logged)':<72} " + " ".join(
            f"{_s(ph[v + ' (probe run total)']['median']):>13}" for v in cols))
    for n, ph in r["phases"].items():
        lines += ["", f"floor phases, {n} rank(s), rank 0 (median s of "
                      f"{r['settings']['rounds']}):"]
        lines += [f"  {p['phase']:<72} {_s(p['median_s']):>7}" for p in ph["floor"]]
    lines += ["", "commands (run dir: a fresh scratch dir per run):"]
    for n, cmds in r["commands"].items():
        for v, c in cmds.items():
            lines.append(f"  [{n} rank(s), {v}] {c}")
    for n, c in r["probe_commands"].items():
        lines.append(f"  [{n} rank(s), phase probe] {c}")
    lines += ["", f"reproduce: {r['command']}"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    report_or_exit("startup", make_report, args, format_table)


if __name__ == "__main__":
    main()
