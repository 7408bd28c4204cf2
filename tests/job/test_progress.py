"""A first day without long silences (issue 53, item 4): the step line on wall time between
records, an ETA without the first steps' overhead, the run's mean throughput at its end.

In this process on one rank (the fast tier): slow steps are real ones, made by the faults
mechanism (``hang:step=N,seconds=S`` stalls the loop as step N begins).
"""

from __future__ import annotations

import re

import pytest

from helpers import cfg_for, step_rows
from llama_train.job import progress
from llama_train.train import train

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one

STEP_LINE = re.compile(r"step +(\d+)/(\d+) \|.*\| (\d+) steps in [\d.]+s .*\| eta (.*)$")


def _step_lines(err: str):
    """{step: (steps in the interval, eta)} of the console's step lines."""
    found = (STEP_LINE.search(line) for line in err.splitlines())
    return {int(m[1]): (int(m[3]), m[4].strip()) for m in found if m}


def _seconds(eta: str) -> int:
    m, s = eta.split(":")[-2:]
    return int(m) * 60 + int(s)


def test_the_step_line_comes_on_wall_time_between_records(tmp_path, capfd, faults, monkeypatch):
    """log_every larger than the run: only steps 1 and 5 are records, but slow steps (0.3 s
    stalls, a line due every 0.25 s here; 30 s in a run) each get a console line, with the
    interval's figures so far. metrics.jsonl is what it was."""
    monkeypatch.setattr(progress, "CONSOLE_EVERY_S", 0.25)
    faults(";".join(f"hang:step={k},seconds=0.3" for k in (2, 3, 4, 5)))
    out = tmp_path / "slow"
    train(cfg_for(out, "trainer.max_steps=5", "trainer.log_every=100", "trainer.save_every=100",
                  "tracking.console=true"))
    lines = _step_lines(capfd.readouterr().err)
    assert sorted(lines) == [1, 2, 3, 4, 5], lines
    assert [lines[k][0] for k in (2, 3, 4, 5)] == [1, 2, 3, 4]  # steps since the record of 1
    logged = step_rows(out)
    assert sorted(logged) == [1, 5] and logged[5]["interval_steps"] == 4


def test_the_eta_leaves_out_the_first_steps_and_the_end_gives_the_mean_throughput(
        tmp_path, capfd, faults):
    """A first step 3 s late (compilation, say): step 3's ETA is from step 3's own pace, not
    (3 s + 3 steps) / 3 per step as it was; steps 1-2 say when an ETA comes. The end of the run
    gives the mean tokens/s and MFU over this start and over its steps alone."""
    faults("hang:step=1,seconds=3")
    out = tmp_path / "eta"
    train(cfg_for(out, "trainer.max_steps=6", "trainer.log_every=1", "trainer.save_every=100",
                  "tracking.console=true"))
    err = capfd.readouterr().err
    lines = _step_lines(err)
    assert lines[1][1] == lines[2][1] == "after step 3", lines
    # 3 steps left at step 3's own pace (its record's interval); it was the wall time so far,
    # stall included: 3 s + 3 steps at least
    step3 = step_rows(out)[3]["interval_s"]
    assert abs(_seconds(lines[3][1]) - 3 * step3) <= 1, (lines, step3)
    assert lines[6][1] == "0:00"
    m = re.search(r"throughput: ([\d,]+) tok/s, MFU ([\d.e+-]+)% over this start's (\d+:\d+); "
                  r"([\d,]+) tok/s, MFU ([\d.e+-]+)% in its 6 steps alone", err)
    assert m, err[-2000:]
    wall_tps, step_tps = (float(m[k].replace(",", "")) for k in (1, 4))
    assert wall_tps * 3 < 6 * 4 * 64 and step_tps > wall_tps  # the stall is in the wall time
    assert float(m[2]) > 0 and float(m[5]) / float(m[2]) == pytest.approx(step_tps / wall_tps,
                                                                          rel=0.02)
    assert err.index("run complete:") < err.index("throughput:")
