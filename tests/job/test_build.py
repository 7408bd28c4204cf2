"""One build (issue 57): the job's parts built once by llama_train.job.build (resolve_job ->
build_job -> Components), the Trainer driving them; a simulated rank as a component choice
(llama_train.job.simulation's NoSimulation / SimulationReport); the files rank 0 alone writes in one
component (llama_train.job.run_files.RunFiles).

In this process on one rank (the fast tier)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import cfg_for

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one

PARTS = ["hooks", "ckpts", "resume", "run_config", "precision", "simulation", "seq_mpu",
         "engine", "module", "loader", "tracker", "state", "recovery", "fpt", "peak", "files"]


def test_build_job_makes_every_part_and_the_trainer_drives_them(tmp_path):
    from llama_train.checkpoint import CheckpointManager
    from llama_train.data import TrainLoader
    from llama_train.hooks import Hook
    from llama_train.job.build import Components, Resolved, build_job, resolve_job
    from llama_train.job.faults import FaultInjector
    from llama_train.job.preflight import preflight
    from llama_train.job.recovery import Recovery
    from llama_train.job.run_files import RunFiles
    from llama_train.job.simulation import NoSimulation, SimulationReport
    from llama_train.job.train_module import TrainModule
    from llama_train.job.trainer import Trainer, TrainState
    from llama_train.metrics.tracking import Tracker

    out = tmp_path / "run"
    mine = Hook()
    pre = preflight(cfg_for(out, "trainer.max_steps=2", "trainer.save_every=2",
                            "sample.tokens=4"))
    try:
        job = resolve_job(pre, [mine])
        assert isinstance(job, Resolved) and job.resume is None  # a fresh start
        assert isinstance(job.hooks[0], FaultInjector) and job.hooks[1] is mine
        assert not (out / "config.yaml").exists()  # nothing of the run's own files yet
        parts = build_job(pre, job)
        assert isinstance(parts, Components)
        assert [f.name for f in dataclasses.fields(Components)] == PARTS
        assert parts.hooks is job.hooks and parts.ckpts is job.ckpts
        assert isinstance(parts.ckpts, CheckpointManager) and isinstance(parts.loader, TrainLoader)
        assert isinstance(parts.module, TrainModule) and isinstance(parts.tracker, Tracker)
        assert isinstance(parts.state, TrainState) and parts.state.step == 0
        assert isinstance(parts.recovery, Recovery) and isinstance(parts.files, RunFiles)
        assert type(parts.simulation) is NoSimulation  # a real rank
        assert not isinstance(parts.simulation, SimulationReport)
        assert parts.seq_mpu is None  # no parallel.sequence
        assert parts.fpt > 0 and parts.peak.value > 0 and parts.precision
        with pytest.raises(dataclasses.FrozenInstanceError):
            parts.engine = None  # type: ignore[misc]
        assert not (out / "config.yaml").exists()  # written when the run starts, not built
        trainer = Trainer(pre, parts)
        for name in ("engine", "module", "loader", "tracker", "state", "recovery", "ckpts",
                     "files", "simulation", "hooks", "peak"):
            assert getattr(trainer, name) is getattr(parts, name), name
        result = trainer.fit()
    finally:
        pre.release()
    assert result["step"] == 2 and result["sample"] is not None
    assert (out / "config.yaml").is_file() and (out / "sample.txt").is_file()
    info = json.loads((out / "run_info.json").read_text())
    assert info["final_step"] == 2 and info["max_steps"] == 2


def test_the_trainer_builds_nothing_and_its_loop_has_no_simulation_branch():
    """Trainer.__init__ takes the Components; what differs on a simulated rank is the component
    build_job chose (the checkpoint's ``simulated`` entry included: the component's), and the
    rank-0 files are RunFiles'."""
    from llama_train.job import trainer

    params = list(inspect.signature(trainer.Trainer.__init__).parameters)
    assert params == ["self", "pre", "parts"]
    init = inspect.getsource(trainer.Trainer.__init__)
    for built in ("TrainLoader(", "Tracker(", "Recovery(", "TrainModule(", "PeakFlops(",
                  "Simulation(", "init_sequence_parallel", "initialize("):
        assert built not in init, built
    for name, fn in inspect.getmembers(trainer.Trainer, inspect.isfunction):
        src = inspect.getsource(fn)
        for branch in ("self.sim is", "if self.sim", "self.sim.", "rt.simulated", "sim is None",
                       "sim is not None"):
            assert branch not in src, (name, branch)
        assert "rename_losses" not in src and "replace_file" not in src, name
    assert "run_info.json" not in inspect.getsource(trainer.start)


