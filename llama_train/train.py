"""``llama-train``: the Hydra app. Composes and checks the config, prepares the data (all before
any process group exists), then hands over to :class:`llama_train.trainer.Trainer`.

Works unchanged under the ``deepspeed`` launcher (its ``--local_rank=N`` is taken off argv before
Hydra parses it) and as a plain single process. Exit codes (docs/reliability.md): 2 bad config or
data, 3 a checkpoint could not be saved or loaded, 4 the fault policy gave up, 5 another rank was
lost.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import hydra
from omegaconf import DictConfig

from llama_train.config import (BatchPlan, Config, ConfigError, config_warnings, load_config,
                                resolve_batch, to_container, validate)
from llama_train.hooks import Hook
from llama_train.paths import CONFIG_DIR
from llama_train.proc import exit_skipping_teardown

log = logging.getLogger("llama_train")


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


@dataclass
class Preflight:
    """Everything decided before a process group exists."""

    cfg: Config  # the config the run trains with (an experiment's plan applied)
    rt: Any  # engine.Runtime
    model_args: Any  # model.ModelArgs
    plan: BatchPlan
    prepared: Any  # data.Prepared
    experiment: Any = None  # scaling.ExperimentPlan, for experiment=... runs
    lock: Any = None  # runlock.RunLock on rank 0: the output_dir is this job's until release()
    command: Optional[str] = None  # the llama-train command of this job (run_info.json)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def preflight(cfg: Config) -> Preflight:
    """Validate the config, claim the output dir and prepare the data. Any error here is raised
    before the process group starts, naming the key and the fix. On rank 0 the returned
    Preflight holds the output dir's lock: call its ``release()`` when the run ends."""
    from llama_train.data import check_compatible, prepare_data
    from llama_train.engine import detect_runtime
    from llama_train.faults import FaultPlan
    from llama_train.comm import check_backend
    from llama_train.runlock import RunLock, check_not_held_by_another_job

    rt = detect_runtime(cfg.trainer.device)
    _setup_logging(rt.rank)
    cfg, experiment = plan_experiment(cfg, rt.world_size)
    plan = validate(cfg, rt.world_size, rt.device_type)
    if rt.rank == 0:
        for warning in config_warnings(cfg):
            log.warning("%s", warning)
    if cfg.trainer.init_from:
        from llama_train.trainer import check_init_from

        check_init_from(cfg.trainer.init_from, cfg.model)
    FaultPlan.from_env()  # a malformed LLAMA_TRAIN_FAULTS fails here, not mid-run
    try:
        check_backend(cfg.comm, rt.device_type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_writable(cfg.trainer.output_dir)
    check_not_held_by_another_job(cfg.trainer.output_dir)  # every rank, before the data
    _check_one_history(cfg)
    resume_from = _check_resume_config(cfg, plan)  # files only: before data and process group
    prepared = prepare_data(cfg.data, vocab_size=cfg.model.vocab_size)
    check_compatible(prepared.meta, cfg.model.vocab_size, cfg.trainer.seq_len)
    _check_epochs(cfg, plan, prepared.meta, rt.rank)
    _check_prepared_tokenizer(prepared)
    if resume_from is not None:  # the checkpoint's tokenizer against the data's, now known
        _check_resume_config(cfg, plan, prepared.meta["tokenizer"].get("sha256"))
    # last: a refused config or data leaves no lock file behind (prepared data is found quickly)
    lock = RunLock(cfg.trainer.output_dir).acquire() if rt.rank == 0 else None
    return Preflight(cfg, rt, cfg.model, plan, prepared, experiment, lock)


def _check_resume_config(cfg: Config, plan: BatchPlan, tokenizer_sha: Optional[str] = None):
    """A resume that the trainer would refuse (another run-defining config, global batch, model
    shape or tokenizer) is refused here, from the checkpoint's files, before data preparation
    and the process group. Returns the checkpoint compared (None: a fresh start)."""
    from llama_train.checkpoint import read_state, resume_candidate
    from llama_train.trainer import check_config_changes

    ckpt = resume_candidate(cfg.trainer.output_dir, cfg.trainer.resume)
    if ckpt is not None:
        check_config_changes(ckpt, read_state(ckpt), to_container(cfg),
                             plan.global_batch, tokenizer_sha, cfg.trainer.allow_config_change)
    return ckpt


def _check_epochs(cfg: Config, plan: BatchPlan, meta: dict, rank: int) -> float:
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
        if rank == 0:
            log.info("data.mixture epochs: %s", ", ".join(f"{n} {e:.3g}"
                                                         for n, (e, _) in each.items()))
    what = (f"{cfg.trainer.max_steps} steps x {plan.tokens_per_step:,} tokens read {split} "
            f"({train_tokens:,} tokens) {epochs:.3g} times")
    if cfg.scaling.mode == "none" or epochs <= 1:
        if rank == 0:
            log.info("data: %s", what)
        return epochs
    s = cfg.scaling
    if epochs > s.max_epochs:
        raise ConfigError(
            f"scaling.mode={s.mode}: {what}, more than scaling.max_epochs={s.max_epochs:g}. A "
            f"scaling law's tokens are fresh tokens: lower scaling.flops, use a larger "
            f"data.source, or raise scaling.max_epochs to accept the repetition.")
    if rank == 0:
        log.warning("scaling.mode=%s: %s: repeated tokens are worth less than fresh ones, so "
                    "the loss will sit above the law's prediction (limit: scaling.max_epochs=%g)",
                    s.mode, what, s.max_epochs)
    return epochs


def dry_run(cfg: Config) -> None:
    """trainer.dry_run=true: the plan this command would train, then exit. No process group and
    no data preparation (epochs only when the data is already prepared)."""
    from llama_train.data import DataError, find_prepared
    from llama_train.engine import detect_runtime
    from llama_train.model import count_params, flops_per_token

    rt = detect_runtime(cfg.trainer.device)
    _setup_logging(rt.rank)
    cfg, experiment = plan_experiment(cfg, rt.world_size)
    plan = validate(cfg, rt.world_size, rt.device_type)
    if rt.rank != 0:
        return
    t, m = cfg.trainer, cfg.model
    n, fpt = count_params(m), flops_per_token(m, t.seq_len)
    tokens = t.max_steps * plan.tokens_per_step
    try:
        found = find_prepared(cfg.data, vocab_size=m.vocab_size)
    except DataError as e:
        found, why = None, str(e)
    else:
        why = "not prepared yet: it would be prepared first"
    if found is not None:
        train_tokens = found.meta["splits"]["train"]["tokens"]
        epochs = (f"{tokens / max(1, train_tokens):.2f} epochs of the train split "
                  f"({train_tokens:,} tokens, {found.dir})")
    else:
        epochs = f"unknown ({why})"
    seconds, how = _estimate_step_seconds(m, plan, rt, cfg.deepspeed)
    lines = [
        "dry run (trainer.dry_run=true): the plan, nothing started",
        *([f"  experiment: {experiment.describe()}"] if experiment else []),
        f"  model: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} kv), vocab "
        f"{m.vocab_size}, ffn {m.ffn_hidden_dim}",
        f"  parameters: {n['total']:,} total, {n['non_embedding']:,} non-embedding",
        f"  batch: {rt.world_size} rank(s) x micro {plan.micro_batch} x accum {plan.grad_accum} = "
        f"{plan.global_batch} sequences x {t.seq_len} tokens = {plan.tokens_per_step:,} "
        f"tokens/step",
        f"  steps: {t.max_steps:,} (warmup {cfg.optim.warmup_steps}) = {tokens:,} tokens; "
        f"{epochs}",
        f"  FLOPs: {fpt:.3g}/token x {tokens:.3g} tokens = {fpt * tokens:.3g}",
        f"  estimated time: {seconds * t.max_steps / 60:.1f} min ({seconds:.3g} s/step; {how})",
        f"  output: {t.output_dir}",
    ]
    print("\n".join(lines), flush=True)


def _estimate_step_seconds(m, plan: BatchPlan, rt, ds) -> tuple:
    """Seconds per optimizer step on this machine: timed forward+backward passes of the model
    (small models), else its FLOPs over a matmul peak at an assumed 40% MFU."""
    import time

    import torch

    from llama_train.engine import peak_flops, resolve_precision
    from llama_train.model import Transformer, count_params, flops_per_token

    precision = resolve_precision(ds, rt.device_type)
    if count_params(m)["total"] > 3e8:
        per_token = flops_per_token(m, plan.seq_len)
        peak = peak_flops(rt.device, precision)
        return (per_token * plan.tokens_per_step / rt.world_size / (0.4 * peak),
                f"FLOPs over this device's {peak:.3g} FLOP/s matmul peak at an assumed 40% MFU")
    model = Transformer(m, device=rt.device, seed=0)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    x = torch.randint(0, m.vocab_size, (plan.micro_batch, plan.seq_len), device=rt.device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        if rt.device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    micro = sorted(times[1:])[0]
    return (micro * plan.grad_accum,
            f"forward+backward of one micro-batch timed here x {plan.grad_accum} per step; the "
            f"optimizer and communication come on top")


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


def plan_experiment(cfg: Config, world_size: int):
    """experiment=compute_optimal|inference_optimal|isoflop: the config this run trains with
    (model shape, steps, warmup from the plan) and the plan; ``cfg`` itself is left alone."""
    if cfg.scaling.mode == "none":
        return cfg, None
    from llama_train.scaling import plan_experiment as plan_for

    if cfg.data.val_fraction == 0:
        raise ConfigError(f"scaling.mode={cfg.scaling.mode} compares runs by their validation "
                          f"loss, but data.val_fraction=0 leaves no validation split: set "
                          f"data.val_fraction > 0 (default 0.01).")
    t = cfg.trainer
    tokens_per_step = resolve_batch(t, world_size).global_batch * t.seq_len
    exp = plan_for(cfg.scaling, cfg.model, t.seq_len, tokens_per_step, cfg.optim.warmup_steps,
                   base_lr=cfg.optim.lr)
    log.info("scaling %s", exp.describe())
    optim = replace(cfg.optim, warmup_steps=exp.warmup_steps,
                    lr=exp.lr if exp.lr is not None else cfg.optim.lr)
    return replace(cfg, model=exp.model, trainer=replace(t, max_steps=exp.max_steps), optim=optim), exp


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


def train(cfg: Config, hooks: Sequence[Hook] = ()) -> Dict[str, Any]:
    """The whole job in this process (one rank, or one of the launcher's)."""
    from llama_train.trainer import Trainer

    pre = preflight(cfg)
    try:
        return Trainer(pre, hooks).fit()
    finally:
        pre.release()


# ------------------------------------------------------------------------------------------------
# Entry points


def _strip_launcher_args(argv: List[str]) -> List[str]:
    """The deepspeed launcher appends ``--local_rank=N``; Hydra would reject it."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
            continue
        if a in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip = True
            continue
        out.append(a)
    return out


# Exit codes (docs/reliability.md): 2 bad config or data, 3 a checkpoint could not be saved or
# loaded, 4 the fault policy gave up, 5 another rank was lost.
EXIT_BAD_INPUT, EXIT_CHECKPOINT, EXIT_ABORTED, EXIT_LOST_RANK = 2, 3, 4, 5
LOST_RANK_EXIT_DELAY_S = 2.5


def run_job(dcfg: DictConfig, hooks: Sequence[Hook] = ()) -> Optional[float]:
    """One Hydra job (one of a --multirun sweep): train, and turn failures into exit codes."""
    from llama_train.checkpoint import CheckpointError
    from llama_train.faults import find_comm_error
    from llama_train.recovery import TrainingAborted
    from llama_train.trainer import Trainer

    trainer = pre = None
    try:
        cfg = load_config(dcfg)
        cfg, own_dir = sweep_job_dir(cfg, dcfg)
        if cfg.trainer.dry_run:
            dry_run(cfg)
            return None
        pre = preflight(cfg)
        pre.command = _job_command()
        if own_dir and pre.rt.rank == 0:
            log.info("--multirun job %s trains in its own trainer.output_dir=%s", own_dir,
                     cfg.trainer.output_dir)
        trainer = Trainer(pre, hooks)
        result = trainer.fit()
    except ValueError as e:  # ConfigError, DataError, ModelArgs checks: a message, not a trace
        _fail(EXIT_BAD_INPUT, e)
    except (CheckpointError, TrainingAborted) as e:
        _fail(EXIT_CHECKPOINT if isinstance(e, CheckpointError) else EXIT_ABORTED, e)
    except OSError as e:
        if not (trainer and _in_output_dir(e, trainer.cfg.trainer.output_dir)):
            raise
        msg = _unwritable(e, trainer.cfg.trainer.output_dir)
        log.error("%s", msg)
        print(f"llama-train: error: {msg}", file=sys.stderr)
        logging.shutdown()
        # Only this rank knows: exit now, before the other ranks, which lose it in their next
        # collective (exit 5), so the launcher reports this exit code. A teardown would wait on
        # them and the disk; the lock and everything else go with the process.
        exit_skipping_teardown(EXIT_CHECKPOINT)
    except Exception as e:
        import torch.distributed as dist

        comm = find_comm_error(e)
        if comm is None or not (dist.is_initialized() and dist.get_world_size() > 1):
            raise
        _exit_lost_rank(comm, trainer.cfg.comm.timeout_s if trainer else 60.0,
                        trainer.state.step + 1 if trainer else None)
    finally:
        if pre is not None:
            pre.release()
    return result["val_loss"]


def _job_command() -> Optional[str]:
    """This job's command line: ``llama-train`` and its overrides (one job's own values under
    --multirun), so a sweep's point can be rerun alone (recorded in run_info.json)."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return " ".join(["llama-train", *(shlex.quote(o) for o in HydraConfig.get().overrides.task)])


# A write that fails because of the disk (not a bug): exit 3, like a failed save.
DISK_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO)


