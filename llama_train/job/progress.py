"""The pace the console reports: the log interval's throughput (:class:`Interval`) and the
step line's timing and ETA (:class:`Progress`)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List

from llama_train.job.summary import duration


class Interval:
    """Throughput over the log interval: training tokens over the wall time since the last
    logged step (evaluations and saves in between included, as anyone recomputing it from the
    records' ``time`` would), the median step time and the summed data wait of its steps. One
    step's figure is not the interval's: a 5-step interval of 1,024-token steps at 3.9 s read
    6,724 tok/s from its last step, ~1,300 in fact."""

    def __init__(self, tokens: int):
        self.reset(tokens)

    def reset(self, tokens: int) -> None:
        self.t0, self.tokens0 = time.perf_counter(), tokens
        self.step_s: List[float] = []
        self.wait_s = 0.0

    def add(self, out: Any) -> None:  # the trainer's StepOutput
        self.step_s.append(out.seconds)
        self.wait_s += out.batch.data_wait_s

    def peek(self, tokens: int) -> Dict[str, float]:
        """The interval so far, left open: a console line between records."""
        wall = time.perf_counter() - self.t0
        return {"tokens_per_s": (tokens - self.tokens0) / wall,
                "step_time_s": statistics.median(self.step_s), "data_wait_s": self.wait_s,
                "interval_s": wall, "interval_steps": len(self.step_s)}

    def take(self, tokens: int) -> Dict[str, float]:
        figures = self.peek(tokens)
        self.reset(tokens)
        return figures


# Between records (trainer.log_every) the console's step line comes at least this often, in
# seconds of wall time: with 20 s steps and log_every=10 a run said nothing for 200 s. Such a
# line is not a record: metrics.jsonl still holds every log_every-th step.
CONSOLE_EVERY_S = 30.0
# The ETA leaves out each start's first steps: the first holds compilation and DeepSpeed's
# first-step set-up (step 1's ETA was 60% too long), the second ZeRO-3's first trace.
ETA_SKIP_STEPS = 2


class Progress:
    """The pace the console reports: when a step line is due between records, the ETA (wall
    time per step after this start's first ETA_SKIP_STEPS steps, evaluations and saves
    included) and the seconds spent in steps (the end-of-run throughput)."""

    def __init__(self, step: int, max_steps: int):
        self.t0 = self.last_line = time.perf_counter()
        self.first_step, self.max_steps = step, max_steps
        # a start of a few steps: fewer left out, so that it still gets an ETA
        self.skip = min(ETA_SKIP_STEPS, max(0, max_steps - step - 2))
        self.mark = (self.t0, step) if self.skip == 0 else None  # (time, step) it counts from
        self.step_s, self.steps = 0.0, 0

    def step_done(self, step: int, seconds: float) -> None:
        self.step_s += seconds
        self.steps += 1
        if self.skip and step == self.first_step + self.skip:  # again if a rollback replays it
            self.mark = (time.perf_counter(), step)

    def line_due(self) -> bool:
        return time.perf_counter() - self.last_line >= CONSOLE_EVERY_S

    def eta(self, step: int) -> str:
        if step >= self.max_steps:
            return duration(0)
        if self.mark is None or step <= self.mark[1]:
            return f"after step {(self.mark[1] if self.mark else self.first_step + self.skip) + 1}"
        t0, step0 = self.mark
        return duration((time.perf_counter() - t0) / (step - step0) * (self.max_steps - step))
