"""The module paths of before the packages (issue 57) keep working: an import hook
(llama_train._moved) makes each old name the new module (one object: a monkeypatch through the old path patches
the module the code runs) and warns (DeprecationWarning) at the line that imported it; the new
paths warn nothing, and the torch-free model arguments stay torch-free under either name.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llama_train"  # tests/system/ -> the repo

# old module (llama_train.<old>) -> where it lives now
MOVED = {
    **{m: f"llama_train.job.{m}" for m in (
        "config_source", "sweep", "preflight", "plan", "dry_run", "build", "trainer",
        "train_module", "train_state", "progress", "compile_watch", "run_files", "resume",
        "recovery", "runlock", "simulation", "summary", "faults", "optim")},
    "model_args": "llama_train.model.args", "model_ops": "llama_train.model.ops",
    "weights": "llama_train.model.weights",
    "float8": "llama_train.engine.float8", "flops": "llama_train.engine.flops",
    "tracking": "llama_train.metrics.tracking", "meter": "llama_train.metrics.meter",
    "plot": "llama_train.metrics.plot",
    "generate": "llama_train.inference.generate", "sample": "llama_train.inference.sample",
    "downstream": "llama_train.inference.downstream",
    "lm_eval_model": "llama_train.inference.lm_eval_model",
}

# the console scripts before (pyproject.toml's [project.scripts]): an install made then runs these
OLD_SCRIPTS = {"llama-train": "llama_train.train:cli", "llama-plot": "llama_train.plot:main",
               "llama-generate": "llama_train.generate:main",
               "llama-eval": "llama_train.downstream:main"}


def _resolve(spec: str):
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def test_the_old_paths_are_one_table_and_no_files():
    """The package's table of old paths (llama_train._moved.MOVED, read by its import hook) is
    this one, and no top-level file of an old name is left to shadow or be confused with it."""
    from llama_train import _moved

    assert _moved.MOVED == {f"llama_train.{old}": new for old, new in MOVED.items()}
    assert not [old for old in MOVED if (PACKAGE / f"{old}.py").exists()]
    assert sum(isinstance(f, _moved.OldPaths) for f in sys.meta_path) == 1


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module(old, monkeypatch):
    if old == "lm_eval_model":
        pytest.importorskip("lm_eval")
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(f"llama_train.{old}") is new
    assert sys.modules[f"llama_train.{old}"] is new
    exec(f"from llama_train import {old} as via_from", ns := {})
    assert ns["via_from"] is new
    # a monkeypatch through the old path reaches the module the code runs
    monkeypatch.setattr(f"llama_train.{old}.PATCHED_THROUGH_THE_OLD_PATH", old, raising=False)
    assert new.PATCHED_THROUGH_THE_OLD_PATH == old


def test_the_model_package_keeps_the_model_modules_names():
    """``llama_train.model`` was model.py: the package gives every name it gave (its __all__ and
    its module-level names, such as the private ones tests patch), from the modules they
    moved to."""
    import llama_train.model as model
    from llama_train.model import transformer

    for name in transformer.__all__:
        assert getattr(model, name) is getattr(transformer, name), name
    assert set(model.__all__) == set(transformer.__all__)
    assert model._SDPA_HAS_GQA is transformer._SDPA_HAS_GQA and model.F is transformer.F
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        model.no_such_name  # noqa: B018
    assert model.args is importlib.import_module("llama_train.model.args")


def test_the_console_scripts_old_and_new_run_the_same_functions():
    """pyproject.toml's scripts name the new paths; an install made before (its scripts name the
    old ones) runs the same functions."""
    import tomllib

    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    for script, spec in scripts.items():
        assert callable(_resolve(spec)), script
        assert ":" in spec and spec.split(":")[0].split(".")[1] not in MOVED, (script, spec)
    for script, old in OLD_SCRIPTS.items():
        assert _resolve(old) is _resolve(scripts[script]), script


PROBE = textwrap.dedent("""
    import json, sys, warnings
    out = {}
    warnings.simplefilter("always")
    # the torch-free half first: the model's arguments under the new names and the old one
    with warnings.catch_warnings(record=True) as seen:
        import llama_train.model, llama_train.model.args, llama_train.job
        from llama_train.model import ModelArgs
        out["new_args_torch"] = "torch" in sys.modules
        exec(compile("import llama_train.model_args", "<old_args>", "exec"))
        out["old_args_torch"] = "torch" in sys.modules
    out["args_warnings"] = [(str(w.message), w.filename) for w in seen
                            if issubclass(w.category, DeprecationWarning)]
    # every new module, imported the way the package uses them: no deprecation of ours
    import importlib, pkgutil, llama_train
    new = sorted(m.name for m in pkgutil.walk_packages(llama_train.__path__, "llama_train.")
                 if m.name.count(".") > 1 and not m.name.endswith(("__main__", "lm_eval_model"))
                 and not m.name.startswith("llama_train.bench._"))
    with warnings.catch_warnings(record=True) as seen:
        for name in new + ["llama_train.train"]:
            importlib.import_module(name)
    out["new_warnings"] = [str(w.message) for w in seen if "moved to" in str(w.message)]
    out["imported_new"] = len(new)
    # each old path, imported fresh: one warning, at the line that imported it
    out["old"] = {}
    for old in sys.argv[1:]:
        with warnings.catch_warnings(record=True) as seen:
            exec(compile(f"import llama_train.{old}", f"<{old}>", "exec"))
        out["old"][old] = [(str(w.message), w.filename) for w in seen
                           if issubclass(w.category, DeprecationWarning)
                           and "moved to" in str(w.message)]
    print(json.dumps(out))
""")


@pytest.mark.slow  # one interpreter importing the whole package (torch, DeepSpeed's modules)
def test_old_paths_warn_once_where_imported_and_new_paths_never():
    old = sorted(m for m in MOVED if m != "model_args")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        old.remove("lm_eval_model")
    out = subprocess.run([sys.executable, "-c", PROBE, *old], capture_output=True, text=True,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["new_args_torch"] and not got["old_args_torch"], got
    assert got["args_warnings"] == [
        ["llama_train.model_args moved to llama_train.model.args: import it from there (the old "
         "path is deprecated)", "<old_args>"]]
    assert got["imported_new"] > 100 and got["new_warnings"] == [], got["new_warnings"]
    for name in old:
        assert got["old"][name] == [
            [f"llama_train.{name} moved to {MOVED[name]}: import it from there (the old path is "
             f"deprecated)", f"<{name}>"]], name


@pytest.mark.slow  # an interpreter
def test_python_m_an_old_path_runs_the_new_module():
    out = subprocess.run([sys.executable, "-m", "llama_train.plot", "--help"], capture_output=True,
                         text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert "usage: llama-plot" in out.stdout
    assert "FutureWarning: llama_train.plot moved to llama_train.metrics.plot" in out.stderr
