"""The module paths of before the packages (issue 57: ``llama_train/<module>.py``, 43 of them
side by side) keep working without a file each: :data:`MOVED` is the one table of old path ->
new module, and :class:`OldPaths`, an import hook ``llama_train/__init__.py`` installs, answers
an import of an old path with the new module itself (one object, so what is monkeypatched
through the old path is patched in the module the code runs), warning (DeprecationWarning) at
the importer's line. ``python -m <old path>`` runs the new module as the program. Nothing in
the package, its tests, docs or launch scripts imports an old path: new code uses the new ones.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_JOB = ("config_source", "sweep", "plan", "preflight", "dry_run", "runlock", "resume",
        "simulation", "build", "trainer", "train_module", "train_state", "optim", "recovery",
        "faults", "progress", "compile_watch", "run_files", "summary")

# llama_train.<old> -> the module it is now
MOVED = {
    **{f"llama_train.{m}": f"llama_train.job.{m}" for m in _JOB},
    "llama_train.model_args": "llama_train.model.args",
    "llama_train.model_ops": "llama_train.model.ops",
    "llama_train.weights": "llama_train.model.weights",
    "llama_train.float8": "llama_train.engine.float8",
    "llama_train.flops": "llama_train.engine.flops",
    "llama_train.tracking": "llama_train.metrics.tracking",
    "llama_train.meter": "llama_train.metrics.meter",
    "llama_train.plot": "llama_train.metrics.plot",
    "llama_train.generate": "llama_train.inference.generate",
    "llama_train.sample": "llama_train.inference.sample",
    "llama_train.downstream": "llama_train.inference.downstream",
    "llama_train.lm_eval_model": "llama_train.inference.lm_eval_model",
}


def _message(old: str) -> str:
    return f"{old} moved to {MOVED[old]}: import it from there (the old path is deprecated)"


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths (first, so no stray file of an old name, such as an editable install's
    of another checkout, is ever imported instead) and loads each as its new module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        # stacklevel 2: the line that imported the old path (the import system's frames are
        # skipped by warnings)
        warnings.warn(_message(spec.name), DeprecationWarning, stacklevel=2)
        return module  # the import system keeps its __name__, __spec__ and __file__

    def exec_module(self, module) -> None:
        pass  # already executed: it is the new module

    def get_code(self, fullname):
        """``python -m <old path>`` (runpy asks for the code): the new module's, told on stderr
        (a program's user sees a FutureWarning; a DeprecationWarning is hidden there)."""
        new = MOVED[fullname]
        warnings.warn(f"{fullname} moved to {new}: run python -m {new}", FutureWarning,
                      stacklevel=2)
        return importlib.util.find_spec(new).loader.get_code(new)

    def is_package(self, fullname) -> bool:
        return False


def install() -> None:
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
