"""A hung or killed rank stops the whole job (issue 12, docs/reliability.md).

Through DeepSpeed's runner and launcher (forked from the warm parent, tests/warm_ranks.py: their
own code decides what each rank gets and the job's exit status), 2 CPU ranks, the tiny model,
``comm.timeout_s=10``: one rank is stopped (SIGSTOP: it cannot run at all, as a rank frozen in
the kernel or in a C call) or killed (SIGKILL) once the job has logged step 3, or stops itself
inside an evaluation, half-way through a checkpoint save, or half-way through loading the
checkpoint it resumes. Every case must end with the launcher's exit within
``comm.timeout_s + 30`` s of the stop, and a survivor's line naming the lost rank and its step.
A stopped rank ends with exit status 5 (the survivor's); a killed one with the launcher's status
for the killed rank (it reports the first rank it finds dead, and that is the killed one).

Cases run a few at a time, in one pool with the second test's job, the longest first (CI time:
each waits ``comm.timeout_s`` mostly idle). The default set covers every ZeRO stage once, SIGSTOP
of rank 1 (the survivor sees its heartbeat stop) and SIGKILL of rank 0 (the survivor loses the
store's host) each at two stages, plus eval, save and load; ``LLAMA_TRAIN_HANG_MATRIX=full`` runs
all 16 stage x signal x rank combinations (and the three phase cases).
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import pytest

from helpers import (BIN, TINY, WORKERS, dump_stacks, free_port, launcher_cmd, rank_pid, spawn,
                     tail, train, wait_for)
from llama_train.records import parse_line

TIMEOUT_S = 10
BUDGET_S = TIMEOUT_S + 30
PARALLEL = int(os.environ.get("LLAMA_TRAIN_HANG_PARALLEL", "4"))
WORKER = WORKERS / "hang_worker.py"


@dataclass(frozen=True)
class Case:
    stage: int
    how: str  # stop | kill
    rank: int  # the rank stopped or killed
    phase: str = "train"  # train: by the test after step 3; eval | save | load: by the rank itself

    @property
    def name(self) -> str:
        return f"zero{self.stage}-{self.how}-rank{self.rank}-{self.phase}"


PHASES = [Case(2, "stop", 1, "eval"), Case(3, "stop", 0, "save"), Case(2, "stop", 1, "load")]
# each ZeRO stage once, each signal at two stages (SIGSTOP of rank 1, SIGKILL of rank 0), and
# the three phases: 7 cases, two waves of PARALLEL (the 16-case matrix: LLAMA_TRAIN_HANG_MATRIX)
DEFAULT = [Case(0, "stop", 1), Case(1, "kill", 0), Case(2, "kill", 0), Case(3, "stop", 1),
           *PHASES]
FULL = [Case(s, how, r) for s in range(4) for how in ("stop", "kill") for r in (0, 1)] + PHASES


def _cases():
    cases = FULL if os.environ.get("LLAMA_TRAIN_HANG_MATRIX") == "full" else DEFAULT
    only = os.environ.get("LLAMA_TRAIN_HANG_ONLY")  # e.g. "zero2-stop" while debugging
    return [c for c in cases if not only or only in c.name]


def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        r = parse_line(line)  # None: a line being written
        if r is not None:
            steps.append(int(r.step))
    return max(steps)


def _stopped(pid: Optional[int]) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _run(case: Case, work: Path) -> dict:
    out = work / case.name
    out.mkdir(parents=True)
    log = work / f"{case.name}.log"
    overrides = [*TINY, f"trainer.output_dir={out}", f"deepspeed.zero_stage={case.stage}",
                 f"comm.timeout_s={TIMEOUT_S}", "trainer.max_steps=100000"]
    env = {}
    if case.phase == "load":  # a checkpoint of step 3 to resume
        train(out, [f"deepspeed.zero_stage={case.stage}", "trainer.max_steps=3",
                    "trainer.save_every=3"], log_name="first.log")
    elif case.phase != "train":
        overrides += [f"trainer.{case.phase}_every=3"]
    if case.phase != "train":
        env["HANG_WORKER_STOP"] = f"{case.phase}:{case.rank}:3"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(WORKER), *overrides]
    res = {"case": case.name}
    with spawn(cmd, log, env, warm=True) as proc:
        if case.phase == "train":
            if not wait_for(lambda: _last_step(out) >= 3 or proc.poll() is not None, 300, 0.05):
                return {**res, "error": "step 3 never logged\n" + tail(log)}
            pid = rank_pid(proc.pid, case.rank)
            if pid is None or proc.poll() is not None:
                return {**res, "error": f"no rank {case.rank} to stop\n" + tail(log)}
            os.kill(pid, signal.SIGSTOP if case.how == "stop" else signal.SIGKILL)
        else:  # the rank stops itself: time from when it is seen stopped
            if not wait_for(lambda: _stopped(rank_pid(proc.pid, case.rank))
                            or proc.poll() is not None, 300, 0.05):
                return {**res, "error": "the rank never stopped itself\n" + tail(log)}
            if proc.poll() is not None:
                return {**res, "error": "the job ended before the stop\n" + tail(log)}
        t0 = time.monotonic()
        res["at_step"] = _last_step(out)
        try:
            res["rc"] = proc.wait(timeout=BUDGET_S + 60)
        except Exception:  # noqa: BLE001 - still hung: spawn kills it
            res["rc"] = None
        res["seconds"] = round(time.monotonic() - t0, 1)
    res["log"] = log.read_text(errors="replace")
    return res


def _named(case: Case, text: str) -> Optional[int]:
    """The step at which a survivor's exit line names the lost rank (None if no such line)."""
    r = case.rank
    for pattern in (rf"rank {r} last reported step (\d+) \(\w+\).*Rank {r} is hung or gone",
                    rf"lost contact with the job at step (\d+): rank\(s\) {r} did not check in",
                    rf"lost contact with the job at step (\d+): .*rank 0, which hosts it, is gone"
                    if r == 0 else r"$^"):
        m = re.search(pattern, text)
        if m:
            return int(m.group(1))
    return None


