"""Where the package finds its Hydra configs and caches, and the checks every path it writes
passes before any work: a run's files confined to its output_dir (:func:`run_path`), a CLI's
output checked before it computes what goes there (:func:`check_output`)."""

from __future__ import annotations

import errno
import os
import secrets
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = Path(os.environ.get("LLAMA_TRAIN_CONFIG_DIR", REPO_ROOT / "configs"))
CACHE_ENV = "LLAMA_TRAIN_CACHE"

from llama_train.errors import BadInput

PathLike = Union[str, Path]


class PathRefused(BadInput):
    """A path the program would write is refused before anything is written: the message names
    the key or option, the path, why, and the fix. The trainer raises it as a ConfigError
    (exit 2); each CLI prints it as its one error line (exit 2)."""


def cache_dir() -> Path:
    """Prepared data and tokenizers live here unless a config says otherwise:
    ``$LLAMA_TRAIN_CACHE``, else ``~/.cache/llama_train``. One that cannot be a directory (an
    empty value, a file, a path through a file) is refused naming the variable (PathRefused, a
    ValueError: exit 2 from llama-train) before anything is read or written; preflight asks
    first."""
    raw = os.environ.get(CACHE_ENV)
    path = Path(raw) if raw else Path.home() / ".cache" / "llama_train"
    what = (f"{CACHE_ENV}={raw!r}" if raw is not None else
            f"the cache directory {path} (the default; {CACHE_ENV} moves it)")
    problem = "is empty" if raw == "" else _not_a_directory(path)
    if problem:
        raise PathRefused(f"{what} {problem}: set {CACHE_ENV} to a directory (created if "
                          f"missing) where prepared data and tokenizers can be kept, or unset "
                          f"it.")
    return path


def _not_a_directory(path: Path) -> Optional[str]:
    """Why ``path`` cannot be (or become) a directory, or None: it is something else, or a
    part of it is a file."""
    p = _real(path)
    if p.exists() and not p.is_dir():
        return "is a file, not a directory"
    for parent in p.parents:
        if parent.exists():
            return None if parent.is_dir() else f"lies under {parent}, which is a file"
    return None


# -- a run's own paths ---------------------------------------------------------------------------

# Where a run keeps what it must never write into by another name: the checkpoints (each
# vouched for by its manifest) and the histories trainer.on_existing=archive set aside.
PROTECTED = {"checkpoints": "its checkpoints are vouched for by their manifests",
             "archive": "it holds the histories trainer.on_existing=archive set aside"}


def _real(path: PathLike) -> Path:
    """``path`` resolved as the kernel walks it: each symlink before the ``..`` after it
    (``link/..`` is the link's target's parent; os.path.abspath would drop both first)."""
    path = os.fspath(path)
    return Path(os.path.realpath(path if os.path.isabs(path) else os.path.join(os.getcwd(), path)))


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _first_link(start: Path, rel: PathLike) -> Optional[str]:
    """``a -> target`` for the first symlink met walking ``rel`` from ``start``, or None."""
    p = Path(start)
    for part in Path(rel).parts:
        p = p / part
        if p.is_symlink():
            return f"{p} -> {os.readlink(p)}"
    return None


