"""The checkpoint package's errors: what a caller catches (exit 3, exit 2) and the refusal a save
raises inside itself."""

from __future__ import annotations

from llama_train.config import ConfigError


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded (exit 3)."""


class NotACheckpoint(ConfigError):
    """A path given as a checkpoint holds none at all, complete or not: bad input (exit 2)."""


class _SaveRefused(Exception):
    """A save that must not happen (its ``fix`` says what to do instead of freeing space)."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.fix = fix