def _stuck_loop(work: Path) -> dict:
    """The job of test_a_stuck_loop_with_a_live_heartbeat_is_named_and_shows_where: rank 1's loop
    sleeps as step 4 begins (``LLAMA_TRAIN_FAULTS=hang``); once it is stuck, SIGUSR1 to every
    rank and data worker."""
    out, log = work / STUCK, work / f"{STUCK}.log"
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", "deepspeed.zero_stage=2",
                        f"comm.timeout_s={TIMEOUT_S}", "trainer.max_steps=100000"])
    res = {"log_path": log}
    with spawn(cmd, log, {"LLAMA_TRAIN_FAULTS": "hang:step=4,rank=1"}, warm=True) as proc:
        if not wait_for(lambda: _last_step(out) >= 3 or proc.poll() is not None, 300, 0.05):
            return {"error": "step 3 never logged\n" + tail(log)}
        t0 = time.monotonic()
        time.sleep(1.0)  # rank 1 is in the fault's sleep
        res["asked"] = dump_stacks(proc, wait_s=0)
        try:
            res["rc"] = proc.wait(timeout=BUDGET_S + 60)
        except Exception:  # noqa: BLE001 - still running: spawn kills it
            res["rc"] = None
        res["seconds"] = time.monotonic() - t0
    res["log"] = log.read_text(errors="replace")
    return res


STUCK = "zero2-hang-rank1-train"  # the stuck loop's job


def _longest_first(job) -> int:
    """The jobs that take longest start first: the load case trains its checkpoint before its
    own launch; the stuck loop and the SIGSTOPs wait out a timeout; a SIGKILL is seen at once."""
    if job == STUCK:
        return 2
    return 3 if job.phase == "load" else 1 if job.how == "stop" else 0


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict:
    """The launched jobs of this module's selected tests, all in one pool, PARALLEL at a time
    (each waits a timeout mostly idle): job name -> its result."""
    selected = {item.originalname for item in request.session.items
                if item.module is request.module}
    todo = []
    if "test_a_hung_or_killed_rank_stops_the_job" in selected:
        todo += _cases()
    if "test_a_stuck_loop_with_a_live_heartbeat_is_named_and_shows_where" in selected:
        todo.append(STUCK)
    todo.sort(key=_longest_first, reverse=True)
    work = tmp_path_factory.mktemp("hang")
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = pool.map(lambda job: _stuck_loop(work) if job == STUCK else _run(job, work),
                           todo)
        return {(job if job == STUCK else job.name): res for job, res in zip(todo, results)}


