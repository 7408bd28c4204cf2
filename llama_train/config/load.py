"""Loading: Hydra's composed DictConfig -> the dataclasses (:func:`load_config`), refusing unknown
keys (with the closest valid ones) and non-finite numbers by key; Hydra's composition errors
as one message naming the key and the fix (:func:`explain_composition_error`); and the way
back, a plain dict with secrets scrubbed (:func:`to_container`: config.yaml, checkpoints, W&B).
"""

from __future__ import annotations

from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf

from llama_train.config.schema import Config
from llama_train.errors import ConfigError


def flatten(d: Any, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty dict stays a leaf)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v
                   else {f"{prefix}{k}": v})
    return out


def _reject_unknown_keys(node: DictConfig, prefix: str) -> None:
    """Hydra's ``+key=value`` can force a key into a typed node; we still refuse it."""
    import dataclasses

    typ = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
    for key in node.keys():
        name = f"{prefix}{key}"
        if fields is not None and key not in fields and not str(key).startswith("_"):
            raise ConfigError(unknown_key_message(name))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _reject_unknown_keys(child, f"{name}.")


def config_keys() -> List[str]:
    """Every key a user can set (``trainer.max_steps``, ``tracking.wandb.mode``, ...)."""
    return sorted(flatten(OmegaConf.to_container(OmegaConf.structured(Config))))


def unknown_key_message(key: str) -> str:
    """An unknown key, with the closest valid ones (a typo is the usual cause)."""
    import difflib

    keys = config_keys()
    near = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
    here = [k for k in keys if parent and k.startswith(parent) and "." not in k[len(parent):]]
    hint = (f"did you mean {' or '.join(near)}?" if near else
            f"valid keys under {parent[:-1]}: {', '.join(k[len(parent):] for k in here)}"
            if here else f"the groups are {', '.join(sorted({k.split('.')[0] for k in keys}))}")
    return (f"unknown config key {key!r}: {hint} (`llama-train --cfg job` prints every key with "
            f"its value).")


def _list_entry_types(node: Optional[type] = None) -> list:
    """The dataclasses that are list entries somewhere in the config (data.mixture's), found
    from the structured config's type hints."""
    import dataclasses
    import typing

    out = []
    for hint in typing.get_type_hints(node or Config).values():
        if dataclasses.is_dataclass(hint):
            out += _list_entry_types(hint)
        elif typing.get_origin(hint) is list:
            out += [t for t in typing.get_args(hint) if dataclasses.is_dataclass(t)]
    return out


def explain_composition_error(e: BaseException) -> Optional[str]:
    """Hydra's error for a command line it could not compose, as one message that names the
    key and the fix; None for anything else."""
    import difflib
    import re

    from hydra.errors import (ConfigCompositionException, MissingConfigException,
                              OverrideParseException, SearchPathException)
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cause = e.__cause__
    if isinstance(e, MissingConfigException) and e.options:
        m = re.search(r"Could not find '(?:.*/)?([^/']+)/([^/']+)'", str(e))
        if m:
            group, name = m.groups()
            near = difflib.get_close_matches(name, e.options, n=1, cutoff=0.85)
            return (f"{group}={name}: there is no such {group} config"
                    + (f"; did you mean {group}={near[0]}?" if near else ".")
                    + f" Available: {', '.join(e.options)} (configs/{group}/).")
    if isinstance(e, OverrideParseException):
        return (f"cannot parse an override on the command line (Hydra: {first.rstrip('.')}). "
                f"Overrides are key=value, e.g. trainer.max_steps=100; a sweep (with "
                f"--multirun) is key=a,b.")
    if isinstance(e, ConfigCompositionException) and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        m = re.search(r"override '([^']+)'", first)
        inner = re.search(r"Key '([^']+)' not in '(\w+)'", str(cause))
        typ = next((t for t in _list_entry_types() if inner and t.__name__ == inner.group(2)),
                   None)
        if m and typ is not None:  # a key inside an entry of a list (data.mixture)
            import dataclasses

            valid = [f.name for f in dataclasses.fields(typ)]
            near = difflib.get_close_matches(inner.group(1), valid, n=1)
            return (f"{m.group(1)}: unknown key {inner.group(1)!r} in an entry"
                    + (f"; did you mean {near[0]}?" if near else "")
                    + f" Valid keys: {', '.join(valid)}.")
        return unknown_key_message(m.group(1) if m else str(cause.full_key))
    if isinstance(e, ConfigCompositionException) and isinstance(cause, ValidationError):
        m = re.search(r"override (\S+)", first)
        said = str(cause).split("\n")[0].rstrip(".")
        return (f"{m.group(1) if m else cause.full_key}: {said}. Give {cause.full_key} a value "
                f"of its type (`llama-train --cfg job` shows each key's current value).")
    if isinstance(e, SearchPathException):  # --config-dir: e.g. a run directory not there
        return (f"{first.rstrip('.')}: give --config-dir a directory that exists (a run's "
                f"output_dir holds its config.yaml: --config-name config).")
    if isinstance(e, (ConfigCompositionException, MissingConfigException)):
        return f"the config could not be composed: {first}"
    return None


