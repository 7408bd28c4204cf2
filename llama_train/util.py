"""Small helpers shared by several components: durable directory writes and JSON values."""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional


def fsync_dir(d: Path) -> None:
    """Make a rename or a new file in ``d`` durable (best effort where the fs refuses)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory, under ``root``."""
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fsync_dir(d)


def within(path: Any, root: Any) -> bool:
    """Whether ``path`` is ``root`` or lies under it, lexically (absolute paths, ``..``
    resolved, links not followed: a link in ``root`` does not take its target inside)."""
    path, root = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    return path == root or root in path.parents


def free_bytes(path: Any) -> Optional[int]:
    """Free bytes on the filesystem that holds ``path`` (or would: its nearest existing
    ancestor); None where that cannot be read."""
    import shutil

    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def jsonable(x: Any) -> Any:
    """A value ``json.dumps`` accepts and a reader can tell apart: numpy scalars become Python
    numbers; NaN and infinities become the strings "nan", "inf", "-inf" (JSON has no such
    numbers, and dropping them to null would hide a diverged run)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and not isinstance(x, (str, bytes)):
        try:
            x = x.item()
        except (ValueError, TypeError, RuntimeError):
            return x
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def splitmix64(x: int) -> int:
    """SplitMix64's finalizer on a Python int (mod 2**64): keys and seeds derived from a seed."""
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def say_error(msg: str) -> None:
    """``llama-train: error: <msg>`` on stderr, once: also logged only where the log is not
    stderr itself (every error used to be printed twice, as a log line and as this line)."""
    root = logging.getLogger()
    to_stderr = any(isinstance(h, logging.StreamHandler)
                    and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__)
                    for h in root.handlers)
    if not to_stderr:
        logging.getLogger("llama_train").error("%s", msg)
    print(f"llama-train: error: {msg}", file=sys.stderr, flush=True)
