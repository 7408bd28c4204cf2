"""What a failed save or conversion says about the disk: a full disk named as such (torch's
writer often reports only a short write), the free space beside the error, and what to do."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Tuple

from llama_train.util import free_bytes

_DISK_FULL = ("No space left on device", "[Errno 28]", "ENOSPC", "Disk quota exceeded",
              "[Errno 122]")


def _filesystem(path: Path) -> Tuple[Path, Optional[int]]:
    """(the mount point of the filesystem holding ``path``, its free bytes or None)."""
    p = Path(path).absolute()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p, free_bytes(path)


def _space_note(root: Path, previous: Optional[Path], error: str = "") -> str:
    """Free space beside the error: a full disk often surfaces as an obscure write error."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    need = sum(p.stat().st_size for p in previous.rglob("*") if p.is_file()) if previous else 0
    note = f"; {free / 2**20:.1f} MiB free on the filesystem of {root}"
    if need and free < need and "the disk is full" not in error:
        note += f", less than one checkpoint ({need / 2**20:.1f} MiB): the disk is full"
    return note


# A write that fails on a full disk, said some other way: torch's zip writer reports a short
# write as "unexpected pos N vs M" or "file write failed", without the errno. Below this much
# free space right after the failure (the partial files still on disk) the disk is full.
_FULL_BELOW = 1 << 20


def _full_disk_note(e: BaseException, path: Path) -> str:
    """" (the disk is full: ...)" where the failed write ``e`` under ``path`` ran out of
    space (its errno or words, or no room left on the filesystem now), else "". Called at
    once, while the partial files still take their space."""
    import errno as errno_mod

    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    codes = {getattr(x, "errno", None) for x in chain}
    text = " ".join(str(x) for x in chain)
    if errno_mod.EDQUOT in codes or "Disk quota exceeded" in text:
        return " (the disk quota is exhausted)"
    free = free_bytes(path)
    room = f": {free / 2**20:.1f} MiB free" if free is not None else ""
    if errno_mod.ENOSPC in codes or any(m in text for m in _DISK_FULL):
        return f" (the disk is full{room})"
    if free is not None and free < _FULL_BELOW and codes <= {None}:  # no errno to go by
        return f" (the disk is full{room}; the write was cut short)"
    return ""


def _save_fix(error: str, root: Path) -> str:
    """What to do about a failed save, by its cause."""
    then = "then relaunch: it resumes from the newest (trainer.resume=auto)."
    if "the disk is full" in error or "quota" in error:
        return (f"Free space on the filesystem of {root} (or give trainer.output_dir a disk "
                f"with room), {then}")
    if "Read-only file system" in error:
        return (f"The filesystem of {root} is read-only: remount it read-write (or give "
                f"trainer.output_dir a writable disk), {then}")
    if "Permission denied" in error or "Operation not permitted" in error:
        return f"Give this user write permission on {root}, {then}"
    return f"Fix the cause in {root}, {then}"