def _in_output_dir(e: OSError, output_dir: str) -> bool:
    out = Path(output_dir).absolute()
    return (e.errno in DISK_ERRNOS and e.filename is not None
            and (out == Path(e.filename).absolute() or out in Path(e.filename).absolute().parents))


def _unwritable(e: OSError, output_dir: str) -> str:
    """What a run that can no longer write its files (metrics, samples, run info) says."""
    from llama_train.checkpoint import find_latest

    latest, _ = find_latest(Path(output_dir) / "checkpoints", checksums=False)
    kept = (f"the last complete checkpoint, {latest}, is intact" if latest else
            "no checkpoint had been saved yet")
    return (f"cannot write {e.filename}: {e.strerror} (trainer.output_dir={output_dir} is "
            f"read-only, full or gone). Stopped; {kept}. Fix the disk or mount and relaunch: "
            f"the run resumes from the last complete checkpoint.")


def sweep_job_dir(cfg: Config, dcfg: DictConfig):
    """(config, job name): under --multirun each job trains in its own directory,
    ``<trainer.output_dir>/<this job's swept key=value,...>``, so no job of a sweep resumes
    another's checkpoint, and rerunning the sweep resumes each job where it stopped. Left alone
    (name None) outside --multirun, and when trainer.output_dir already differs per job: swept
    itself, or built from a swept key or Hydra's job directory."""
    import hashlib

    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return cfg, None
    hc = HydraConfig.get()
    parsed = OverridesParser.create().parse_overrides(
        [a for a in sys.argv[1:] if not a.startswith("-")])
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    raw = str(OmegaConf.to_container(dcfg.trainer, resolve=False)["output_dir"])
    if "trainer.output_dir" in swept or "hydra" in raw or any(k in raw for k in swept):
        return cfg, None
    parts = [o.lstrip("+~") for o in hc.overrides.task if o.lstrip("+~").split("=")[0] in swept]
    name = (",".join(parts) or f"job{hc.job.num}").replace(os.sep, "_")
    if len(name) > 120:  # a file name has at most 255 bytes
        name = f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"
    out = os.path.join(cfg.trainer.output_dir, name)
    return replace(cfg, trainer=replace(cfg.trainer, output_dir=out)), name


