"""One plan (issue 57): :class:`llama_train.layout.ParallelLayout`, the one place the data-parallel
size and a rank's coordinates come from, and :func:`llama_train.job.plan.plan_job`, the one place a
config becomes a job, which preflight (and so the trainer), the dry run, ``--cfg job`` and a
--multirun sweep's check all ask. Fast: no launcher; the trainer on a world of one.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import replace

import pytest

from helpers import TINY, cfg_for, compose_cfg, launch_vars_restored, tiny_prepared, world_of_one
from llama_train.config import BatchPlan, ConfigError, parallel_layout, validate
from llama_train.engine import Runtime
from llama_train.job.plan import JobPlan, plan_job
from llama_train.layout import ParallelLayout


# -- the layout ------------------------------------------------------------------------------------
def test_four_ranks_two_per_sequence():
    """World 4, parallel.sequence=2: two replicas of two ranks, as the trainer divided before
    (data-parallel rank = rank // N) and as DeepSpeed's groups are cut ([0, 1], [2, 3])."""
    got = [ParallelLayout(4, r, 2) for r in range(4)]
    assert [(lay.data_parallel, lay.dp_rank, lay.sp_rank) for lay in got] == [
        (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
    assert [lay.dp_rank for lay in got] == [r // 2 for r in range(4)]  # the trainer's old rule
    assert [list(lay.sequence_group) for lay in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    one = ParallelLayout(4, 3)  # no sequence parallelism: every rank its own replica
    assert (one.data_parallel, one.dp_rank, one.sp_rank, list(one.sequence_group)) == (4, 3, 0, [3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        got[0].rank = 1
    for bad in ((3, 0, 2), (4, 4, 2), (0, 0, 1), (4, 0, 0)):
        with pytest.raises(ValueError, match="no such layout"):
            ParallelLayout(*bad)


def test_the_layout_is_deepspeeds_sequence_groups(monkeypatch):
    """DeepSpeed's own ``initialize_sequence_parallel`` (which engine.init_sequence_parallel
    calls), run for each rank of 4 against a stand-in for its comm module, makes the groups and
    group ranks the layout says: the slice a rank trains and the replica whose data it reads."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    from llama_train.engine import sequence_rank

    world, n = 4, 2
    for rank in range(world):
        class Comm:  # torch.distributed's answers for ``rank`` of ``world``; a group: its ranks
            @staticmethod
            def is_initialized():
                return True

            @staticmethod
            def get_world_size(group=None):
                return world if group is None else len(group)

            @staticmethod
            def get_rank(group=None):
                return rank if group is None else list(group).index(rank)

            @staticmethod
            def new_group(ranks):
                return tuple(ranks)

        monkeypatch.setattr(mpu, "dist", Comm)
        monkeypatch.setattr(mpu, "_SEQUENCE_PARALLEL_GROUP", None)
        monkeypatch.setattr(mpu, "_SEQUENCE_DATA_PARALLEL_GROUP", None)
        mpu.initialize_sequence_parallel(sequence_parallel_size=n)
        layout = ParallelLayout(world, rank, n)
        assert mpu.get_sequence_parallel_group() == tuple(layout.sequence_group), rank
        assert sequence_rank(mpu) == layout.sp_rank, rank
        assert mpu.get_sequence_parallel_world_size() == layout.sequence_parallel
        assert layout.dp_rank == mpu.get_sequence_parallel_group()[0] // n == rank // n


# the refusals word for word as config.data_parallel_size raised them before the layout
FIX = "choose parallel.sequence among the common divisors, or 1 to turn it off"
REFUSED = [
    (3, ["parallel.sequence=2"],
     f"parallel.sequence=2 does not divide the 3 rank(s): each group of 2 ranks shares a "
     f"sequence; {FIX}."),
    (2, ["parallel.sequence=2", "trainer.seq_len=63"],
     f"trainer.seq_len=63 is not divisible by parallel.sequence=2: each of the 2 ranks holds an "
     f"equal slice; {FIX} (or change trainer.seq_len)."),
    (4, ["parallel.sequence=4", "model.n_heads=2", "model.n_kv_heads=null"],
     f"model.n_heads=2 is not divisible by parallel.sequence=4: attention gives each rank "
     f"n_heads / 4 heads; {FIX}."),
    (6, ["parallel.sequence=3", "model.n_heads=6", "model.dim=96", "model.n_kv_heads=2",
         "trainer.seq_len=63"],
     f"model.n_kv_heads=2 and parallel.sequence=3: one must divide the other (each rank takes "
     f"n_kv_heads / 3 key/value heads, or with fewer key/value heads than ranks each is copied "
     f"to 3 // n_kv_heads ranks); {FIX}."),
    (2, ["parallel.sequence=2", "comm.simulate_ranks=8"],
     "parallel.sequence=2 with comm.simulate_ranks: a simulated rank has no peers to exchange "
     "sequence slices with; set parallel.sequence=1 to simulate the data-parallel layout."),
]


@pytest.mark.parametrize("world,overrides,message", REFUSED)
def test_the_layouts_refusals_keep_their_words(world, overrides, message):
    cfg = compose_cfg(["model=tiny", *overrides])
    m = cfg.model
    assert ParallelLayout.refusal(world, cfg.parallel.sequence, seq_len=cfg.trainer.seq_len,
                                  n_heads=m.n_heads, kv_heads=m.kv_heads,
                                  simulated=bool(cfg.comm.simulate_ranks)) == message
    for check in (lambda: parallel_layout(cfg, world), lambda: validate(cfg, world, "cpu"),
                  lambda: plan_job(cfg, Runtime("cpu", 0, 0, world, world), scope="check")):
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == message


def test_the_layout_needs_nothing_heavy():
    """layout.py imports nothing of the package and neither torch nor DeepSpeed: the config
    (which imports no torch) checks layouts with it. (The package's own __init__ brings only
    llama_train._moved, the old paths' import hook: the standard library.)"""
    code = ("import sys, llama_train.layout; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'deepspeed') or m.startswith('llama_train.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['llama_train._moved', 'llama_train.layout']", \
        out.stdout + out.stderr


# -- the plan -------------------------------------------------------------------------------------
def test_plan_job_is_deterministic_and_frozen():
    cfg = compose_cfg(["model=tiny", "parallel.sequence=2", "trainer.micro_batch=2",
                       "trainer.seq_len=64", "trainer.global_batch=8"])
    rt = Runtime("cpu", 3, 1, 4, 2)
    job = plan_job(cfg, rt, scope="check")
    assert isinstance(job, JobPlan) and job == plan_job(cfg, rt, scope="check")
    assert job.layout == ParallelLayout(4, 3, 2) and job.runtime is rt
    assert job.batch == validate(cfg, 4, "cpu") == BatchPlan(2, 2, 2, 8, 64)
    assert job.batch.world_size == job.layout.data_parallel
    assert job.experiment is None and job.resume_candidate is None and job.cfg == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.batch = BatchPlan(1, 1, 1, 1, 64)
    with pytest.raises(ValueError, match="scope='dry'"):
        plan_job(cfg, rt, scope="dry")


def test_a_simulated_ranks_plan(tmp_path):
    """scope="run" (preflight's): a simulated rank's config (no W&B, no sample) and its place in
    the simulated world; the config given is left alone."""
    cfg = cfg_for(tmp_path / "run", "comm.simulate_ranks=4", "comm.simulate_rank=1",
                  "tracking.wandb.mode=offline")
    job = plan_job(cfg, Runtime("cpu", 1, 0, 4, 1, simulated=True))
    assert (job.cfg.sample.tokens, job.cfg.tracking.wandb.mode) == (0, "disabled")
    assert cfg.sample.tokens > 0 and cfg.tracking.wandb.mode != "disabled"
    assert job.layout == ParallelLayout(4, 1) and job.batch.world_size == 4
    assert job.resume_candidate is None  # nothing in the output dir: a fresh start


def _spy(monkeypatch, module, change=None):
    """Wrap ``module.plan_job``: the plans it returned (after ``change``), in order."""
    real, made = module.plan_job, []

    def spy(cfg, rt, scope="run"):
        job = real(cfg, rt, scope)
        if change is not None:
            job = change(job)
        made.append((scope, job))
        return job

    monkeypatch.setattr(module, "plan_job", spy)
    return made


def _accum_7(job: JobPlan) -> JobPlan:
    b = job.batch
    return replace(job, batch=BatchPlan(b.world_size, b.micro_batch, 7,
                                        7 * b.micro_batch * b.world_size, b.seq_len))


def test_the_dry_run_prints_the_plans_batch(tmp_path, monkeypatch, capsys):
    """The dry run's batch line is plan_job's batch: a plan with 7 accumulation steps is what it
    prints. --cfg job prints the plan's config."""
    import llama_train.job.dry_run as dry_run_mod

    tiny_prepared()
    made = _spy(monkeypatch, dry_run_mod, _accum_7)
    with launch_vars_restored():
        dry_run_mod.dry_run(cfg_for(tmp_path / "never"))
    text = capsys.readouterr().out
    [(scope, job)] = made
    b = job.batch
    assert scope == "preview" and b.grad_accum == 7
    assert (f"  batch: 1 rank(s) x micro {b.micro_batch} x accum 7 = {b.global_batch} sequences "
            f"x {b.seq_len} tokens = {b.tokens_per_step:,} tokens/step") in text, text
    assert f"steps: {job.cfg.trainer.max_steps:,} (" in text

    _spy(monkeypatch, dry_run_mod,
         lambda j: replace(j, cfg=replace(j.cfg, trainer=replace(j.cfg.trainer, max_steps=4321))))
    with launch_vars_restored():
        dry_run_mod.print_job_config([*TINY])
    assert "\n  max_steps: 4321\n" in capsys.readouterr().out


def test_a_sweeps_check_asks_plan_job(monkeypatch):
    """--multirun: each job's config is checked by plan_job (scope "check") before any runs."""
    import llama_train.job.plan as plan_mod
    from llama_train.train import _check_sweep, _register_sweep_subdir, config_source

    made = _spy(monkeypatch, plan_mod)
    overrides = [*TINY, "optim.lr=1e-3,2e-3"]
    monkeypatch.setattr(sys, "argv", ["llama-train", "--multirun", *overrides])
    _register_sweep_subdir()  # as main() does before the check
    _check_sweep(overrides, config_source(overrides))
    assert [s for s, _ in made] == ["check", "check"]
    assert [j.cfg.optim.lr for _, j in made] == [1e-3, 2e-3]


def test_the_trainer_trains_the_plan_preflight_made(tmp_path, monkeypatch):
    """Preflight asks plan_job once; the trainer, its TrainModule and its loader take the batch
    and the layout from that plan (here one of 7 accumulation steps: the run's step trains
    7 micro-batches)."""
    import llama_train.job.preflight as preflight_mod
    from llama_train.job.trainer import start

    made = _spy(monkeypatch, preflight_mod, _accum_7)
    with world_of_one():
        pre = preflight_mod.preflight(cfg_for(tmp_path / "run", "trainer.max_steps=1"))
        try:
            [(scope, job)] = made
            assert scope == "run" and pre.job is job and pre.plan is job.batch
            assert pre.cfg is job.cfg and pre.rt is job.runtime
            tr = start(pre)
            assert tr.plan is job.batch and tr.module.plan is job.batch
            assert tr.layout is job.layout and tr.dp_rank == job.layout.dp_rank == 0
            assert tr.loader.dp_world == job.layout.data_parallel
            assert tr.loader.global_batch == job.batch.global_batch
            assert (tr.module.sp_rank, tr.module.sp_size) == (0, 1)
            batches = []
            real_next = tr.module.train_batch

            def counted(it, *a, **k):
                def each():
                    for xy in it:
                        batches.append(xy)
                        yield xy
                return real_next(each(), *a, **k)

            tr.module.train_batch = counted
            tr.fit()
            assert len(batches) == 7
        finally:
            pre.release()