def _reject_non_finite(dcfg: DictConfig) -> None:
    """No setting means anything as NaN or infinity (``optim.lr=inf`` turned every weight NaN
    in one step): refuse them all by key, before any group is built."""
    import math

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list):  # data.mixture's entries
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number: give {key} a finite "
                              f"value (`llama-train --cfg job` shows its default).")

    try:
        container = OmegaConf.to_container(dcfg, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation error: the dataclasses report it
        return
    walk(container, "")


def load_config(dcfg: DictConfig) -> Config:
    """Hydra's composed config -> dataclasses; every group validates itself on the way."""
    dcfg = _on_the_schema(dcfg)
    _reject_unknown_keys(dcfg, "")
    _reject_non_finite(dcfg)
    try:
        return OmegaConf.to_object(dcfg)
    except Exception as e:  # OmegaConf wraps __post_init__ errors; keep the message
        cause = e.__cause__ or e
        raise ConfigError(str(cause).split("\n    full_key")[0]) from None


def _on_the_schema(dcfg: DictConfig) -> DictConfig:
    """A config file without our schema in its defaults (``--config-dir <run dir> --config-name
    config``: a run's saved config.yaml) composes to plain dicts, which failed at the first key
    read (an AttributeError); merged onto the schema, its keys and types are checked like any
    composed config's."""
    if OmegaConf.get_type(dcfg) is Config:
        return dcfg
    from omegaconf.errors import ConfigKeyError

    try:
        return OmegaConf.merge(OmegaConf.structured(Config), dcfg)
    except ConfigKeyError as e:  # a key the schema does not have
        raise ConfigError(unknown_key_message(e.full_key)) from None
    except Exception as e:  # noqa: BLE001 - a value of the wrong type: OmegaConf names the key
        raise ConfigError(f"{getattr(e, 'full_key', '')}: {str(e).splitlines()[0]}") from None


def to_container(cfg: DictConfig | Config) -> dict:
    """A plain, fully resolved dict (for saving and W&B) with secrets scrubbed."""
    if isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True)
    else:
        data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return scrub_secrets(data)


# Whole key names, not substrings: "token" must not hide data.tokenizer (a path) or
# trainer.global_batch_tokens. Case-insensitive; '-' counts as '_'.
_SECRET_NAMES = ("api_key", "apikey", "token", "secret", "password")
_SECRET_SUFFIXES = ("_token", "_key", "_apikey", "_secret", "_password")


def is_secret_key(key: Any) -> bool:
    """Whether a config key names a credential: one of _SECRET_NAMES, or ending in one of
    _SECRET_SUFFIXES (hf_token, aws_secret_key, db_password)."""
    k = str(key).lower().replace("-", "_")
    return k in _SECRET_NAMES or k.endswith(_SECRET_SUFFIXES)


def scrub_secrets(obj: Any) -> Any:
    """``obj`` with every string value under a secret key (is_secret_key) replaced by '***',
    and every credential of the environment inside any other string by ``$NAME``
    (scrub_secret_values), through nested dicts and lists (what config.yaml, checkpoints,
    run_info.json and W&B get). docs/reliability.md: secrets in saved files."""
    def by_key(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: ("***" if is_secret_key(k) and isinstance(v, str) else by_key(v))
                    for k, v in o.items()}
        if isinstance(o, list):
            return [by_key(v) for v in o]
        return o

    from llama_train.records import scrub_secret_values

    return scrub_secret_values(by_key(obj))