def test_the_simulation_component_renames_and_reports_only_when_simulated():
    from llama_train.job.simulation import NoSimulation, SimulationReport, simulation_of

    real = simulation_of(None)
    assert type(real) is NoSimulation
    metrics = {"loss": 2.0, "val_loss": 3.0, "val_loss/web": 3.5, "lr": 1e-3}
    assert real.metrics(metrics) == metrics and real.final_val_loss(3.0) == 3.0
    assert (real.own_share, real.loss_label, real.val_prefix, real.mfu_note) == (1.0, "loss", "",
                                                                                "")
    assert real.summarizes and real.report(lambda c: pytest.fail("restored"), Path("c")) is None
    assert real.checkpoint_entry() is None  # a real rank's checkpoint is the job's

    seen = []
    sim = SimpleNamespace(rt=SimpleNamespace(world_size=4, rank=3), first_step=0,
                          saved=lambda ckpt: seen.append(ckpt),
                          phase=lambda name: seen.append(name))
    simulated = simulation_of(sim)
    assert isinstance(simulated, SimulationReport) and simulated.sim is sim
    assert simulated.metrics(metrics) == {"rank_loss": 2.0, "rank_val_loss": 3.0,
                                          "rank_val_loss/web": 3.5, "lr": 1e-3}
    assert simulated.final_val_loss(3.0) is None and not simulated.summarizes
    assert simulated.own_share == 0.25 and "1/4" in simulated.mfu_note
    assert simulated.loss_label == "rank_loss (simulated)"
    assert simulated.checkpoint_entry() == {"ranks": 4, "rank": 3}
    simulated.saved(Path("step_2"))
    simulated.phase("save")
    simulated.resumed(6)
    assert seen == [Path("step_2"), "save"] and sim.first_step == 6


RUN_INFO = dict(params={"total": 10}, model_args={"dim": 8}, flop_budget=None, tokens=64,
                global_batch=4, seq_len=16, max_steps=1, flops_per_token=60.0, flops=3840.0,
                peak_flops={"value": 1e12, "source": "test"}, command="llama-train", count=None,
                epoch_tokens=1000)


@pytest.mark.parametrize("lead", [True, False])
def test_run_files_are_written_by_the_lead_rank_alone(tmp_path, lead):
    from llama_train.job.run_files import RunFiles
    from llama_train.records import RunInfo

    out = tmp_path / "out"
    files = RunFiles(str(out), lead, dict(RUN_INFO))
    files.start({"trainer": {"max_steps": 1}})
    files.finish("once upon", 2.5, 1, None)
    if not lead:
        assert not out.exists()  # not even the directory
        return
    assert (out / "config.yaml").read_text() == "trainer:\n  max_steps: 1\n"
    assert (out / "sample.txt").read_text() == "once upon\n"
    assert RunInfo.read(out / "run_info.json") == RunInfo(**RUN_INFO, final_val_loss=2.5,
                                                          final_step=1)
    files.finish(None, None, 1, {"ranks": 2})  # sample.tokens=0: an earlier sample removed
    assert not (out / "sample.txt").exists()
    assert RunInfo.read(out / "run_info.json").simulation == {"ranks": 2}
