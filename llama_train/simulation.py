"""Moved to :mod:`llama_train.job.simulation` (issue 57); this path keeps working, deprecated."""

from llama_train._moved import alias

alias(__name__, "llama_train.job.simulation")
