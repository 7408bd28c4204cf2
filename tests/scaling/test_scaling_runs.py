"""Scaling meets training: experiment configs, an IsoFLOP multirun, and model-info's memory
against the optimizer state DeepSpeed really holds."""

from __future__ import annotations

import json
import math
import sys

import pytest

from helpers import REPO, TINY, WORKERS, compose_cfg, launcher_cmd, run
from llama_train.config import resolve_batch
from llama_train.job.preflight import plan_experiment
from llama_train.records import RunInfo
from llama_train.scaling import compute_optimal, inference_optimal


@pytest.mark.parametrize("experiment,extra", [
    ("compute_optimal", []),
    ("inference_optimal", ["scaling.inference_tokens=1e9"]),
])
def test_experiment_sets_shape_and_steps(experiment, extra):
    from llama_train.model import count_params

    given = compose_cfg([f"experiment={experiment}", "scaling.flops=3e14", "model.vocab_size=2048",
                  *extra])
    cfg, exp = plan_experiment(given, 1)
    assert given.trainer.max_steps != cfg.trainer.max_steps  # the plan is a new config
    assert exp.max_steps == cfg.trainer.max_steps and exp.model == cfg.model
    plan = (compute_optimal(3e14) if experiment == "compute_optimal"  # each with its yaml's fit
            else inference_optimal(3e14, 1e9, fit="sardana"))
    n = count_params(cfg.model)[cfg.scaling.count]  # the yaml's: non_embedding at CPU scale
    assert abs(n - plan["n_params"]) / plan["n_params"] < cfg.scaling.tolerance
    assert exp.shape_params == n  # D is sized for the built shape (tests/scaling/test_scaling.py)
    tokens_per_step = resolve_batch(cfg.trainer, 1).tokens_per_step
    assert cfg.trainer.max_steps == math.ceil(exp.n_tokens / tokens_per_step)
    assert cfg.optim.warmup_steps <= cfg.trainer.max_steps


def test_inference_optimal_is_smaller_and_longer():
    co, io = compose_cfg(["experiment=compute_optimal", "scaling.flops=3e14"]), \
        compose_cfg(["experiment=inference_optimal", "scaling.flops=3e14",
              "scaling.inference_tokens=1e10"])
    (co, _), (io, _) = plan_experiment(co, 1), plan_experiment(io, 1)
    from llama_train.model import count_params

    assert count_params(io.model)["total"] < count_params(co.model)["total"]
    assert io.trainer.max_steps > co.trainer.max_steps


@pytest.mark.slow
def test_isoflop_multirun_and_fit(tmp_path):
    """`llama-train --multirun` over two sizes at one budget, then `llama-plan fit` reads it."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "llama_train.train", "--multirun", "experiment=isoflop",
           *[o for o in TINY if not o.startswith(("model=", "trainer.max_steps"))],
           "model.vocab_size=2048", "scaling.flops=2e10", "scaling.params=5e5,1e6",
           f"trainer.output_dir='{sweep}/C${{sci:${{scaling.flops}}}}-N${{sci:${{scaling.params}}}}'",
           f"hydra.sweep.dir={tmp_path / 'hydra'}"]
    run(cmd, tmp_path / "sweep.log", timeout=600, warm=True)
    assert sorted(p.name for p in sweep.iterdir()) == ["C2e10-N1e6", "C2e10-N5e5"]
    infos = [RunInfo.read(p) for p in sorted(sweep.glob("*/run_info.json"))]
    assert len(infos) == 2
    assert all(i.final_val_loss and i.flop_budget == 2e10 for i in infos)
    # the count the budget was planned on, and one epoch of the train split (for the fit)
    assert all(i.count == "total" and i.epoch_tokens > 0 for i in infos)
    for i in infos:  # each point trains about C / (6 N) tokens
        assert abs(i.tokens - 2e10 / (6 * i.params["total"])) / i.tokens < 0.2
    # each point records its own command (its own scaling.params), to rerun it alone
    import re
    import shlex

    for i in infos:
        c = i.command
        assert c.startswith("llama-train ") and "experiment=isoflop" in c, c
        assert len(re.findall(r"scaling\.params=", c)) == 1 and shlex.split(c)  # one value
    assert sorted(float(re.search(r"scaling\.params=([0-9.e+]+)", i.command).group(1))
                  for i in infos) == [5e5, 1e6]
    import subprocess

    out = subprocess.run([sys.executable, "-m", "llama_train.scaling", "fit", str(sweep),
                          "--json", "--out", str(tmp_path / "fit.png")],
                         capture_output=True, text=True, cwd=REPO)
    # two points cannot determine five constants: the fitter reads both runs and says so
    assert out.returncode == 2 and "2 usable run(s)" in out.stderr, out.stderr


@pytest.mark.slow
def test_model_info_matches_deepspeed_optimizer_bytes(tmp_path):
    log = tmp_path / "zero_memory.log"
    cmd = launcher_cmd([], nprocs=2)
    i = cmd.index("--module")
    cmd = cmd[:i] + [str(WORKERS / "zero_memory_worker.py")]
    run(cmd, log, timeout=300, warm=True)
    # both ranks print to one stream, so their lines can interleave: pick the objects out
    import re

    rows = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", log.read_text()) if '"stage"' in m]
    assert {(r["rank"], r["stage"]) for r in rows} == {(r, s) for r in (0, 1) for s in (1, 2, 3)}
    for r in rows:
        assert abs(r["measured"] - r["analytic"]) / r["analytic"] < 0.10, r
