"""One build: the parts a job is made of, built once, in one order, for the Trainer.

:func:`resolve_job` sets the process up after preflight: the hooks, the process group, the
checkpoint manager (and its writer's group), the checkpoint to continue (verified by rank 0,
judged again if it is not the one preflight judged), universal conversion for a new world
size. :func:`build_job` builds the rest into :class:`Components`: the model and its DeepSpeed
engine, the one-batch module, the data stream, the tracker, the train state and recovery, the
peak FLOP/s, the rank-0 files. :class:`llama_train.job.trainer.Trainer` takes the Components and
builds nothing itself.

Every rank makes its process groups and runs its collectives in the order written here (the
process group, the checkpoint writer's gloo group, the resume's choice, the sequence groups,
DeepSpeed's initialize): keep it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from llama_train import engine as eng
from llama_train.checkpoint import CheckpointManager, checkpoint_step, prepare_universal
from llama_train.data import TrainLoader
from llama_train.engine.flops import PeakFlops
from llama_train.hooks import Hook
from llama_train.job.compile_watch import CompileWatch
from llama_train.job.faults import FaultInjector, FaultPlan
from llama_train.job.optim import param_groups
from llama_train.job.recovery import Recovery
from llama_train.job.resume import ResumeCheck, log_changes
from llama_train.job.run_files import RunFiles
from llama_train.job.simulation import NoSimulation, Simulation, metered, simulation_of
from llama_train.job.summary import already_complete
from llama_train.job.train_module import TrainModule
from llama_train.job.train_state import TrainState
from llama_train.metrics.tracking import Tracker
from llama_train.model import flops_per_token
from llama_train.proc import stop_with_launcher
from llama_train.records import RunInfo

log = logging.getLogger("llama_train")


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve_job` settled: the hooks (the fault injector first), the checkpoint
    manager, and the checkpoint this run continues (None: from step 0)."""

    hooks: List[Hook]
    ckpts: CheckpointManager
    resume: Optional[ResumeCheck]


@dataclass(frozen=True)
class Components:
    """The parts of one job, as :func:`build_job` built them; the Trainer's to drive."""

    hooks: List[Hook]  # the fault injector, the caller's, CompileWatch (rank 0, compiled)
    ckpts: CheckpointManager
    resume: Optional[ResumeCheck]  # the checkpoint to continue, its changes and timings
    run_config: Any  # the config as the run records it (config.yaml, checkpoints, W&B)
    precision: str
    # comm.simulate_ranks: the loop's points of a simulated rank (SimulationReport: this
    # rank's measurements), or none
    simulation: NoSimulation
    seq_mpu: Any  # the layout's sequence groups (DeepSpeed's mpu; None without parallel.sequence)
    engine: Any  # eng.Engine, metered when simulated or counting traffic
    module: TrainModule
    loader: TrainLoader
    tracker: Tracker
    state: TrainState
    recovery: Recovery
    fpt: float  # FLOPs per token
    peak: PeakFlops
    files: RunFiles  # what rank 0 alone writes: config.yaml, run_info.json, sample.txt


def resolve_job(pre, hooks: Sequence[Hook] = ()) -> Optional[Resolved]:
    """The process group, the checkpoint manager and the checkpoint to continue (verified by
    rank 0; an old history set aside if ``trainer.on_existing`` says so), judged by
    :mod:`llama_train.job.resume` if it is not the one preflight judged, converted for a new world
    size if needed. None when the checkpoint already holds trainer.max_steps: the run is
    complete."""
    cfg, t, rt = pre.cfg, pre.cfg.trainer, pre.rt
    hooks = [FaultInjector(pre.faults or FaultPlan(), rt.rank), *hooks]
    stop_with_launcher()  # a killed launcher: SIGTERM, so this rank saves and stops
    eng.init_distributed(cfg.comm, rt.device_type)
    log.info("process group up: %d ranks over %s", rt.world_size, dist.get_backend())
    # trainer.async_save: a simulated rank saves synchronously (its phases are measured alone)
    async_save = t.async_save and not rt.simulated
    ckpts = CheckpointManager(t.output_dir, t.keep_last, t.verify_checksums, rt.rank,
                              rt.world_size, hooks, lead=rt.is_main, async_save=async_save,
                              comm_timeout_s=cfg.comm.timeout_s)  # and the writer's gloo group
    run_files = (*(() if cfg.tracking.wandb.dir else ("wandb",)),  # default <output_dir>/wandb
                 *(() if cfg.tracking.tensorboard.dir else ("tensorboard",)))
    t0 = time.perf_counter()
    resume_from = ckpts.resolve_resume(  # verified before unpickling
        t.resume, t.on_existing, cfg.tracking.metrics_file, run_files)
    resume = pre.resume_check(resume_from)
    done = checkpoint_step(resume.checkpoint) if resume is not None and not rt.simulated else 0
    if done >= t.max_steps:
        if rt.is_main:  # started again after it ended: no W&B run, no new sample
            for line in already_complete(step=done,
                                         max_steps=t.max_steps, checkpoint=resume.checkpoint,
                                         output_dir=t.output_dir,
                                         val_loss=RunInfo.final_val_loss_of(t.output_dir)):
                log.info("%s", line)
        return None
    if resume is not None:
        resume.seconds["verify_s"] = time.perf_counter() - t0
        if rt.is_main:
            log_changes(resume)
        if resume.universal:
            t0 = time.perf_counter()
            prepare_universal(resume.checkpoint, rt.rank)
            resume.seconds["convert_s"] = time.perf_counter() - t0
    return Resolved(hooks, ckpts, resume)


