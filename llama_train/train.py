"""``llama-train``: the Hydra app and its exit codes. Composes the config, runs
:func:`llama_train.job.preflight.preflight` (checks and data, before any process group exists), then
:func:`llama_train.job.trainer.start` and the loop; turns every failure into an exit code and one
line that says what to do.

Works unchanged under the ``deepspeed`` launcher (its ``--local_rank=N`` is taken off argv before
Hydra parses it) and as a plain single process. Exit codes (docs/reliability.md): 2 bad config or
data, a :class:`llama_train.errors.BadInput` (also the rendezvous: MASTER_PORT in use,
MASTER_ADDR unresolvable), 3 a checkpoint could not be saved or loaded, 4 the fault policy gave
up, 5 another rank was lost, 6 a DataLoader worker of this rank died (the OOM killer's SIGKILL, a
crash), 128+N stopped by signal N (130: Ctrl-C) after saving. Any other exception is a bug: it
keeps its traceback (exit 1).
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import hydra
from omegaconf import DictConfig

from llama_train.config import Config, ConfigError, load_config
from llama_train.errors import BadInput
from llama_train.hooks import Hook
from llama_train.job.config_source import ConfigSource, _cli_overrides, config_source
from llama_train.job.preflight import preflight, setup_logging
from llama_train.job.sweep import _check_sweep, _register_sweep_subdir, sweep_job_dir
from llama_train.paths import CONFIG_DIR  # noqa: F401 - read here by programs and tests
from llama_train.proc import exit_skipping_teardown, limit_retained_heap
from llama_train.util import free_bytes, say_error, within

log = logging.getLogger("llama_train")


def train(cfg: Config, hooks: Sequence[Hook] = ()) -> Dict[str, Any]:
    """The whole job in this process (one rank, or one of the launcher's)."""
    from llama_train.job.trainer import start

    pre = preflight(cfg)
    try:
        trainer = start(pre, hooks)
        if trainer is None:  # the run had already reached trainer.max_steps
            from llama_train.records import RunInfo

            return {"complete": True,
                    "val_loss": RunInfo.final_val_loss_of(cfg.trainer.output_dir)}
        return trainer.fit()
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


# Exit codes (docs/reliability.md): 2 bad config or data (BadInput: llama_train.errors; a bare
# ValueError is a bug, exit 1 with its traceback), 3 a checkpoint could not be saved or
# loaded, 4 the fault policy gave up, 5 another rank was lost, 6 a DataLoader worker died
# (llama_train.data.loader.DataWorkerDied, raised as a DataInterrupted with its exit_code);
# 128+N stopped by signal N (llama_train.job.trainer.StopSignals).
EXIT_BAD_INPUT, EXIT_CHECKPOINT, EXIT_ABORTED, EXIT_LOST_RANK = 2, 3, 4, 5
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C: 130, as a shell reports a command it ended
LOST_RANK_EXIT_DELAY_S = 2.5


def run_job(dcfg: DictConfig, hooks: Sequence[Hook] = ()) -> Optional[float]:
    """One Hydra job (one of a --multirun sweep): train, and turn failures into exit codes."""
    from llama_train.checkpoint import CheckpointError
    from llama_train.data.errors import DataInterrupted
    from llama_train.job.faults import find_comm_error
    from llama_train.job.recovery import TrainingAborted
    from llama_train.job.trainer import start

    trainer = pre = cfg = None
    try:
        cfg = load_config(dcfg)
        cfg, own_dir = sweep_job_dir(cfg, dcfg)
        if cfg.trainer.dry_run:
            from llama_train.job.dry_run import dry_run

            dry_run(cfg)
            return None
        pre = preflight(cfg)
        pre.command = _job_command()
        if own_dir and pre.rt.rank == 0:
            log.info("--multirun job %s trains in its own trainer.output_dir=%s", own_dir,
                     cfg.trainer.output_dir)
        trainer = start(pre, hooks)
        if trainer is None:  # the run had already reached trainer.max_steps
            from llama_train.records import RunInfo

            return RunInfo.final_val_loss_of(pre.cfg.trainer.output_dir)
        result = trainer.fit()
    except DataInterrupted as e:
        # the data changed under the running job (DataChanged: exit 3), or a DataLoader worker
        # died (DataWorkerDied: exit 6), seen by this rank alone, maybe: one line and exit now,
        # as for an unwritable output_dir below
        say_error(str(e))
        logging.shutdown()
        exit_skipping_teardown(e.exit_code)
    except BadInput as e:  # ConfigError, DataError, WeightsError, ModelArgs checks: one line
        _fail(EXIT_BAD_INPUT, e)  # (any other exception is a bug: it keeps its traceback)
    except (CheckpointError, TrainingAborted) as e:
        _fail(EXIT_CHECKPOINT if isinstance(e, CheckpointError) else EXIT_ABORTED, e)
    except OSError as e:
        import torch.distributed as dist

        if (find_comm_error(e) is not None and dist.is_initialized()
                and dist.get_world_size() > 1):  # "Connection lost": the job is going down
            _exit_lost_rank(e, trainer.cfg.comm.timeout_s if trainer else 60.0,
                            trainer.state.step + 1 if trainer else None)
        if not (trainer and _in_output_dir(e, trainer.cfg.trainer.output_dir)):
            if e.errno not in (*DISK_ERRNOS, errno.EBUSY):
                raise
            # a disk the run reads or writes outside its checkpoints (the data cache, the HF
            # cache, the archive): a disk problem, not a bug and not the config
            _fail(EXIT_CHECKPOINT, OSError(_disk_error(e, cfg if pre is None else pre.cfg)))
        msg = _unwritable(e, trainer.cfg.trainer.output_dir)
        say_error(msg)
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


_source: Optional[ConfigSource] = None  # this process's: _job_command records its flags


def _job_command() -> Optional[str]:
    """This job's command line: ``llama-train`` and its overrides (one job's own values under
    --multirun), so a sweep's point can be rerun alone (recorded in run_info.json)."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    # a rerun of a saved config.yaml is that file and its overrides: without --config-dir the
    # command would train the package's defaults
    words = [*(_source.flags if _source is not None else ()), *HydraConfig.get().overrides.task]
    return " ".join(["llama-train", *(shlex.quote(o) for o in words)])


# A write that fails because of the disk (not a bug): exit 3, like a failed save.
DISK_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO)


def _in_output_dir(e: OSError, output_dir: str) -> bool:
    return e.errno in DISK_ERRNOS and e.filename is not None and within(e.filename, output_dir)


def _disk_error(e: OSError, cfg: Optional[Config]) -> str:
    """What an OSError on a file outside the checkpoints says: the file, the cause, the free
    space of its filesystem, and which setting puts files there."""
    from llama_train.paths import cache_dir

    path = Path(e.filename or ".").absolute()
    where = "its location"
    if cfg is not None:
        for root, key in ((cfg.trainer.output_dir, "trainer.output_dir"),
                          (cfg.data.prepared_dir, "data.prepared_dir"),
                          (cache_dir(), "the LLAMA_TRAIN_CACHE directory (data.prepared_dir)"),
                          (os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface",
                           "the Hugging Face cache (HF_HOME / HF_DATASETS_CACHE)")):
            if root and within(path, root):
                where = key
                break
    free = free_bytes(path)
    free = f"; {free / 2**20:.1f} MiB free on its filesystem" if free is not None else ""
    cause, fix = _disk_cause(e)
    return (f"cannot use {path}: {cause} ({e.strerror}){free}. {fix}, or point {where} "
            f"elsewhere, then relaunch; checkpoints already saved are intact.")


def _disk_cause(e: OSError) -> Tuple[str, str]:
    """(the cause of a disk error in words, what to do about it), by its errno: a full disk
    is not fixed by permissions, nor a read-only mount by free space."""
    return {
        errno.ENOSPC: ("the disk is full", "Free space on it"),
        errno.EDQUOT: ("the disk quota is exhausted", "Free space within the quota or raise it"),
        errno.EROFS: ("the filesystem is read-only", "Remount it read-write"),
        errno.EACCES: ("this user may not write there", "Give this user write permission"),
        errno.EPERM: ("the operation is not permitted there",
                      "Give this user write permission"),
        errno.EIO: ("the disk returned an I/O error", "Check the disk (`dmesg` names the device)"),
        errno.EBUSY: ("the file is busy (in use by another program, or a mount point)",
                      "Free it"),
    }.get(e.errno, (e.strerror or str(e), "Fix the disk"))


def _unwritable(e: OSError, output_dir: str) -> str:
    """What a run that can no longer write its files (metrics, samples, run info) says."""
    from llama_train.checkpoint import find_latest

    latest, _ = find_latest(Path(output_dir) / "checkpoints", checksums=False)
    kept = (f"the last complete checkpoint, {latest}, is intact" if latest else
            "no checkpoint had been saved yet")
    cause, fix = _disk_cause(e)
    then = ("the run resumes from the last complete checkpoint" if latest else
            "the run starts again from step 0")
    return (f"cannot write {e.filename}: {e.strerror} ({cause}: trainer.output_dir={output_dir}). "
            f"Stopped; {kept}. {fix} and relaunch: {then}.")


def _exit_lost_rank(comm: BaseException, timeout_s: float, step: Optional[int]) -> None:
    """A collective failed: say which rank is gone (as far as the store can tell) and exit at
    once; the process group is broken and a clean shutdown could block on it."""
    import traceback

    import torch.distributed as dist

    from llama_train import watchdog
    from llama_train.job.faults import diagnose_lost_ranks

    # The launcher is tearing the job down: a DataLoader worker it terminates must not
    # interrupt the diagnosis through torch's SIGCHLD handler, and the SIGTERM it sends this
    # rank (within its 1 s poll of the dead one) must not cut the report short: this rank exits
    # within a few seconds anyway, and the launcher SIGKILLs it after 30 s.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
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
    say_error(msg)
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
    say_error(str(e))
    raise SystemExit(code) from None


def _job_config_request(argv: List[str]) -> Optional[List[str]]:
    """The overrides of a ``--cfg job`` (``-c job``, ``--cfg=job``) command, or None: not asked
    for, or asked with Hydra's other flags (--multirun, --package, --cfg hydra|all), which stay
    Hydra's."""
    args, asked = [], False
    pairs = zip(argv, [*argv[1:], None])
    for a, after in pairs:
        if a in ("--cfg", "-c") and after == "job":
            asked = True
            next(pairs)  # the "job" that followed
        elif a == "--cfg=job":
            asked = True
        elif a != "--resolve":  # what we print is resolved anyway
            args.append(a)
    if not asked or any(a.startswith("-") for a in args):
        return None
    return args


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

    global _source
    sys.argv = [sys.argv[0]] + _strip_launcher_args(sys.argv[1:])
    setup_logging(int(os.environ.get("RANK", "0")))  # preflight sets it again, as the rank
    _dump_stacks_on_sigusr1()
    given, _source = sys.argv[1:], None
    try:
        _source = source = config_source(given)
    except ConfigError as e:
        _fail(EXIT_BAD_INPUT, e)
    sys.argv = [sys.argv[0], *source.argv]
    _register_sweep_subdir()
    if "--multirun" in sys.argv or "-m" in sys.argv:
        try:
            _check_sweep(_cli_overrides(given), source)
        except ConfigError as e:  # a job of the sweep that cannot run, named
            _fail(EXIT_BAD_INPUT, e)
    overrides = _job_config_request(sys.argv[1:])
    if overrides is not None:  # --cfg job: the config the run trains with, not the composed one
        from llama_train.job.dry_run import print_job_config

        try:
            print_job_config(overrides)
        except Exception as e:  # noqa: BLE001 - as a job's config errors: one line, exit 2
            msg = explain_composition_error(e) or (str(e) if isinstance(e, BadInput) else None)
            if msg is None:
                raise
            _fail(EXIT_BAD_INPUT, ConfigError(msg))
        return
    # Hydra re-raises instead of printing its own trace and exiting 1: a command line it cannot
    # compose is bad input (exit 2, with a message) like every other.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    def job(dcfg: DictConfig) -> Optional[float]:
        try:
            return run_job(dcfg, hooks)
        except OSError as e:  # the job's own, not Hydra's (one that run_job did not explain)
            e.llama_train_job = True
            raise

    try:
        hydra.main(version_base=None, config_path=str(source.dir), config_name="config")(job)()
    except Exception as e:
        msg = explain_composition_error(e)
        if msg is None and isinstance(e, OSError) and not getattr(e, "llama_train_job", False):
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


def cli() -> None:
    """The command (``llama-train``, ``python -m llama_train.train``, each rank under the
    launcher): :func:`main`, then, once every exit handler has run (W&B, logging), exit with
    its code without the interpreter's teardown. Unloading DeepSpeed and torch took 0.9-1.5 s
    of every finished process, for nothing, and a teardown with a process group's C++ threads
    still alive can abort ("terminate called without an active exception": exit 250 for a job
    that had refused cleanly with exit 3). Programs that embed :func:`main` keep their
    interpreter; an unexpected exception keeps its traceback and the normal exit."""
    import atexit

    limit_retained_heap()  # before the model's first allocation (llama_train.proc)
    code = 0
    try:
        main()
    except SystemExit as e:  # our exit codes (and Hydra's --help, --cfg: exit 0)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # Ctrl-C outside the loop (the loop saves and says so itself)
        code = EXIT_INTERRUPTED
        if os.environ.get("RANK", "0") == "0":
            print("llama-train: interrupted (Ctrl-C) outside the training loop (starting up, or "
                  "finishing after the last save): nothing more was saved; checkpoints already "
                  "saved are intact, and the same command resumes from the newest.",
                  file=sys.stderr)
    atexit._run_exitfuncs()
    exit_skipping_teardown(code)


if __name__ == "__main__":
    cli()
