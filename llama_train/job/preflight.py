"""Everything decided before a process group exists: the config checked across groups, the
experiment planned, the output dir claimed, the data prepared and a resume's checkpoint judged.

Any refusal here names the key and the fix and happens on every rank alike, from files, before
NCCL or gloo starts, so a wrong command costs seconds and writes nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Optional

from llama_train.config import BatchPlan, Config, ConfigError, to_container
from llama_train.job.plan import JobPlan, plan_job
from llama_train.job.plan import plan_experiment  # noqa: F401 - moved to plan.py; imported here

log = logging.getLogger("llama_train")


def setup_logging(rank: int, main: Optional[bool] = None) -> None:
    """INFO on the rank that does rank 0's duties (``main``, default: rank 0), else WARNING."""
    logging.basicConfig(
        level=logging.INFO if (rank == 0 if main is None else main) else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


@dataclass
class Preflight:
    """Everything decided before a process group exists."""

    job: JobPlan  # the config the run trains with, its layout and batch (plan.plan_job)
    prepared: Any  # data.Prepared
    lock: Any = None  # runlock.RunLock on rank 0: the output_dir is this job's until release()
    command: Optional[str] = None  # the llama-train command of this job (run_info.json)
    faults: Any = None  # faults.FaultPlan from LLAMA_TRAIN_FAULTS (empty: none)
    resume: Any = None  # resume.ResumeCheck of the checkpoint a resume will load (None: fresh)

    @property
    def cfg(self) -> Config:  # the config the run trains with (an experiment's plan applied)
        return self.job.cfg

    @property
    def rt(self) -> Any:  # engine.Runtime
        return self.job.runtime

    @property
    def model_args(self) -> Any:  # model.ModelArgs
        return self.job.cfg.model

    @property
    def plan(self) -> BatchPlan:
        return self.job.batch

    @property
    def experiment(self) -> Any:  # scaling.ExperimentPlan, for experiment=... runs
        return self.job.experiment

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def run_config(self) -> dict:
        """The resolved config as saved with every checkpoint (secrets scrubbed)."""
        return to_container(self.cfg)

    def resume_check(self, ckpt: Optional[Path]):
        """The :class:`~llama_train.job.resume.ResumeCheck` of the checkpoint the job actually
        loads: preflight's, or (where a newer checkpoint failed its checksums since) that one's,
        judged by the same rules now. None for a fresh start."""
        from llama_train.checkpoint import CheckpointMeta
        from llama_train.job.resume import check_resume

        if ckpt is None:
            return None
        if self.resume is None or Path(self.resume.checkpoint) != Path(ckpt):
            self.resume = check_resume(
                ckpt, CheckpointMeta.read(ckpt), self.run_config(), self.rt.world_size,
                self.plan.global_batch, self.cfg.trainer.allow_config_change,
                self.prepared.meta["tokenizer"].get("sha256"), self.cfg.comm.simulate)
        return self.resume


def preflight(cfg: Config) -> Preflight:
    """Validate the config, claim the output dir and prepare the data. Any error here is raised
    before the process group starts, naming the key and the fix. On rank 0 the returned
    Preflight holds the output dir's lock: call its ``release()`` when the run ends."""
    from llama_train.comm import check_backend
    from llama_train.data import check_compatible, prepare_data
    from llama_train.engine import detect_runtime
    from llama_train.job.faults import FaultPlan
    from llama_train.job.resume import check_tokenizer
    from llama_train.job.runlock import RunLock, check_not_held_by_another_job
    from llama_train.job.simulation import check_output_dir
    from llama_train.metrics.tracking import check_wandb_env
    from llama_train.paths import PathRefused, cache_dir

    try:  # a LLAMA_TRAIN_CACHE that cannot be a directory: refused by name, first
        cache_dir()
    except PathRefused as e:
        raise ConfigError(str(e)) from None
    rt = detect_runtime(cfg.trainer.device, cfg.comm.simulate)
    setup_logging(rt.rank, rt.is_main)
    if rt.simulated:
        from llama_train.job.simulation import start_warning

        log.warning("%s", start_warning(rt.world_size, rt.rank))
    check_output_dir(cfg, rt.simulated)  # a simulation and a real run never share a dir
    # the config the run trains with (simulated rank, experiment, the resume's global batch,
    # init_from's tokenizer), its layout and batch: checked, refused with the key and the fix
    job = plan_job(cfg, rt)
    cfg, plan = job.cfg, job.batch
    check_tokenizer_fits(cfg)  # files only: before the data is read or prepared
    faults = FaultPlan.from_env()  # a malformed LLAMA_TRAIN_FAULTS fails here, not mid-run
    check_wandb_env(cfg.tracking)
    try:
        check_backend(cfg.comm, rt.device_type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_run_paths(cfg)  # resolved paths, before the probe writes anything
    _check_writable(cfg.trainer.output_dir)
    check_not_held_by_another_job(cfg.trainer.output_dir)  # every rank, before the data
    _check_one_history(cfg)
    resume = _check_resume(cfg, plan, rt.world_size, job.resume_candidate)  # before data, group
    try:
        prepared = prepare_data(cfg.data, vocab_size=cfg.model.vocab_size)
    except OSError as e:  # a write that names no file (ENOSPC in a shard): name the place
        if e.filename is None:
            from llama_train.paths import cache_dir

            e.filename = str(cfg.data.prepared_dir or cache_dir())
        raise
    check_compatible(prepared.meta, cfg.model.vocab_size, cfg.trainer.seq_len)
    if rt.is_main:  # where the data is, also when it was prepared by an earlier run
        log.info("data: %s (tokenizer %s)", prepared.dir, prepared.tokenizer_path)
    _check_epochs(cfg, plan, prepared.meta, rt.is_main)
    _check_prepared_tokenizer(prepared)
    _check_sample_prompt(cfg, prepared)
    if resume is not None:  # the checkpoint's tokenizer against the data's, now known
        check_tokenizer(resume.checkpoint, prepared.meta["tokenizer"].get("sha256"))
    # last: a refused config or data leaves no lock file behind (prepared data is found quickly)
    lock = RunLock(cfg.trainer.output_dir).acquire() if rt.is_main else None
    return Preflight(job, prepared, lock, faults=faults, resume=resume)


def check_tokenizer_fits(cfg: Config) -> None:
    """data.tokenizer's size against model.vocab_size (data.tokenizer.fits: a SentencePiece
    model's must equal it, a Hugging Face tokenizer.json's may be smaller), or, with none given,
    whether the source can train one that large (a built-in corpus cannot: meta.BUILTIN_MAX_VOCAB).
    From files alone, in preflight and in the dry run: a Llama 3 preset without data.tokenizer
    failed a minute in, inside SentencePiece, after a dry run that said nothing. Raises
    DataError naming the keys and the fix."""
    from llama_train.data.meta import tokenizer_settings

    d = cfg.data
    # init_from's own tokenizer, which the plan leaves unset where the data already uses it
    if d.tokenizer is None and cfg.trainer.init_from:
        from llama_train.hf import init_from_tokenizer_file

        own = init_from_tokenizer_file(cfg.trainer.init_from)
        if own is None:  # refused by check_init_from_tokenizer, naming trainer.init_from
            return
        d = replace(d, tokenizer=str(own))
    tokenizer_settings(d, cfg.model.vocab_size)


def _check_resume(cfg: Config, plan: BatchPlan, world_size: int, ckpt):
    """The checkpoint a resume will most likely load (sizes checked, not checksums), judged by
    :mod:`llama_train.job.resume` from its files: a resume the run would refuse (another
    run-defining config, global batch or model shape) is refused before data preparation and
    the process group. None: a fresh start."""
    from llama_train.checkpoint import CheckpointMeta
    from llama_train.job.resume import check_resume

    if ckpt is None:
        return None
    return check_resume(ckpt, CheckpointMeta.read(ckpt), to_container(cfg), world_size,
                        plan.global_batch, cfg.trainer.allow_config_change,
                        simulate=cfg.comm.simulate)


def _check_epochs(cfg: Config, plan: BatchPlan, meta: dict, main: bool) -> float:
    """How many times the run reads the train split (data.mixture: the source read most often,
    by its weight): said at start; for a scaling experiment (whose law assumes fresh tokens) a
    warning above 1 and a refusal above scaling.max_epochs."""
    tokens = cfg.trainer.max_steps * plan.tokens_per_step
    train_tokens, split = meta["splits"]["train"]["tokens"], "the train split"
    epochs = tokens / max(1, train_tokens)
    if "sources" in meta:  # a mixture
        total = sum(s["weight"] for s in meta["sources"])
        each = {s["name"]: (tokens * s["weight"] / total / max(1, s["train_tokens"]),
                            s["train_tokens"]) for s in meta["sources"]}
        name = max(each, key=lambda n: each[n][0])
        epochs, train_tokens = each[name]
        split = f"source {name} (by its weight)"
        if main:
            log.info("data.mixture epochs: %s", ", ".join(f"{n} {e:.3g}"
                                                         for n, (e, _) in each.items()))
    what = (f"{cfg.trainer.max_steps} steps x {plan.tokens_per_step:,} tokens read {split} "
            f"({train_tokens:,} tokens) {epochs:.3g} times")
    if cfg.scaling.mode == "none" or epochs <= 1:
        if main:
            log.info("data: %s", what)
        return epochs
    s = cfg.scaling
    if epochs > s.max_epochs:
        raise ConfigError(
            f"scaling.mode={s.mode}: {what}, more than scaling.max_epochs={s.max_epochs:g}. A "
            f"scaling law's tokens are fresh tokens: lower scaling.flops, use a larger "
            f"data.source, or raise scaling.max_epochs to accept the repetition.")
    if main:
        log.warning("scaling.mode=%s: %s: repeated tokens are worth less than fresh ones, so "
                    "the loss will sit above the law's prediction (limit: scaling.max_epochs=%g)",
                    s.mode, what, s.max_epochs)
    return epochs


def run_paths(cfg: Config) -> Dict[str, Path]:
    """What the run itself creates or replaces directly in trainer.output_dir, by the key or
    name that puts it there (W&B and TensorBoard only where their dir is the default)."""
    from llama_train.checkpoint import ARCHIVE, RUN_FILES
    from llama_train.job.runlock import LOCK_NAME

    out, tr = Path(cfg.trainer.output_dir), cfg.tracking
    paths = {n: out / n for n in (LOCK_NAME, *RUN_FILES, ARCHIVE)}
    paths["tracking.metrics_file"] = out / tr.metrics_file
    paths["checkpoints/latest"] = out / "checkpoints" / "latest"
    if not tr.wandb.dir:
        paths["wandb"] = out / "wandb"
    if not tr.tensorboard.dir:
        paths["tensorboard"] = out / "tensorboard"
    return paths


def _check_run_paths(cfg: Config) -> None:
    """Every path the run writes stays in its trainer.output_dir (issue 54): the keys that name
    one (tracking.metrics_file, tracking.tensorboard.dir, tracking.wandb.dir: relative to the
    output dir) must resolve, through every symlink and ``..``, inside it and outside its
    checkpoints/ and archive/ (tracking.tracking_paths, paths.run_path; an absolute path
    elsewhere is refused too); none of the run's own files or directories there may be a
    symlink (a planted ``.lock`` link truncated its target, a ``config.yaml`` link had its
    target overwritten, an ``archive`` link moved the history elsewhere); and neither the
    output dir nor data.prepared_dir may lie inside a checkpoint. trainer.output_dir itself may
    be a link. The tracker checks its paths again when it starts writing."""
    import os.path

    from llama_train.metrics.tracking import tracking_paths
    from llama_train.paths import inside_checkpoint

    for key, where in (("trainer.output_dir", cfg.trainer.output_dir),
                       ("data.prepared_dir", cfg.data.prepared_dir)):
        ckpt = inside_checkpoint(where) if where else None
        if ckpt is not None:
            raise ConfigError(
                f"{key}={where!r} lies inside the checkpoint {ckpt}: writing there changes "
                f"files its manifest vouches for. Give {key} a directory outside every "
                f"checkpoint. Nothing was changed.")
    for key, path in run_paths(cfg).items():
        if path.is_symlink():
            raise ConfigError(
                f"{path} is a symlink (to {os.readlink(path)}): the run would write through it "
                f"into a file it does not own ({key}). Nothing was changed. Remove the link, or "
                f"point trainer.output_dir at the directory where the run should live.")
    tracking_paths(cfg.tracking, cfg.trainer.output_dir)


def _check_one_history(cfg: Config) -> None:
    """trainer.resume=never starts a new history: refuse a directory that holds one unless
    trainer.on_existing says what to do with it (every rank decides the same, from the files)."""
    from llama_train.checkpoint import existing_history

    t = cfg.trainer
    if t.resume != "never" or t.on_existing != "refuse":
        return
    found = existing_history(t.output_dir, cfg.tracking.metrics_file)
    if found:
        shown = ", ".join(found[-3:]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(
            f"trainer.resume=never but trainer.output_dir={t.output_dir!r} already holds a run "
            f"({shown}): one output_dir holds one history. Continue it with trainer.resume=auto, "
            f"start over with trainer.on_existing=archive (moves it to "
            f"{Path(t.output_dir) / 'archive'}/<time>/) or trainer.on_existing=overwrite "
            f"(deletes it), or use another trainer.output_dir. Nothing was changed.")


def _check_writable(output_dir: str) -> None:
    """Every rank writes checkpoint shards: find a read-only or full output dir now, not at the
    first save hours later. Probes the checkpoint dir, or the nearest existing parent that would
    hold it, and leaves nothing behind."""
    d = Path(output_dir).absolute() / "checkpoints"
    while not d.exists() and d.parent != d:
        d = d.parent
    probe = d / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        if not d.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"trainer.output_dir={output_dir!r} is not writable: {e.strerror or e} "
            f"({e.filename or d}). Point trainer.output_dir at a writable directory with free "
            f"space, or fix its permissions or mount."
        ) from None


def _check_sample_prompt(cfg: Config, prepared) -> None:
    """The end-of-run sample must fit the model: the prompt, encoded by the run's tokenizer,
    plus sample.tokens (found now, not after the whole run)."""
    from llama_train.data import Tokenizer

    s = cfg.sample
    if not s.tokens:
        return
    n = len(Tokenizer(prepared.tokenizer_path).encode(s.prompt, bos=False, eos=False))
    if n == 0:
        raise ConfigError(f"sample.prompt={s.prompt!r} encodes to no tokens: give a prompt with "
                          f"text in it, or set sample.tokens=0 for no sample.")
    if n + s.tokens > cfg.model.max_seq_len:
        raise ConfigError(
            f"sample.prompt ({n} tokens) + sample.tokens={s.tokens} exceeds "
            f"model.max_seq_len={cfg.model.max_seq_len}: shorten sample.prompt or lower "
            f"sample.tokens.")


def _check_prepared_tokenizer(prepared) -> None:
    """The tokenizer file beside the shards must be the one meta.json says encoded them."""
    from llama_train.data import DataError
    from llama_train.data.tokenizer import file_sha256

    want = prepared.meta["tokenizer"].get("sha256")
    path = Path(prepared.tokenizer_path)
    if not path.is_file():
        raise DataError(f"{path} is missing: the prepared data in {prepared.dir} is incomplete; "
                        f"delete it and prepare again.")
    got = file_sha256(path)
    if want and got != want:
        raise DataError(
            f"{path} (sha256 {got[:12]}) is not the tokenizer that encoded the shards in "
            f"{prepared.dir} (meta.json: sha256 {want[:12]}): the directory mixes two "
            f"tokenizers. Delete it and prepare again, or restore its tokenizer.model."
        )
