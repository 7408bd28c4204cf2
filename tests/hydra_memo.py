"""Hydra's composition remembered within a test process (conftest.py installs it in each process
that runs tests, tests/warm_ranks.py in the warm parent the launched ranks are forked from;
LLAMA_TRAIN_TEST_HYDRA_MEMO=0 leaves Hydra as it is in both).

The in-process tier composes llama-train's config ~650 times (the tests' overrides; main() run
in this process): ~85 ms of CPU each, most of it building the defaults list and merging the
same ~17 files, whatever values the overrides set. Both depend only on the config sources, the
config name and the group choices (``model=tiny``), not on the value overrides
(``optim.lr=10``), which Hydra applies afterwards: so both are kept per (sources with every
config file's bytes, group overrides) and handed out as deep copies. So is each config file as
loaded (per path and bytes), and the repository copy Hydra makes for each composition shares
the ConfigStore (which hands out copies itself) instead of copying it. The parsing of every
override, the applying of the values and every check after them run as before (~17 ms a
composition); a step that fails is not kept. What differs: a warning Hydra gives while it builds
the defaults list or merges comes the first time only (Python shows one once per place anyway).
tests/config/test_config.py (test_remembered_compositions_are_hydras_own) compares the outcome
with Hydra's own.
"""

from __future__ import annotations

import copy
import os

_ABSENT = object()
REPLACED: list = []  # (owner, attribute, what it was): undone() puts them back


def _config_sources(repo) -> tuple:
    """What a Hydra repository's sources hold: each file source's directories (groups) and YAML
    files with their bytes; the package and structured sources by name (fixed while a process
    runs: the ConfigStore is filled at import)."""
    out = []
    for src in repo.get_sources():
        out.append((src.scheme(), src.path))
        if src.scheme() != "file":
            continue
        for root, dirs, names in os.walk(src.path):
            dirs.sort()
            out.append(root)
            for name in sorted(n for n in names if n.endswith((".yaml", ".yml"))):
                out.append((name, _bytes(os.path.join(root, name))))
    return tuple(out)


def _bytes(path: str):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _is_value_override(repo, override) -> bool:
    """What Hydra's defaults list files under config_overrides (hydra._internal.defaults_list.
    Overrides): not a sweep, and a dict or not a config group."""
    if override.is_sweep_override():
        return False
    return isinstance(override.value(), dict) or not repo.group_exists(override.key_or_group)


def _replace(owner, name: str, value) -> None:
    REPLACED.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def _remember_defaults_lists(loader) -> None:
    from hydra._internal.defaults_list import DefaultsList

    create_defaults_list, kept = loader.create_defaults_list, {}

    def defaults_list(repo, config_name, overrides_list, prepend_hydra, skip_missing):
        values = [_is_value_override(repo, o) for o in overrides_list]
        groups = tuple(o.input_line for o, v in zip(overrides_list, values) if not v)
        key = (_config_sources(repo), config_name, groups, prepend_hydra, skip_missing)
        if key not in kept:
            made = create_defaults_list(repo, config_name, overrides_list, prepend_hydra,
                                        skip_missing)
            kept[key] = copy.deepcopy(made)
            return made
        got = copy.deepcopy(kept[key])
        got.overrides.config_overrides = [o for o, v in zip(overrides_list, values) if v]
        return DefaultsList(defaults=got.defaults, config_overrides=got.overrides.config_overrides,
                            defaults_tree=got.defaults_tree, overrides=got.overrides)

    _replace(loader, "create_defaults_list", defaults_list)


def _remember_merges(loader) -> None:
    compose, kept = loader.ConfigLoaderImpl._compose_config_from_defaults_list, {}

    def composed(self, defaults, repo):
        key = (_config_sources(repo), tuple((d.config_path, d.parent, d.package, d.is_self,
                                             d.primary) for d in defaults))
        if key not in kept:
            cfg = compose(self, defaults, repo)
            kept[key] = copy.deepcopy(cfg)
            return cfg
        return copy.deepcopy(kept[key])

    _replace(loader.ConfigLoaderImpl, "_compose_config_from_defaults_list", composed)


def _remember_file_loads(file_source) -> None:
    load, kept = file_source.load_config, {}

    def load_config(self, config_path):
        full = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        data = _bytes(full)
        if data is None:
            return load(self, config_path)  # Hydra's own error
        key = (self.provider, self.path, config_path, full, data)
        if key not in kept:
            kept[key] = load(self, config_path)
        return copy.deepcopy(kept[key])

    _replace(file_source, "load_config", load_config)


def install() -> None:
    """Wrap the costly steps of Hydra's ConfigLoaderImpl._load_configuration_impl."""
    from hydra._internal import config_loader_impl as loader
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins

    if REPLACED:
        return
    # the config sources as Hydra registers them: its plugin scan runs their modules again
    # (new classes), so they are taken after it, from its registry
    Plugins.instance()
    sources = SourcesRegistry.instance()
    _remember_defaults_lists(loader)
    _remember_merges(loader)
    _remember_file_loads(sources.resolve("file"))
    # the process's one ConfigStore, shared: it hands out a copy of each node it loads
    _replace(sources.resolve("structured"), "__deepcopy__", lambda self, memo: copy.copy(self))


def _put_back(set_attr, del_attr) -> None:
    for owner, name, was in reversed(REPLACED):
        if was is _ABSENT:
            del_attr(owner, name)
        else:
            set_attr(owner, name, was)


def uninstall() -> None:
    """Hydra as it is without this module, for good (tests/warm_ranks.py: composing there warned)."""
    _put_back(setattr, delattr)
    REPLACED.clear()


def undone(monkeypatch) -> None:
    """Hydra as it is without this module, until ``monkeypatch`` undoes it."""
    _put_back(monkeypatch.setattr, monkeypatch.delattr)
