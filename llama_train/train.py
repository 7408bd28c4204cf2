"""``llama-train``: the Hydra app and its exit codes. Composes the config, runs
:func:`llama_train.preflight.preflight` (checks and data, before any process group exists), then
:func:`llama_train.trainer.start` and the loop; turns every failure into an exit code and one
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import hydra
from omegaconf import DictConfig

from llama_train.config import Config, ConfigError, load_config
from llama_train.errors import BadInput
from llama_train.hooks import Hook
from llama_train.paths import CONFIG_DIR
from llama_train.preflight import preflight, setup_logging
from llama_train.proc import exit_skipping_teardown, limit_retained_heap
from llama_train.util import free_bytes, say_error, within

log = logging.getLogger("llama_train")


def train(cfg: Config, hooks: Sequence[Hook] = ()) -> Dict[str, Any]:
    """The whole job in this process (one rank, or one of the launcher's)."""
    from llama_train.trainer import start

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
# 128+N stopped by signal N (llama_train.trainer.StopSignals).
EXIT_BAD_INPUT, EXIT_CHECKPOINT, EXIT_ABORTED, EXIT_LOST_RANK = 2, 3, 4, 5
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C: 130, as a shell reports a command it ended
LOST_RANK_EXIT_DELAY_S = 2.5


def run_job(dcfg: DictConfig, hooks: Sequence[Hook] = ()) -> Optional[float]:
    """One Hydra job (one of a --multirun sweep): train, and turn failures into exit codes."""
    from llama_train.checkpoint import CheckpointError
    from llama_train.data.errors import DataInterrupted
    from llama_train.faults import find_comm_error
    from llama_train.recovery import TrainingAborted
    from llama_train.trainer import start

    trainer = pre = cfg = None
    try:
        cfg = load_config(dcfg)
        cfg, own_dir = sweep_job_dir(cfg, dcfg)
        if cfg.trainer.dry_run:
            from llama_train.dry_run import dry_run

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


def sweep_job_dir(cfg: Config, dcfg: DictConfig):
    """(config, job name): under --multirun each job trains in its own directory, so no job of a
    sweep resumes another's checkpoint or trains inside another run's directory, and rerunning
    the sweep resumes each job where it stopped:

    * Hydra's job directory, ``<hydra.sweep.dir>/<hydra.sweep.subdir>``: ``multirun/<this job's
      swept key=value,...>`` (configs/config.yaml; :func:`sweep_subdir`), or any layout set with
      those two keys;
    * ``<trainer.output_dir>/<swept key=value,...>`` where the command line names
      trainer.output_dir (the sweep's own root);
    * trainer.output_dir as it is (name None) where it already differs per job: swept itself,
      or built from a swept key or Hydra's job directory (``${hydra:job.num}``).

    Outside --multirun: left alone (name None)."""
    import re

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return cfg, None
    hc = HydraConfig.get()
    swept = _swept_keys()
    raw = str(OmegaConf.to_container(dcfg.trainer, resolve=False)["output_dir"])
    # an interpolation of a swept key: ${optim.lr}, ${sci:${scaling.flops}}, ${model.dim}
    refers = any(re.search(r"\$\{[^{}]*" + re.escape(k) + r"\b", raw) for k in swept)
    name = None
    if "trainer.output_dir" in swept or "hydra" in raw or refers:
        out = cfg.trainer.output_dir
    elif any(o.lstrip("+~").split("=")[0] == "trainer.output_dir" for o in hc.overrides.task):
        name = sweep_subdir()
        out = os.path.join(cfg.trainer.output_dir, name)
    else:
        name, out = sweep_subdir(), os.path.join(str(hc.sweep.dir), str(hc.sweep.subdir))
        sweep = OmegaConf.to_container(hc.sweep, resolve=False)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "now:" in f"{sweep}":
            raise ConfigError(
                f"hydra.sweep.dir={sweep['dir']} hydra.sweep.subdir={sweep['subdir']}: each rank "
                f"of the launcher resolves ${{now:...}} at its own start, so the ranks could "
                f"train in different directories. Name the sweep's directory instead "
                f"(hydra.sweep.dir=multirun/lr-study), or give trainer.output_dir=<dir>.")
    if not within(out, hc.runtime.output_dir):
        # Hydra created the job's directory before the job; this job trains elsewhere, so an
        # empty directory named like the job would only mislead (every rank: rmdir is atomic)
        try:
            os.rmdir(hc.runtime.output_dir)
        except OSError:  # holds files (another run's), or another rank removed it
            pass
    if out == cfg.trainer.output_dir:
        return cfg, None
    return replace(cfg, trainer=replace(cfg.trainer, output_dir=out)), name


def _register_sweep_subdir() -> None:
    """``${llama_train.sweep_subdir:}``, which configs/config.yaml's hydra.sweep.subdir names
    (:func:`sweep_subdir`; outside a job, where Hydra prints its config: the job's number)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    def subdir() -> str:
        if not HydraConfig.initialized() or OmegaConf.is_missing(HydraConfig.get().job, "num"):
            return "${hydra.job.num}"  # --cfg hydra --resolve: no job
        return sweep_subdir()

    OmegaConf.register_new_resolver("llama_train.sweep_subdir", subdir, replace=True)


def _swept_keys() -> set:
    """The keys (or config groups) this command line sweeps (``optim.lr=1e-3,2e-3``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(_cli_overrides(sys.argv[1:]))
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def sweep_subdir() -> str:
    """A --multirun job's directory name, ``hydra.sweep.subdir``'s default
    (``${llama_train.sweep_subdir:}`` in configs/config.yaml): the job's swept overrides,
    ``optim.lr=0.001`` or ``model=tiny,optim.lr=0.001`` (``/`` in a value becomes ``_``; over
    120 characters, a prefix and a hash); the job's number where the command line sweeps
    nothing (a sweep of the config's own hydra.sweeper.params). The same on every rank and on
    every rerun of the sweep: the ranks of a job share it, a rerun resumes it."""
    import hashlib

    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    swept = _swept_keys()
    parts = [o.lstrip("+~") for o in hc.overrides.task if o.lstrip("+~").split("=")[0] in swept]
    name = (",".join(parts) or str(hc.job.num)).replace(os.sep, "_")
    if len(name) > 120:  # a file name has at most 255 bytes
        name = f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"
    return name


def _exit_lost_rank(comm: BaseException, timeout_s: float, step: Optional[int]) -> None:
    """A collective failed: say which rank is gone (as far as the store can tell) and exit at
    once; the process group is broken and a clean shutdown could block on it."""
    import traceback

    import torch.distributed as dist

    from llama_train import watchdog
    from llama_train.faults import diagnose_lost_ranks

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


def _check_sweep(overrides: List[str], source: "ConfigSource") -> None:
    """--multirun: compose and check every job's config before the first job starts, so a bad
    point of a sweep is named (with its overrides) at once instead of ending the sweep after the
    jobs before it ran. Each group's own checks and those against the world size; what needs
    the data or a checkpoint is still checked by each job. Composed from the config the jobs
    compose (``source``: a run's saved config.yaml on a rerun)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from llama_train.config import explain_composition_error
    from llama_train.engine import Runtime
    from llama_train.plan import plan_job

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:  # noqa: BLE001 - Hydra itself reports a command line it cannot parse
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = os.environ.get("DS_ACCELERATOR") or ("cuda" if _cuda_available() else "cpu")
    # rank 0's view of the launch the jobs run in (what they share: the layout, the batch);
    # ranks per node as a job reads them (engine.detect_runtime)
    rt = Runtime(device, 0, 0, world,
                 int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world))))
    bad = []
    GlobalHydra.instance().clear()
    before = HydraConfig.instance().cfg
    try:
        with initialize_config_dir(config_dir=str(source.dir), version_base=None):
            for n, job in enumerate(jobs):
                try:
                    own = [o for o in job if not o.lstrip("+~").startswith("hydra")]
                    full = compose(source.name, [*source.search, *own], return_hydra_config=True)
                    cfg = load_config(_as_sweep_job(full, n))
                    plan_job(cfg, rt, scope="check")
                except Exception as e:  # noqa: BLE001 - composition errors and bad input
                    msg = explain_composition_error(e) or (str(e) if isinstance(e, BadInput)
                                                            else None)
                    if msg is None:
                        raise
                    bad.append(f"job {n} ({' '.join(job)}): {msg}")
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = before
    if bad:
        _fail(EXIT_BAD_INPUT, ConfigError(
            f"{len(bad)} of the {len(jobs)} jobs of this --multirun sweep cannot run; none was "
            f"started. " + " | ".join(bad)))


def _as_sweep_job(full: DictConfig, num: int) -> DictConfig:
    """A composed config (with its hydra node) as job ``num`` of the sweep sees it: Hydra's
    config set as Hydra sets it before a job, so an interpolation such as
    ``trainer.output_dir=runs/${hydra:job.num}`` resolves; returned without the hydra node."""
    import copy

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    with read_write(full.hydra), open_dict(full.hydra):
        full.hydra.job.num = num
    HydraConfig.instance().set_config(full)
    hc = HydraConfig.get()
    with read_write(full.hydra), open_dict(full.hydra):
        full.hydra.runtime.output_dir = os.path.abspath(
            os.path.join(str(hc.sweep.dir), str(hc.sweep.subdir)))
    HydraConfig.instance().set_config(full)
    task = copy.deepcopy(full)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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


# ------------------------------------------------------------------------------------------------
# Where the primary config comes from


@dataclass(frozen=True)
class ConfigSource:
    """This command's primary config: the package's configs/, or the ``--config-dir`` that holds
    the ``--config-name`` file (a run's saved config.yaml)."""

    dir: Path
    name: str
    argv: List[str]  # the command line Hydra reads
    search: Tuple[str, ...] = ()  # the hydra.searchpath override that keeps configs/'s groups
    flags: Tuple[str, ...] = ()  # --config-dir and --config-name as given (run_info's command)


_source: Optional[ConfigSource] = None  # this process's: _job_command records its flags


def _cli(argv: List[str]) -> Any:
    """Hydra's own reading of a command line (its argparse namespace), or None where it cannot
    read it: Hydra then says why itself."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return get_args_parser().parse_args(argv)
    except SystemExit:
        return None


def _cli_overrides(argv: List[str]) -> List[str]:
    """The overrides of a command line, without Hydra's flags and their values (the path after
    --config-dir is no override)."""
    args = _cli(argv)
    return list(args.overrides) if args is not None else [a for a in argv if not a.startswith("-")]


def _override_value(value: Any) -> str:
    """A YAML scalar written as a Hydra override's value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _package_hydra_settings() -> List[str]:
    """The Hydra settings of the package's config.yaml (no run directory, no .hydra/, no Hydra
    logging) as overrides, for a primary config that has none: a run's saved config.yaml."""
    from omegaconf import OmegaConf

    pkg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"), resolve=False)
    out = [f"{k.removeprefix('override ').strip()}={v}" for d in pkg.get("defaults", [])
           if isinstance(d, dict) for k, v in d.items() if k.startswith("override hydra/")]

    def walk(node: Dict[str, Any], key: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{key}.{k}")
            else:
                out.append(f"{key}.{k}={_override_value(v)}")

    walk(pkg.get("hydra") or {}, "hydra")
    return out


def _refuse_group_overrides(overrides: List[str], file: Path) -> None:
    """``model=llama3_8b`` on a rerun: a saved config.yaml is resolved, with no defaults list,
    so Hydra could only refuse the choice (or, with ``+``, merge the preset's keys into the
    run's, keeping any it does not set). Refused here, with what to do instead."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra itself reports a command line it cannot parse
        return
    for o in parsed:
        group = o.key_or_group
        if o.is_delete() or group.startswith("hydra") or not (CONFIG_DIR / group).is_dir():
            continue
        raise ConfigError(
            f"{o.input_line}: {file} is a run's resolved config, with no config groups to "
            f"choose from. Set its {group} keys one by one instead ({group}.<key>=value; "
            f"--cfg job lists them), or train the preset from the package's configs: "
            f"llama-train {o.input_line.lstrip('+')} ... without --config-dir.")


def config_source(argv: List[str]) -> ConfigSource:
    """Where ``argv``'s primary config comes from, and the command line to give Hydra.

    Hydra searches hydra.main's config_path (the package's configs/) before ``--config-dir``,
    so the package's config.yaml shadowed a run's: ``llama-train --config-dir <run dir>
    --config-name config`` trained the defaults. Where the directory holds that file it becomes
    the primary config directory; configs/ stays on the search path after it (its groups), and
    a file without Hydra settings (a saved config.yaml) gets the package's. A directory without
    the file is refused where it would have trained the package's config.yaml unasked: a
    --config-name given, or no config groups in it either."""
    from omegaconf import OmegaConf

    args = _cli(argv)
    name = (args.config_name if args is not None else None) or "config"
    package = ConfigSource(CONFIG_DIR, name, list(argv))
    if args is None or args.config_dir is None or args.config_path is not None:
        return package
    d = Path(args.config_dir)
    if not d.is_dir():  # Hydra says so (SearchPathException)
        return package
    file = d / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not file.is_file():
        # a directory of config groups, the primary config left to configs/: Hydra's own order
        if args.config_name is None and any(d.glob("*/*.yaml")):
            return package
        raise ConfigError(
            f"--config-dir {d} holds no {file.name}: give the output_dir of a run that wrote "
            f"its config.yaml (--config-name config), or, for a directory of config groups, "
            f"no --config-name.")
    try:
        raw = OmegaConf.load(file)
    except Exception:  # noqa: BLE001 - Hydra reports what is wrong with the file
        raw = None
    own = isinstance(raw, DictConfig) and ("defaults" in raw or "hydra" in raw)
    if not own:
        _refuse_group_overrides(args.overrides, file)
    paths = [*(OmegaConf.select(raw, "hydra.searchpath", default=None) or [] if own else []),
             f"file://{CONFIG_DIR.absolute()}"]
    search = f"hydra.searchpath=[{','.join(_override_value(p) for p in paths)}]"
    extra = [search, *([] if own else _package_hydra_settings())]
    overrides = list(args.overrides)
    at = next((i for i in range(len(argv) - len(overrides), -1, -1)
               if argv[i:i + len(overrides)] == overrides), 0) if overrides else 0
    new = [*argv[:at], *extra, *argv[at:]]
    check = _cli(new)
    if check is None or list(check.overrides) != [*extra, *overrides]:
        raise ConfigError("cannot read this command line: give Hydra's flags (--config-dir, "
                          "--config-name) before the overrides.")
    return ConfigSource(d.absolute(), name, new, (search,),
                        ("--config-dir", args.config_dir, "--config-name", name))


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
        _check_sweep(_cli_overrides(given), source)
    overrides = _job_config_request(sys.argv[1:])
    if overrides is not None:  # --cfg job: the config the run trains with, not the composed one
        from llama_train.dry_run import print_job_config

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
