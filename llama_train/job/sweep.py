"""``llama-train --multirun``: where each job of a sweep trains (:func:`sweep_job_dir`, the
``${llama_train.sweep_subdir:}`` resolver), and every job's config checked before the first
starts (:func:`_check_sweep`)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import List

from omegaconf import DictConfig

from llama_train.config import Config, ConfigError, load_config
from llama_train.errors import BadInput
from llama_train.job.config_source import ConfigSource, _cli_overrides
from llama_train.util import within


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


def _check_sweep(overrides: List[str], source: ConfigSource) -> None:
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
    from llama_train.job.plan import plan_job

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
        raise ConfigError(
            f"{len(bad)} of the {len(jobs)} jobs of this --multirun sweep cannot run; none was "
            f"started. " + " | ".join(bad))


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
