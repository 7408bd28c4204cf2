"""Where ``llama-train``'s primary config comes from: the package's configs/, or a run's saved
config.yaml given with ``--config-dir``/``--config-name`` (a rerun), and the command line Hydra
then reads. Used by the entry point (llama_train.train) and the sweep check
(llama_train.job.sweep)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

from omegaconf import DictConfig

from llama_train.config import ConfigError
from llama_train.paths import CONFIG_DIR


@dataclass(frozen=True)
class ConfigSource:
    """This command's primary config: the package's configs/, or the ``--config-dir`` that holds
    the ``--config-name`` file (a run's saved config.yaml)."""

    dir: Path
    name: str
    argv: List[str]  # the command line Hydra reads
    search: Tuple[str, ...] = ()  # the hydra.searchpath override that keeps configs/'s groups
    flags: Tuple[str, ...] = ()  # --config-dir and --config-name as given (run_info's command)


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
