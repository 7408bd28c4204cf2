"""One output_dir, one history: what a run leaves there, and setting it aside to start over
(``trainer.on_existing``)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from llama_train.checkpoint.discovery import _step_dirs
from llama_train.checkpoint.layout import _OWN_ENTRIES, _OWN_PREFIXES
from llama_train.util import fsync_dir, within

ARCHIVE = "archive"
# What a run writes in its output_dir (besides the metrics file and its W&B dir): moved by
# trainer.on_existing=archive, deleted by overwrite. Anything else there is left alone.
RUN_FILES = ("checkpoints", "config.yaml", "run_info.json", "sample.txt")


def existing_history(output_dir: str, metrics_file: str) -> List[str]:
    """What of a previous run's history the output_dir holds (empty: none). Partial saves
    (``.tmp-step_*``) are not history: they are removed by the next save."""
    out = Path(output_dir)
    found = [p.name for p in _step_dirs(out / "checkpoints")]
    found = [f"checkpoints/{n}" for n in reversed(found)]
    metrics = out / metrics_file
    if within(metrics, out) and metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics_file)
    return found


def set_aside_history(output_dir: str, mode: str, extra: Tuple[str, ...] = ()) -> Optional[Path]:
    """trainer.on_existing=archive: move the run's files to ``archive/<UTC time>/`` (returned);
    overwrite: delete them. ``extra``: more names (the metrics file, the W&B dir)."""
    import time

    out = Path(output_dir)
    # only what lies inside the output dir is its history (an absolute metrics file or W&B
    # dir elsewhere is never moved or deleted), and a link is moved or deleted as a link
    present = [out / n for n in (*RUN_FILES, *extra)
               if within(out / n, out) and ((out / n).exists() or (out / n).is_symlink())]
    if mode == "overwrite":
        for p in present:
            if p == out / "checkpoints" and p.is_dir() and not p.is_symlink():
                _delete_checkpoints(p)
            else:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = out / ARCHIVE / stamp, 1
    while dest.exists():
        dest, n = out / ARCHIVE / f"{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    for p in present:
        os.rename(p, dest / p.name)
    fsync_dir(out)
    return dest


def _delete_checkpoints(root: Path) -> None:
    """trainer.on_existing=overwrite: delete what saves wrote in ``root`` (the checkpoints, the
    partial saves, the ``latest`` hint), then ``root`` if nothing else is left: a stray entry
    there, not the run's, stays (:func:`_step_dirs` names it)."""
    for p in _step_dirs(root):
        shutil.rmtree(p)
    for p in list(root.iterdir()):
        if p.name in _OWN_ENTRIES or p.name.startswith(_OWN_PREFIXES):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    with contextlib.suppress(OSError):  # not empty: strays stay
        root.rmdir()
