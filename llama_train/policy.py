"""How a config field behaves when a run is resumed, declared on the field itself.

Every config dataclass marks its fields here (``dataclasses.field`` metadata); one reader,
:mod:`llama_train.job.resume`, decides from the marks whether a checkpoint can continue under a
changed config. A field without a mark defines the run: it must match the checkpoint unless
``trainer.allow_config_change`` names it. A mark on a field whose value is a config group
(``Config.recovery``) covers every key under it. A leaf module: the config modules import it,
it imports nothing of ours.
"""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any, Callable, Optional

KEY = "on_resume"
DEFINES_RUN = "defines_run"  # the default: must match the checkpoint (or be allowed)
MAY_CHANGE = "may_change"  # speed, layout, intervals, sinks: the change is logged and goes ahead
PER_LAUNCH = "per_launch"  # how this launch runs (paths, resume controls): never compared


def _marked(kind: str, default: Any, factory: Optional[Callable[[], Any]]) -> Any:
    meta = {KEY: kind}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def may_change(default: Any = MISSING, *, factory: Optional[Callable[[], Any]] = None) -> Any:
    """A field that may differ from the checkpoint's on resume (the change is logged)."""
    return _marked(MAY_CHANGE, default, factory)


def per_launch(default: Any = MISSING, *, factory: Optional[Callable[[], Any]] = None) -> Any:
    """A field that says how this launch runs, not what the run is: never compared."""
    return _marked(PER_LAUNCH, default, factory)