def run_path(output_dir: PathLike, value: Optional[PathLike], key: str, default: str,
             directory: bool = False, reserved: Iterable[PathLike] = ()) -> Path:
    """Where config key ``key`` (``value``; None: ``default``) puts a file of the run
    (``directory``: a directory it writes into): relative to trainer.output_dir, or absolute.
    Returned as given (output_dir / value); checked as the kernel will find it, resolved
    through every symlink and ``..``: it must lie inside trainer.output_dir (resolved too: the
    output dir itself may be a link), outside its checkpoints/ and archive/, and be none of
    ``reserved`` (the run's own files: config.yaml, ...). Raises PathRefused naming the key,
    what the path resolves to and the fix, before anything is written. Called in preflight and
    again where the writer starts (a link planted in between is found there)."""
    given = default if value in (None, "") else str(value)
    out = Path(output_dir)
    path = out / given
    real, root = _real(path), _real(out)
    shown = f"{key}={given!r}" if value not in (None, "") else f"{key} (default {default!r})"
    fix = (f"Give {key} a path inside trainer.output_dir (a relative path is relative to it; "
           f"default {default!r}) that no symlink leads out of. Nothing was changed.")
    if not _inside(real, root):
        link = _first_link(out, given) if not os.path.isabs(given) else None
        via = f" (through the symlink {link})" if link else ""
        raise PathRefused(
            f"{shown} leaves trainer.output_dir: it resolves to {real}{via}, outside {root}. A "
            f"run writes only inside its output dir (one directory, one history, nothing "
            f"elsewhere replaced). {fix}")
    for name, why in PROTECTED.items():
        protected = _real(out / name)
        if _inside(real, protected):
            raise PathRefused(f"{shown} resolves to {real}, inside the run's {name}/ "
                              f"({protected}): {why}, and the run writes nothing else there. "
                              f"{fix}")
    for other in reserved:
        if real == _real(out / other):
            raise PathRefused(f"{shown} resolves to {real}, the run's own {other}: each file of "
                              f"a run has one writer. {fix}")
    if directory and real.exists() and not real.is_dir():
        raise PathRefused(f"{shown} resolves to {real}, a file: it names a directory. {fix}")
    if not directory and (real.is_dir() or real == root):
        raise PathRefused(f"{shown} resolves to {real}, a directory: it names a file. {fix}")
    return path


def inside_checkpoint(path: PathLike) -> Optional[Path]:
    """The checkpoint directory (one holding manifest.json and trainer_state.json) that
    ``path``, resolved, is or lies in; None where it lies in none."""
    real = _real(path)
    for p in (real, *real.parents):
        if (p / "manifest.json").is_file() and (p / "trainer_state.json").is_file():
            return p
    return None


# -- a CLI's output ------------------------------------------------------------------------------

def check_output(path: PathLike, option: str, directory: bool = False) -> Path:
    """Whether ``path`` (the value of CLI option ``option``) can be written, before the work
    that produces it: a file (``directory``: a directory to write files into) that is not
    something else, whose nearest existing ancestor is a directory this process can create
    files in (probed: a temporary file created and removed, so a read-only mount, full
    permissions or a path through a file fail here; an existing file is opened for appending,
    nothing changed). Missing directories are not created here: the writer creates them
    (``parents=True``) once there is something to write. Returns ``path``; raises
    PathRefused."""
    p = Path(path)
    problem = None
    if not str(path):
        problem = "is empty"
    elif p.exists() and directory and not p.is_dir():
        problem = "is a file, not a directory"
    elif p.exists() and not directory and p.is_dir():
        problem = "is a directory: give a file path"
    else:
        problem = _not_a_directory(p if directory else p.parent)
    if problem is None:
        probe_in = p if directory else p.parent
        probe_in = _real(probe_in)
        while not probe_in.exists():
            probe_in = probe_in.parent
        try:
            if not directory and p.is_file():
                os.close(os.open(p, os.O_WRONLY | os.O_APPEND))
            else:
                fd, name = tempfile.mkstemp(dir=probe_in, prefix=".write-probe-")
                os.close(fd)
                os.unlink(name)
        except OSError as e:
            cause = {errno.EROFS: "the filesystem is read-only",
                     errno.ENOSPC: "the disk is full"}.get(e.errno, e.strerror or str(e))
            problem = f"cannot be written: {cause} ({e.filename or probe_in})"
    if problem:
        what = "a directory" if directory else "a file"
        raise PathRefused(f"{option} {path} {problem}. Nothing was computed: give {what} "
                              f"in a writable place (missing directories are created).")
    return p


def replace_file(path: PathLike, data: Union[str, bytes]) -> None:
    """Write ``path`` whole: into a new temporary file beside it, then renamed over it. A
    symlink planted at ``path`` is replaced, never written through, and a reader never sees
    half a file. An OSError names ``path``."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = None
    try:
        # O_EXCL | O_NOFOLLOW: never an existing file or link; 0o666 & ~umask as open() makes
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        e.filename = str(path)
        raise
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
