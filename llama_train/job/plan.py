"""The one place a config becomes a job: :func:`plan_job` turns the config a command composed
and the runtime it found (:class:`llama_train.engine.Runtime`) into a :class:`JobPlan`, the
config the job trains with (a simulated rank's switches, the experiment's plan, a resume's kept
global batch, trainer.init_from's tokenizer), how its ranks share the work
(:class:`llama_train.layout.ParallelLayout`), the batch and the checkpoint a resume would
continue. Preflight asks it once and holds the plan (``Preflight.job``); the trainer reads it;
the dry run and ``--cfg job`` ask it for the same plan (``scope="preview"``) and show it; a
--multirun sweep's check asks it for each job's layout and batch.

Reads files only where a run would (``scope="run"`` and ``"preview"``: the resume's candidate
checkpoint, init_from's files, the prepared data's meta.json); creates nothing, starts no
process group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Tuple

from llama_train.config import (BatchPlan, Config, ConfigError, config_warnings, parallel_layout,
                                resolve_batch, validate)
from llama_train.config.validation import check_float8
from llama_train.layout import ParallelLayout

log = logging.getLogger("llama_train")

SCOPES = ("check", "layout", "preview", "run")


@dataclass(frozen=True)
class JobPlan:
    """What a job is, decided before any process group exists (:func:`plan_job`)."""

    cfg: Config  # the config the job trains with: every rewrite of plan_job applied
    runtime: Any  # engine.Runtime: rank, world, device
    layout: ParallelLayout  # ranks / parallel.sequence replicas, this rank's coordinates
    batch: BatchPlan  # micro-batch, accumulation, global batch over layout.data_parallel
    experiment: Any = None  # scaling.ExperimentPlan of experiment=... runs
    # the checkpoint a resume will most likely load (files only, no checksums; None: a fresh
    # start); its global batch kept where the config sets none. preflight judges it
    # (resume.check_resume) once the output dir is known to be usable
    resume_candidate: Optional[Path] = None
    # what plan_job changed in the config or found, each line as the run logs it (INFO): the
    # resume's kept global batch, init_from's tokenizer, a simulated rank's switches
    notes: Tuple[str, ...] = ()
    warnings: Tuple[str, ...] = ()  # config.config_warnings, logged as WARNING
    # scope="preview": the checks left to the launch, each with what it says on this machine
    deferred: Tuple[str, ...] = ()


def plan_job(cfg: Config, rt: Any, scope: str = "run") -> JobPlan:
    """The plan of ``cfg`` on runtime ``rt``, each step refusing (ConfigError naming the key
    and the fix) what cannot run, in this order: a simulated rank's config, the layout, the
    experiment's plan, the resume's candidate and its global batch, the batch against the world
    (config.validate, hpZ and MiCS groups within ``rt.local_world_size`` ranks per node),
    FP8 on this device, the config's warnings (logged), trainer.init_from's weights and
    tokenizer.

    ``scope`` is how much of that a caller asks for:

    - ``"run"``: all of it (preflight).
    - ``"preview"``: the run's plan, all of it but the FP8 device: float8 is not refused for
      this machine's device (config.validate's device type and auto precision,
      engine.float8.check_device's torchao and compute capability), since a dry run may be
      asked on a CPU login node of a GPU job; what those checks say here is kept in
      ``JobPlan.deferred`` for the caller to show, and the launch still refuses (the dry run,
      ``--cfg job``: they show what the run would train, the resume's kept batch and
      init_from's tokenizer included). Reads the same files as ``"run"``, writes nothing.
    - ``"check"``: the layout and the batch of the config as composed (a --multirun sweep's
      check of each job, before any job's experiment, data or output dir exists).
    - ``"layout"``: the layout and the batch alone (``config.parallel_layout``, its refusals
      of a layout that cannot work, then ``config.resolve_batch``), judged by nothing else:
      for a config that is checked elsewhere or already ran. The simulation's ``replan`` (a
      finished run's saved config.yaml, which config.validate could now refuse although the
      planner still has figures for it: a check added since it ran, MiCS, which this
      DeepSpeed lacks) and the bench's memory worker (a Config of its own arguments, DeepSpeed's
      knobs on a model; validate's checks of a training job, sample.tokens against the
      model's max_seq_len, data.shard_tokens, fp16 on CPU, are no part of what it measures).
      The simulation's planner figures (``planned``, ``planned_traffic``) take the layout of a
      plan already made (the trainer's, the dry run's, ``replan``'s)."""
    if scope not in SCOPES:
        raise ValueError(f"plan_job: scope={scope!r}, not one of {SCOPES}")
    if scope == "layout":
        layout = parallel_layout(cfg, rt.world_size, rt.rank)
        return JobPlan(cfg, rt, layout, resolve_batch(cfg.trainer, layout.data_parallel))
    full = scope in ("run", "preview")  # the run's plan; "preview" defers the FP8 device
    notes, warnings, deferred = [], (), ()
    if full and rt.simulated:
        cfg, note = _simulated(cfg, rt)
        notes += [note] if note else []
    layout = parallel_layout(cfg, rt.world_size, rt.rank)
    experiment = candidate = None
    if scope != "check":
        cfg, experiment = plan_experiment(cfg, layout.data_parallel)
    if full:
        candidate = _resume_candidate(cfg)  # looked for once: a file may change between looks
        cfg = _keep_checkpoint_batch(cfg, candidate, layout.data_parallel, rt.is_main, notes)
    # ranks per node: hpZ and MiCS groups must fit inside one (deepspeed.zeropp, mics_shard_size)
    batch = validate(cfg, rt.world_size, rt.device_type, ranks_per_node=rt.local_world_size,
                     fp8_device=scope != "preview")
    if full:
        # float8: torchao present, FP8 matmuls on this GPU (validate: device, precision)
        if cfg.float8.enabled:
            deferred = _fp8_device(cfg, rt, refuse=scope == "run")
        warnings = tuple(config_warnings(cfg))
        if rt.is_main:
            for warning in warnings:
                log.warning("%s", warning)
        if cfg.trainer.init_from:
            from llama_train.hf import check_init_from

            check_init_from(cfg.trainer.init_from, cfg.model)
            cfg = _init_from_tokenizer(cfg, resuming=candidate is not None, main=rt.is_main,
                                       notes=notes)
    return JobPlan(cfg, rt, layout, batch, experiment, candidate, tuple(notes), warnings,
                   deferred)


def _fp8_device(cfg: Config, rt: Any, refuse: bool) -> Tuple[str, ...]:
    """float8 on this machine's device: validate's device type and precision, then torchao and
    the GPU's compute capability (engine.float8.check_device). ``refuse`` (the run): their
    ConfigError raised, else (); not ``refuse`` (a preview): one line, what they say here."""
    from llama_train.engine.float8 import check_device

    try:
        check_float8(cfg, rt.device_type)
        check_device(cfg.float8, rt.device)
    except ConfigError as e:
        if refuse:
            raise
        here = f"here it would be refused: {e}"
    else:
        if refuse:
            return ()
        here = "this machine passes it"
    return (f"float8: the FP8 device (torchao; FP8 matmuls, a GPU of compute capability 8.9 "
            f"or later, or float8.emulate=true) is checked at launch, on the job's devices; "
            f"{here}",)


def _simulated(cfg: Config, rt: Any):
    """A simulated rank's config (:func:`simulation_config`) and what that switched off, in
    words (None: nothing was on). Preflight logs its start warning, which says the same."""
    planned = simulation_config(cfg)
    off = [w for w, on in (("W&B (tracking.wandb.mode=disabled)",
                            cfg.tracking.wandb.mode != "disabled"),
                           ("the text sample (sample.tokens=0)", cfg.sample.tokens > 0)) if on]
    note = (f"comm.simulate_ranks={rt.world_size}: rank {rt.rank} of {rt.world_size} alone; "
            f"switched off: {', '.join(off)}" if off else None)
    return planned, note


def simulation_config(cfg):
    """The config a simulated rank trains with: W&B and the text sample switched off (a W&B
    run of one rank's numbers, a sample from mirrored weights: both would mislead)."""
    tracking = replace(cfg.tracking, wandb=replace(cfg.tracking.wandb, mode="disabled"))
    return replace(cfg, tracking=tracking, sample=replace(cfg.sample, tokens=0))


def plan_experiment(cfg: Config, world_size: int):
    """experiment=compute_optimal|inference_optimal|isoflop: the config this run trains with
    (model shape, steps, warmup from the plan) and the plan; ``cfg`` itself is left alone."""
    if cfg.scaling.mode == "none":
        return cfg, None
    from llama_train.scaling.planners import plan_config

    if cfg.data.val_fraction == 0:
        raise ConfigError(f"scaling.mode={cfg.scaling.mode} compares runs by their validation "
                          f"loss, but data.val_fraction=0 leaves no validation split: set "
                          f"data.val_fraction > 0 (default 0.01).")
    planned, exp = plan_config(cfg, world_size)
    log.info("scaling %s", exp.describe())
    return planned, exp


def _resume_candidate(cfg: Config):
    """The checkpoint a resume will most likely load (files only, no checksums), or None."""
    from llama_train.checkpoint import resume_candidate

    return resume_candidate(cfg.trainer.output_dir, cfg.trainer.resume)


def _keep_checkpoint_batch(cfg: Config, ckpt, world_size: int, main: bool,
                           notes: Optional[list] = None) -> Config:
    """A resume keeps the checkpoint's global batch (the data order is a function of it) when
    the user sets none: trainer.global_batch's default, micro_batch x world size, changes with
    the number of ranks, and a 2-rank run resumed on 1 rank was refused. Gradient accumulation
    takes up the difference (said in the log); a global batch the user sets is judged as given
    (a conflicting one is refused by the resume check, with this fix)."""
    from llama_train.checkpoint import CheckpointMeta

    t = cfg.trainer
    if ckpt is None or t.global_batch is not None or t.global_batch_tokens is not None:
        return cfg
    saved = int(CheckpointMeta.read(ckpt).global_batch)
    per_step = t.micro_batch * world_size
    if saved == per_step:
        return cfg
    if saved % per_step:
        raise ConfigError(
            f"checkpoint {ckpt} was trained with a global batch of {saved} sequences, which "
            f"trainer.micro_batch={t.micro_batch} x {world_size} rank(s) = {per_step} does not "
            f"divide: set trainer.micro_batch so that micro_batch x ranks divides {saved} (the "
            f"global batch cannot change within a run), or start a new trainer.output_dir.")
    _said(notes, main,
          f"resuming {ckpt}: keeping its global batch of {saved} sequences (trainer.micro_batch="
          f"{t.micro_batch} x {world_size} rank(s) x {saved // per_step} accumulation steps): "
          f"the global batch cannot change within a run")
    return replace(cfg, trainer=replace(t, global_batch=saved))


def _said(notes: Optional[list], main: bool, note: str) -> None:
    """A change the plan made, logged (INFO, on the main rank) and kept in ``notes``."""
    if notes is not None:
        notes.append(note)
    if main:
        log.info("%s", note)


def _init_from_tokenizer(cfg: Config, resuming: bool, main: bool,
                         notes: Optional[list] = None) -> Config:
    """The config whose data is tokenized with the tokenizer trainer.init_from's weights were
    trained with (data.tokenizer set to it, unless it names one that tokenizes alike): a
    tokenizer trained afresh on this run's data gave other ids to the same pieces, and the run
    trained on them with no error (issue 53). Data already prepared with that very tokenizer
    (the run that trained the weights: same source, its trained tokenizer) is kept, not
    prepared again. A resume loads its checkpoint's weights, not init_from's, and
    resume.check_tokenizer compares the checkpoint's tokenizer with the data's: there the same
    choice is made (the same command, the same data), but nothing is refused."""
    from llama_train.data import DataError, find_prepared
    from llama_train.data.tokenizer import file_sha256
    from llama_train.hf import check_init_from_tokenizer, init_from_tokenizer_file

    t, d = cfg.trainer, cfg.data
    if resuming:
        own = init_from_tokenizer_file(t.init_from)
        if own is None or d.tokenizer is not None:
            return cfg
        tok = str(own)
    else:
        tok = check_init_from_tokenizer(t.init_from, d.tokenizer, cfg.model.vocab_size)
        if d.tokenizer is not None:
            return cfg
    sha = file_sha256(tok)
    try:
        found = find_prepared(d, vocab_size=cfg.model.vocab_size)  # meta.json only
    except DataError:  # prepared otherwise: preparing with the tokenizer says what is wrong
        found = None
    have = found.meta["tokenizer"].get("sha256") if found is not None else None
    if have == sha:
        _said(notes, main, f"trainer.init_from={t.init_from}: the data in {found.dir} is "
                           f"tokenized with its tokenizer (sha256 {sha[:12]})")
        return cfg
    if have is not None and d.prepared_dir and not resuming:
        raise ConfigError(
            f"data.prepared_dir={d.prepared_dir} holds data tokenized with tokenizer sha256 "
            f"{have[:12]}, not the one trainer.init_from={t.init_from} was trained with ({tok}, "
            f"sha256 {sha[:12]}): its weights would train on another tokenizer's ids. Give "
            f"another data.prepared_dir (or null) to prepare the data with init_from's tokenizer.")
    _said(notes, main, f"trainer.init_from={t.init_from}: tokenizing the data with its tokenizer "
                       f"{tok} (sha256 {sha[:12]}), the one its weights were trained with")
    return replace(cfg, data=replace(d, tokenizer=tok))
