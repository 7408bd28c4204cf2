"""The module paths of before the packages (issue 57: ``llama_train/<module>.py``, 43 of them
side by side). Each old file is now a shim that calls :func:`alias`: the old name becomes the
new module itself (one object, so what is monkeypatched through the old path is patched in the
module the code runs), and importing it warns (DeprecationWarning) at the importer's line.
``python -m <old path>`` runs the new module as the program, as before. Nothing in the package,
its tests, docs or launch scripts imports an old path: new code uses the new ones."""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def alias(name: str, new: str) -> None:
    """Called by the shim of old module ``name`` (its ``__name__``) that moved to ``new``."""
    if name == "__main__":  # python -m <old path>: the new module is the program
        old = getattr(sys.modules["__main__"].__spec__, "name", "the old path")
        warnings.warn(f"{old} moved to {new}: run python -m {new}", DeprecationWarning,
                      stacklevel=2)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    module = importlib.import_module(new)
    # stacklevel 3: the line that imported the old path (importlib's own frames are skipped)
    warnings.warn(f"{name} moved to {new}: import it from there (the old path is deprecated)",
                  DeprecationWarning, stacklevel=3)
    sys.modules[name] = module
