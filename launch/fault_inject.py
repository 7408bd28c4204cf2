#!/usr/bin/env python
"""kill -9 drill: a job killed at random moments, resumed each time, must end exactly as one that
never was.

    python launch/fault_inject.py --trials 5 --nprocs 2 --workdir /tmp/drill -- \
        model=tiny trainer.max_steps=40 trainer.save_every=2 deepspeed.zero_stage=2

1. reference: the overrides run once, uninterrupted (or ``--reference DIR``: an output_dir of
   such a run, same overrides);
2. ``--trials`` times: launch (resuming), wait for a random moment, SIGKILL the whole process
   group (launcher and every rank). Moments alternate between "in a step" (a random step ahead
   of the last one logged, plus a random fraction of a step) and "in a save" (as soon as a
   ``.tmp-step_*`` directory appears, plus a random fraction of a save's duration);
3. a last launch runs to the end;
4. the final checkpoints' consolidated weights must be bit-identical, and so must the per-step
   losses in metrics.jsonl (one line per step, no step missing or doubled).

Exit status 0 when identical, 1 when not, 2 on a usage error or a launch that failed. A JSON
report goes to stdout and ``<workdir>/report.json``. Runs on CPU (``DS_ACCELERATOR=cpu`` is set
when no GPU is visible) or GPU; exact equality needs a deterministic setup (fp32 on CPU is).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # works from a checkout without an install too

from llama_train.proc import free_port, kill_session  # noqa: E402
from llama_train.records import (METRICS_FILE, StepRecord, events, iter_records,  # noqa: E402
                                 read_metrics, step_records)


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if "DS_ACCELERATOR" not in env:
        try:
            import torch

            env["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            env["DS_ACCELERATOR"] = "cpu"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


class Job:
    """One launch of the training job in its own process group (so a kill reaches every rank)."""

    def __init__(self, launcher: List[str], overrides: List[str], out: Path, log: Path):
        self.cmd = [*launcher, *overrides, f"trainer.output_dir={out}"]
        self.log = log
        self.fh = open(log, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=_env(), stdout=self.fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        kill_session(self.proc)
        self.fh.close()

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise SystemExit(f"fault_inject: {self.cmd} ran past {timeout}s; see {self.log}")
        self.kill()  # nothing of it may survive
        return rc


def logged_losses(out: Path) -> Dict[int, object]:
    """{step: loss} from metrics.jsonl (training lines only, a line cut by the kill ignored)."""
    path = out / METRICS_FILE
    rows: Dict[int, object] = {}
    for r in (iter_records(path) if path.exists() else ()):
        if isinstance(r, StepRecord) and "loss" in r:
            if r.step in rows:
                rows[-r.step] = "DUPLICATE"  # reported as a difference
            rows[r.step] = r["loss"]
    return rows


def _tmp_saves(out: Path) -> set:
    """Partial saves present now, as (name, inode): a save redone under the same name is new."""
    root = out / "checkpoints"
    found = set()
    for p in (root.glob(".tmp-step_*") if root.is_dir() else []):
        try:
            found.add((p.name, p.stat().st_ino))
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return found


def _last_step_time(out: Path) -> float:
    path = out / METRICS_FILE
    records = read_metrics(path) if path.exists() else []
    times = [r.number("step_time_s") for r in step_records(records, "step_time_s")]
    return times[-1] if times else 0.1


def _save_seconds(out: Path) -> float:
    path = out / METRICS_FILE
    secs = [r.number("seconds") for r in events(read_metrics(path) if path.exists() else [],
                                                "checkpoint") if r.number("seconds") is not None]
    return sorted(secs)[len(secs) // 2] if secs else 0.2


_RUNNING: List[Job] = []  # killed if the drill itself is interrupted


def run_trial(i: int, trials_left: int, mode: str, rng: random.Random, launcher, overrides,
              out: Path, workdir: Path, max_steps: int, timeout: float) -> Dict[str, object]:
    before = max(logged_losses(out), default=0)
    stale = set(_tmp_saves(out))
    job = Job(launcher, overrides, out, workdir / f"trial-{i:03d}.log")
    _RUNNING[:] = [job]
    t0 = time.monotonic()
    landed, target, delay = None, None, 0.0
    if mode == "step":  # spread the remaining kills over the remaining steps
        span = max(1, (max_steps - 1 - before) // max(1, trials_left))
        target = before + rng.randint(1, span)
    while job.running() and time.monotonic() - t0 < timeout:
        if mode == "save":
            if _tmp_saves(out) - stale:
                delay = rng.uniform(0, 0.8) * _save_seconds(out)
                time.sleep(delay)
                landed = "save"
                break
        elif max(logged_losses(out), default=0) >= target:
            delay = rng.uniform(0, 1.0) * _last_step_time(out)  # somewhere in the next step
            time.sleep(delay)
            landed = "step"
            break
        time.sleep(0.003 if mode == "save" else 0.02)
    was_running = job.running()
    saving = bool(_tmp_saves(out) - stale)
    job.kill()
    return {"trial": i, "mode": mode, "landed": landed if was_running else None,
            "killed_while_running": was_running, "target_step": target,
            "delay_s": round(delay, 4), "last_step_logged_before": before,
            "last_step_logged_at_kill": max(logged_losses(out), default=0),
            "partial_save_left": saving, "seconds": round(time.monotonic() - t0, 2),
            "log": str(job.log)}


def compare(ref: Path, out: Path) -> Dict[str, object]:
    import torch

    from llama_train.checkpoint import find_latest, load_consolidated, read_state

    a, b = logged_losses(ref), logged_losses(out)
    diff_steps = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    ref_ckpt, _ = find_latest(ref / "checkpoints")
    out_ckpt, _ = find_latest(out / "checkpoints")
    result: Dict[str, object] = {"steps_compared": len(a), "loss_steps_differing": diff_steps,
                                 "reference_checkpoint": str(ref_ckpt),
                                 "faulted_checkpoint": str(out_ckpt)}
    if ref_ckpt is None or out_ckpt is None or ref_ckpt.name != out_ckpt.name:
        result["weights_identical"] = False
        return result
    _, sa, _ = load_consolidated(str(ref_ckpt))
    _, sb, _ = load_consolidated(str(out_ckpt))
    worst = 0.0
    same = sa.keys() == sb.keys()
    for k in sa:
        if k in sb:
            if not torch.equal(sa[k], sb[k]):
                same = False
                worst = max(worst, (sa[k] - sb[k]).abs().max().item())
    ra, rb = read_state(ref_ckpt), read_state(out_ckpt)
    keys = ("step", "tokens", "skipped_steps", "rollbacks", "skip_windows")
    result.update(weights_identical=same, max_weight_diff=worst, tensors=len(sa),
                  state_identical=all(ra.get(k) == rb.get(k) for k in keys)
                  and ra["data"]["consumed_samples"] == rb["data"]["consumed_samples"])
    return result


def run_to_end(what: str, launcher: List[str], overrides: List[str], out: Path, log: Path,
               timeout: float) -> bool:
    """One uninterrupted launch; False (and a message naming its log) when it fails."""
    job = Job(launcher, overrides, out, log)
    _RUNNING[:] = [job]
    rc = job.wait(timeout)
    if rc != 0:
        print(f"fault_inject: {what} failed (exit {rc}); see {log}", file=sys.stderr)
    return rc == 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5, help="kills, each followed by a resume")
    p.add_argument("--nprocs", type=int, default=2, help="ranks (deepspeed --num_gpus)")
    p.add_argument("--workdir", type=Path, required=True, help="reference/, faulted/, logs")
    p.add_argument("--reference", type=Path,
                   help="output_dir of an uninterrupted run with the same overrides (skip step 1)")
    p.add_argument("--launcher", help="launcher command the overrides are appended to "
                   "(default: deepspeed --num_gpus N --master_port <free> --module "
                   "llama_train.train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("overrides", nargs="*", help="llama-train overrides (after --)")
    a = p.parse_args(argv)
    bad = [o for o in a.overrides if o.split("=")[0].lstrip("+") in
           ("trainer.output_dir", "trainer.resume")]
    if bad:
        p.error(f"{bad}: the drill sets trainer.output_dir itself and always resumes (auto)")
    if a.trials < 1:
        p.error("--trials must be >= 1")
    launcher = (shlex.split(a.launcher) if a.launcher else
                [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(a.nprocs),
                 "--master_port", str(free_port()), "--module", "llama_train.train"])
    a.workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    t_start = time.monotonic()

    ref = a.reference
    if ref is None:
        ref = a.workdir / "reference"
        if not run_to_end("the reference run", launcher, a.overrides, ref,
                          a.workdir / "reference.log", a.timeout):
            return 2
    max_steps = max(logged_losses(ref), default=0)
    if max_steps < 2:
        print(f"fault_inject: {ref}/metrics.jsonl has no training steps", file=sys.stderr)
        return 2

    if max_steps < 2 * a.trials:
        print(f"fault_inject: warning: {max_steps} steps for {a.trials} kills; late trials may "
              f"find the run finished (use trainer.max_steps >= {2 * a.trials})", file=sys.stderr)
    out = a.workdir / "faulted"
    trials = []
    for i in range(1, a.trials + 1):
        mode = "save" if i % 2 else "step"
        trial = run_trial(i, a.trials - i + 1, mode, rng, launcher, a.overrides, out, a.workdir,
                          max_steps, a.timeout)
        trials.append(trial)
        print(json.dumps(trial), file=sys.stderr, flush=True)
    if not run_to_end("the final resume", launcher, a.overrides, out, a.workdir / "final.log",
                      a.timeout):
        return 2
    result = compare(ref, out)
    identical = (not result["loss_steps_differing"] and result.get("weights_identical", False)
                 and result.get("state_identical", False))
    report = {"identical": identical, "trials": len(trials),
              "kills_in_step": sum(t["landed"] == "step" for t in trials),
              "kills_in_save": sum(t["landed"] == "save" for t in trials),
              "kills_missed": sum(t["landed"] is None for t in trials),
              "partial_saves_left_by_kills": sum(t["partial_save_left"] for t in trials),
              "seconds": round(time.monotonic() - t_start, 1), "comparison": result,
              "overrides": a.overrides, "trial_details": trials}
    (a.workdir / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if identical else 1


def _interrupted(signum, _frame):
    for job in _RUNNING:  # never leave a job of ours running
        job.kill()
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    sys.exit(main())