def build_job(pre, job: Resolved) -> Components:
    """Build: model, engine, data, tracking, on a process group that is up (:func:`resolve_job`),
    to continue ``job.resume`` (None: from step 0). ``pre`` is the
    :class:`llama_train.job.preflight.Preflight` (config checked, data prepared, the JobPlan)."""
    cfg, t, rt, plan = pre.cfg, pre.cfg.trainer, pre.rt, pre.plan
    layout, model_args, prepared = pre.job.layout, pre.model_args, pre.prepared
    hooks, resume = job.hooks, job.resume
    run_config = pre.run_config()
    torch.manual_seed(t.seed)
    precision = eng.resolve_precision(cfg.deepspeed, rt.device_type)
    # comm.simulate_ranks: this rank's phases measured (the idle baseline is read here)
    sim = Simulation(rt, cfg, model_args, plan, precision, layout) if rt.simulated else None
    simulation = simulation_of(sim)
    # parallel.sequence=N: groups of N consecutive ranks share each sequence (the layout's
    # sequence groups are DeepSpeed's), each group one data-parallel replica
    seq_mpu = eng.init_sequence_parallel(layout.sequence_parallel)
    engine = _build_engine(pre, resume, sim, simulation.phase, seq_mpu, hooks)
    eos_id = int(prepared.meta["tokenizer"]["eos_id"])  # documents end with it
    module = TrainModule(engine, plan, rt.device, cfg.optim, t.max_steps,
                         vocab_size=model_args.vocab_size, eos_id=eos_id,
                         document_mask=t.document_mask, data_dir=prepared.dir, hooks=hooks,
                         sequence=(layout.sp_rank, layout.sequence_parallel))
    loader = TrainLoader(prepared.dir, seq_len=t.seq_len, global_batch=plan.global_batch,
                         micro_batch=plan.micro_batch, dp_rank=layout.dp_rank,
                         dp_world=layout.data_parallel, seed=cfg.data.seed,
                         num_workers=cfg.data.num_workers, pin_memory=rt.device_type == "cuda",
                         data_timeout_s=cfg.comm.timeout_s)
    tracker = Tracker(cfg.tracking, t.output_dir, rt.rank, run_config, lead=rt.is_main)
    state = TrainState()
    recovery = Recovery(cfg.recovery, state, tracker, enabled=not rt.simulated)
    fpt = flops_per_token(model_args, t.seq_len)
    # A simulated rank is one process on one device: MFU is its share of each step's tokens
    # against that device's peak (N devices' peak would claim compute it never ran).
    peak = PeakFlops(rt.device, precision, 1 if rt.simulated else rt.world_size, t.peak_flops)
    return Components(hooks=hooks, ckpts=job.ckpts, resume=resume, run_config=run_config,
                      precision=precision, simulation=simulation, seq_mpu=seq_mpu,
                      engine=engine, module=module, loader=loader, tracker=tracker, state=state,
                      recovery=recovery, fpt=fpt, peak=peak,
                      files=RunFiles.of(pre, fpt, peak))


def _build_engine(pre, resume: Optional[ResumeCheck], sim: Optional[Simulation], phase,
                  seq_mpu, hooks: List[Hook]) -> eng.Engine:
    """The model (``trainer.init_from``'s weights on a fresh start), wrapped by DeepSpeed;
    CompileWatch added to ``hooks`` on rank 0 when the blocks are compiled."""
    from llama_train.hf import check_init_from, read_init_from

    cfg, rt, model_args = pre.cfg, pre.rt, pre.model_args
    t, zero = cfg.trainer, cfg.deepspeed.zero_stage
    universal = resume is not None and resume.universal
    ds_config = eng.build_ds_config(cfg.deepspeed, cfg.optim, pre.plan, rt.device_type,
                                    universal=universal, model_dim=model_args.dim)
    compiled, why = t.compiles(rt.device_type)
    if compiled:
        eng.compiled_ds_config(ds_config)  # before build_model: zero.Init reads it
    with phase("build"):
        model = eng.build_model(model_args, ds_config, rt.device, t.seed, mpu=seq_mpu,
                                float8=cfg.float8)
        if t.init_from and resume is None:
            check_init_from(t.init_from, model_args)
            eng.load_full_state(model, read_init_from(t.init_from, with_weights=True)[1], zero)
            log.info("initialised weights from %s", t.init_from)
    eng.shard_attention(model, seq_mpu)  # parallel.sequence > 1 only
    if compiled:
        eng.compile_blocks(model, zero)
    if rt.is_main:  # the decision, once; then how long compiling took, and recompiles
        log.info("trainer.compile=%s: %s (%s)", t.compile,
                 f"each of the {len(model.layers)} blocks compiled" if compiled else "eager", why)
        if compiled:
            hooks.append(CompileWatch())
    with phase("initialize"):
        engine = eng.initialize(model, param_groups(model, cfg.optim), ds_config, mpu=seq_mpu)
    return metered(engine, sim, t.output_dir, rt.rank)
