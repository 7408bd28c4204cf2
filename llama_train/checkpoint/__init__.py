"""Checkpoints that never lose a run.

Layout under ``<output_dir>/checkpoints``::

    step_00000100/               complete (renamed from .tmp-step_00000100 only when whole)
      ds/                        DeepSpeed's own files (engine.save_checkpoint, tag "ds")
      ranks/rank_00000.pt        per-rank data position and RNG states (weights_only-loadable)
      trainer_state.json         step, tokens, tracker run id, world size, ZeRO stage, batch
      config.yaml                the resolved config
      model_args.json            ModelArgs, so the checkpoint describes itself
      tokenizer.model            the sentencepiece model the data was encoded with
      manifest.json              size and sha256 of every file above (written last)
      universal/                 DeepSpeed's universal format, converted on a resume with a new
        manifest.json            world size; its own manifest, verified before every load
    latest                       name of the newest complete checkpoint (a hint; the scan decides)

Anything else there (``step_00000004.bak``, an editor's swap file, ``step_abc``, a README) is
not a checkpoint: warned about by name, never resumed from, exported, pruned or deleted
(:func:`discovery._step_dirs`).

A checkpoint counts only if its directory has the final name and its manifest verifies, so a
save cut by ``kill -9`` or a full disk is never picked up, and a corrupted one is skipped. No
load reads a file its manifest lacks (DeepSpeed finds its shards by name). A save that fails on
any rank fails on all of them, removes its partial directory and leaves the ``latest`` hint
alone; a save is refused outright when the weights are not finite or the tokenizer copied into it
is not the one the data was encoded with, so a manifest never vouches for either.

Untrusted files: the manifest's sha256 is checked before anything in a checkpoint is unpickled,
and every ``torch.load`` of a checkpoint (DeepSpeed's own included) runs with torch's restricted
``weights_only`` unpickler, allowing only three plain DeepSpeed value classes
(:func:`llama_train.engine.restricted_loads`).

The package, one module per reason to change (each imports only those listed before it)::

    errors.py        CheckpointError (exit 3), NotACheckpoint (exit 2), a save's refusal
    layout.py        the names above, step directories' names, the manifest: write, verify
    collective.py    the ranks' agreement on a failure
    disk.py          what a failed write says about the disk (full, read-only) and the fix
    discovery.py     the checkpoints of a directory (strays warned about), the newest that
                     verifies, the one a path names, trainer_state.json read
    meta.py          CheckpointMeta: trainer_state.json's facts of the save, typed
    state.py         StateRegistry: the trainer's stateful parts -> trainer_state.json and
                     the rank files, and back; the RNG states
    history.py       what a run leaves in its output_dir, set aside to start over
    choice.py        which checkpoint a run continues from (rank 0's choice)
    universal.py     DeepSpeed's universal format, for a resume on a new world size
    consolidated.py  a checkpoint's merged fp32 weights, for export and sampling
    writer.py        CheckpointManager: the save (synchronous, or a background writer over its
                     own gloo group), the ranks' choice of resume, the load
"""

from __future__ import annotations

from llama_train.checkpoint.choice import choose, start_over
from llama_train.checkpoint.consolidated import load_consolidated
from llama_train.checkpoint.discovery import (checkpoint_step, find_latest, is_checkpoint,
                                              read_state, require_checkpoint,
                                              resolve_checkpoint, resume_candidate)
from llama_train.checkpoint.errors import CheckpointError, NotACheckpoint
from llama_train.checkpoint.history import (ARCHIVE, RUN_FILES, existing_history,
                                            set_aside_history)
from llama_train.checkpoint.layout import (DS_TAG, LOADED_DIRS, MANIFEST, STATE, UNIVERSAL_TAG,
                                           step_name, step_of, verify, write_manifest)
from llama_train.checkpoint.meta import CheckpointMeta
from llama_train.checkpoint.state import (Fixed, RngState, StateRegistry, rng_state,
                                          set_rng_state)
from llama_train.checkpoint.universal import prepare_universal
from llama_train.checkpoint.writer import (WRITE_TIMEOUT_S, CheckpointManager, SaveRecord,
                                           writer_group)

__all__ = [
    # errors
    "CheckpointError", "NotACheckpoint",
    # layout
    "MANIFEST", "STATE", "DS_TAG", "UNIVERSAL_TAG", "LOADED_DIRS", "step_name", "step_of",
    "write_manifest", "verify",
    # discovery
    "find_latest", "is_checkpoint", "require_checkpoint", "resume_candidate", "read_state",
    "checkpoint_step", "resolve_checkpoint",
    # what a checkpoint carries
    "CheckpointMeta", "StateRegistry", "Fixed", "RngState", "rng_state", "set_rng_state",
    # history and the choice of resume
    "ARCHIVE", "RUN_FILES", "existing_history", "set_aside_history", "choose", "start_over",
    # universal, export
    "prepare_universal", "load_consolidated",
    # writer
    "CheckpointManager", "SaveRecord", "WRITE_TIMEOUT_S", "writer_group",
]
# Private names stay in their modules: patch one where it is used
# (llama_train.checkpoint.layout._sha256_all), not here.