def _exit_lost_rank(comm: BaseException, timeout_s: float, step: Optional[int]) -> None:
    """A collective failed: say which rank is gone (as far as the store can tell) and exit at
    once; the process group is broken and a clean shutdown could block on it."""
    import traceback

    import torch.distributed as dist

    from llama_train import watchdog
    from llama_train.faults import diagnose_lost_ranks

    # The launcher is tearing the job down: a DataLoader worker it terminates must not
    # interrupt the diagnosis through torch's SIGCHLD handler.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    rank, world = dist.get_rank(), dist.get_world_size()
    frames = traceback.extract_tb(comm.__traceback__)
    where = ([f for f in frames if "llama_train" in f.filename] or frames)[-1]
    log.error("rank %d: a collective failed (%s, %s:%d); checking which ranks are alive",
              rank, where.name, Path(where.filename).name, where.lineno)
    who = diagnose_lost_ranks(rank, world, wait_s=min(3.0, float(timeout_s)))
    first = str(comm).strip().splitlines()[0][:300] if str(comm).strip() else type(comm).__name__
    msg = (f"rank {rank} lost contact with the job{f' at step {step}' if step else ''}: {who}. "
           f"Collective error: {first}. Relaunch the job: it resumes from the last complete "
           f"checkpoint.")
    log.error(msg)
    print(f"llama-train: error: {msg}", file=sys.stderr)
    # a rank that did not check in may be alive with its loop stuck (its heartbeat runs, so its
    # watchdog saw nothing wrong): it prints its stacks and exits when it reads this
    watchdog.abort_job(msg)
    logging.shutdown()
    # The rank that caused this (killed, or out with its own code: 3 for an unwritable
    # output_dir) is gone already: let the launcher, which polls its ranks once a second in no
    # fixed order, see that exit first, so the job's status is the cause's, not this one's.
    time.sleep(LOST_RANK_EXIT_DELAY_S)
    exit_skipping_teardown(EXIT_LOST_RANK)


