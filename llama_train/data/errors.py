"""The one exception type the data pipeline raises for bad input."""

from __future__ import annotations

from llama_train.errors import BadInput


class DataError(BadInput):
    """Bad data input or an incompatible prepared directory.

    A BadInput (a ValueError) so the entry points refuse it in one line (exit 2), as a config
    error; the message always names the offending key, file or path and how to fix it.
    """


class DataInterrupted(Exception):
    """The data a running job reads stopped being what it started with (DataChanged): not bad
    input (exit 2), since it was fine at start and is again once restored, so the trainer exits
    with ``exit_code`` (llama_train.train.run_job), at once, naming the file and the step."""

    exit_code = 1


class DataChanged(DataInterrupted, DataError):
    """A prepared shard was rewritten, truncated or extended while a job read it (PackedTokens
    checks each read): refused before any changed byte is used. Exit 3, as a checkpoint that
    cannot be loaded: the job stops, its checkpoints are intact, restoring the file resumes it."""

    exit_code = 3
