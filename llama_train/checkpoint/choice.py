"""Which checkpoint a run continues from (``trainer.resume``), as rank 0 chooses it: the newest
that verifies, or the one named; and, starting from step 0, what becomes of an old history
(``trainer.on_existing``). :meth:`CheckpointManager.resolve_resume
<llama_train.checkpoint.writer.CheckpointManager.resolve_resume>` hands the choice to every
rank."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from llama_train.checkpoint.discovery import find_latest, require_checkpoint
from llama_train.checkpoint.errors import CheckpointError
from llama_train.checkpoint.history import ARCHIVE, existing_history, set_aside_history
from llama_train.checkpoint.layout import verify
from llama_train.config import ConfigError


def choose(root: Path, output_dir: str, checksums: bool, resume: str, on_existing: str,
           run_files: Tuple[str, ...]) -> Tuple[Optional[str], List[str]]:
    """Rank 0: (checkpoint path or None, warnings); raises what refuses the start. ``root``:
    the run's checkpoints directory; ``run_files``: the metrics file first, then more names to
    set aside."""
    if resume == "never":
        return None, start_over(root, output_dir, on_existing, run_files, None)
    if resume == "auto":
        path, warnings = find_latest(root, checksums)
        if path is None and warnings:
            warnings = start_over(root, output_dir, on_existing, run_files, warnings)
        return (str(path) if path else None), warnings
    require_checkpoint(Path(resume), "trainer.resume")  # preflight said so already
    reason = verify(Path(resume), checksums)
    if reason is not None:
        raise CheckpointError(f"trainer.resume={resume}: {reason}")
    return str(Path(resume)), []


def start_over(root: Path, output_dir: str, on_existing: str, run_files: Tuple[str, ...],
               unusable: Optional[List[str]]) -> List[str]:
    """Rank 0, starting from step 0: the old history stays (refused: raises) or is set
    aside. Returns the warnings to log. ``run_files``: the metrics file first, then more
    names to set aside."""
    history = existing_history(output_dir, run_files[0])
    if not history:
        return list(unusable or [])
    if on_existing == "refuse":
        if unusable is None:  # resume=never (preflight refuses this before the group)
            raise ConfigError(
                f"trainer.resume=never but {output_dir} holds a run "
                f"({', '.join(history[-3:])}); set trainer.on_existing=archive or "
                f"overwrite, or use another trainer.output_dir.")
        listed = "; ".join(w.removeprefix("skipping checkpoint ") for w in unusable)
        raise CheckpointError(
            f"trainer.resume=auto: none of the {len(unusable)} checkpoint(s) in {root} "
            f"verifies: {listed}. Nothing was changed. Restore a good copy and relaunch, or "
            f"start over explicitly with trainer.on_existing=archive (moves the old history "
            f"to {Path(output_dir) / ARCHIVE}/<time>/) or trainer.on_existing=overwrite "
            f"(deletes it).")
    dest = set_aside_history(output_dir, on_existing, run_files)
    what = f"archived to {dest}" if dest else "deleted (trainer.on_existing=overwrite)"
    return [*(unusable or []), f"starting over at step 0: the previous history in "
            f"{output_dir} ({len(history)} item(s): {', '.join(history[-3:])}) was "
            f"{what}"]