def _fail(code: int, e: BaseException) -> None:
    log.error("%s: %s", type(e).__name__, e)
    print(f"llama-train: error: {e}", file=sys.stderr)
    raise SystemExit(code) from None


def _dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's Python stack to the process's stderr (the
    rank's log under the launcher) and the process goes on: a job that hangs with its heartbeats
    alive (a loop stuck in a collective or a data wait) can be read without py-spy. DataLoader
    workers, forked from the rank, inherit it. Skipped where stderr is no file (an embedding
    program that captured it)."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 (Windows); no fileno()
        pass


def main(hooks: Sequence[Hook] = ()) -> None:
    """``llama-train``: Hydra overrides from argv; ``hooks`` for programs that embed the trainer
    (``llama-bench train``)."""
    from llama_train.config import explain_composition_error

    sys.argv = [sys.argv[0]] + _strip_launcher_args(sys.argv[1:])
    _dump_stacks_on_sigusr1()
    # Hydra re-raises instead of printing its own trace and exiting 1: a command line it cannot
    # compose is bad input (exit 2, with a message) like every other.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    in_job = []

    def job(dcfg: DictConfig) -> Optional[float]:
        in_job.append(True)
        try:
            return run_job(dcfg, hooks)
        finally:
            in_job.pop()

    try:
        hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="config")(job)()
    except Exception as e:
        msg = explain_composition_error(e)
        if msg is None and isinstance(e, OSError) and not in_job:
            # Hydra creates its own directories (a --multirun sweep's) before a job starts
            msg = (f"Hydra cannot create {e.filename}: {e.strerror or e}. Point hydra.sweep.dir "
                   f"at a directory path you can write.")
        if msg is None:
            raise
        _fail(EXIT_BAD_INPUT, ConfigError(msg))
    finally:
        # One process group serves all jobs of a --multirun sweep (DeepSpeed caches its groups,
        # so it is not torn down and rebuilt between jobs); it ends with the sweep.
        if "deepspeed" in sys.modules:  # imported by a job: there may be a group to end
            from llama_train.engine import shutdown_distributed

            shutdown_distributed()


if __name__ == "__main__":
    main()