@pytest.mark.slow
def test_a_hung_or_killed_rank_stops_the_job(jobs):
    cases = _cases()
    problems, rows = [], []
    for case in cases:
        res = jobs[case.name]
        if "error" in res:
            problems.append(f"{case.name}: {res['error']}")
            continue
        text, rc, secs = res["log"], res["rc"], res["seconds"]
        step = _named(case, text)
        rows.append(f"{case.name:28s} exit {rc}  {secs:5.1f}s  named step {step} "
                    f"(logged step {res['at_step']} at the stop)")
        wrong = []
        if rc is None or secs > BUDGET_S:
            wrong.append(f"exit {rc} after {secs}s (budget {BUDGET_S}s)")
        if case.how == "stop" and rc != 5:
            wrong.append(f"exit status {rc}, want 5")
        if case.how == "kill" and rc not in (5, 256 - 9):
            wrong.append(f"exit status {rc}, want 5 or the killed rank's")
        if step is None:
            wrong.append(f"no line names rank {case.rank} and a step")
        elif case.phase != "train" and step != 3:
            wrong.append(f"named step {step}, the rank stopped in {case.phase} of step 3")
        # the heartbeat thread publishes a new position at most every MIN_GAP_S, and rank 0 logs
        # a step once that step's collective is done: under load the stopped rank's last
        # published step may be the one before the logged one
        elif not res["at_step"] - 1 <= step <= res["at_step"] + 2:
            wrong.append(f"named step {step}, the job had logged step {res['at_step']}")
        if case.phase != "train" and f"last reported step 3 ({case.phase})" not in text:
            wrong.append(f"the line does not say the rank stopped in {case.phase}")
        # the lost rank itself may print one if it runs again (the launcher's SIGTERM is
        # delivered once it is killed or continued); every other rank must exit cleanly
        if any("Traceback" in line and not line.startswith(f"[rank{case.rank}]")
               for line in text.splitlines()):
            wrong.append("a traceback in the log")
        if wrong:
            problems.append(f"{case.name}: {'; '.join(wrong)}\n" + "\n".join(
                text.splitlines()[-25:]))
    print("\n" + "\n".join(rows))
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
def test_a_stuck_loop_with_a_live_heartbeat_is_named_and_shows_where(jobs):
    """A rank whose loop stops while its threads run on (``LLAMA_TRAIN_FAULTS=hang``: rank 1
    sleeps as step 4 begins) keeps its heartbeat, so its watchdog peers see nothing: the
    collective timeout (``comm.timeout_s`` + 5) fails rank 0, which names rank 1 (it did not
    check in) and posts the job's abort; rank 1 reads it, prints its threads (the loop inside
    the fault's sleep) and exits 5: 19.6 s from step 3 to the launcher's exit on the dev VM.
    Without the abort rank 1 ran on until its watchdog found rank 0's store gone, comm.timeout_s
    later (38.3 s, and its line blamed rank 0); at the default comm.timeout_s=600 the launcher's
    SIGKILL, 30 s after its SIGTERM, comes first and rank 1 prints nothing.

    While it is stuck, SIGUSR1 to each rank and data worker (what tests/helpers.run sends a job
    that outlives its limit) prints their stacks and nothing else changes.

    Its job runs in the module's pool, beside test_a_hung_or_killed_rank_stops_the_job's."""
    res = jobs[STUCK]
    assert "error" not in res, res.get("error")
    rc, seconds, asked, text = res["rc"], res["seconds"], res["asked"], res["log"]
    log = res["log_path"]
    print(f"\nhang:step=4,rank=1: exit {rc} {seconds:.1f} s after step 3 was logged")
    assert rc == 5, (rc, tail(log, 200))
    assert re.search(r"lost contact with the job at step \d+: rank\(s\) 1 did not check in",
                     text), tail(log, 200)
    assert "rank 1 stops (at step" in text and "because another rank did" in text, tail(log, 200)
    assert asked >= 2 and text.count("Current thread 0x") >= asked + 1, (asked, tail(log, 300))
    dump = text[text.index("--- rank 1's threads as it stops"):]
    assert "in _stall" in dump and "in on_step_begin" in dump and "in fit" in dump, dump
    # the collective timeout (15 s), 3 s of diagnosis, rank 1's next read of the store (1 s)
    assert seconds < TIMEOUT_S + 20, (seconds, tail(log, 200))
