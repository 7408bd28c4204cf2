"""Finding checkpoints: the step directories of a checkpoints directory (and the strays beside
them, warned about by name), the newest that verifies, whether a path is a checkpoint at all,
the one a path names, and its trainer_state.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from llama_train.checkpoint.errors import CheckpointError, NotACheckpoint
from llama_train.checkpoint.layout import (_OWN_ENTRIES, _OWN_PREFIXES, DS_TAG, MANIFEST, STATE,
                                           step_of, verify)

log = logging.getLogger("llama_train")

_STRAYS_WARNED: set = set()  # (root, name): each stray entry is warned about once a process


def _step_dirs(root: Path) -> List[Path]:
    """The checkpoint directories in ``root``, newest first: those named as a save names them
    (``step_`` and the step in 8 digits or more), real directories (a save never writes a link).
    Any other entry (a user's copy ``step_00000004.bak``, an editor's swap file, ``step_abc``, a
    README) is not a checkpoint: never resumed from, exported, pruned or deleted, and warned
    about once, naming it (before, every resume stopped on it: "invalid literal for int()")."""
    if not root.is_dir():
        return []
    steps, strays = [], []
    for p in root.iterdir():
        step = step_of(p.name)
        if step is not None and p.is_dir() and not p.is_symlink():
            steps.append((step, p))
        elif p.name not in _OWN_ENTRIES and not p.name.startswith(_OWN_PREFIXES):
            strays.append(p)
    if steps or (root / "latest").exists():  # a checkpoints dir (not any dir given as one)
        _warn_strays(root, strays)
    return [p for _, p in sorted(steps, reverse=True)]


def _warn_strays(root: Path, strays: List[Path]) -> None:
    new = sorted(p.name for p in strays if (str(root), p.name) not in _STRAYS_WARNED)
    if not new:
        return
    _STRAYS_WARNED.update((str(root), n) for n in new)
    log.warning("%s: ignoring %s: not checkpoint(s) (a save names its directory "
                "step_NNNNNNNN); never resumed from, exported or removed by llama-train. Move "
                "them out of the checkpoints directory to silence this", root,
                ", ".join(repr(n) for n in new))


def find_latest(root: Path, checksums: bool = True) -> Tuple[Optional[Path], List[str]]:
    """Newest checkpoint that verifies, and warnings for the newer ones that were skipped."""
    warnings = []
    for ckpt in _step_dirs(root):
        reason = verify(ckpt, checksums)
        if reason is None:
            return ckpt, warnings
        warnings.append(f"skipping checkpoint {ckpt}: {reason}")
    return None, warnings


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint at all, complete or not: a directory holding what a save
    writes first (DeepSpeed's ``ds/``, ``ranks/``) or last (trainer_state.json, the manifest)."""
    return path.is_dir() and any((path / n).exists() for n in (STATE, MANIFEST, DS_TAG, "ranks"))


def require_checkpoint(path: Path, what: str) -> None:
    """Raise :class:`NotACheckpoint` (bad input, exit 2) unless ``path`` is a checkpoint at all;
    a checkpoint that is incomplete or damaged is the loader's to refuse (exit 3)."""
    if is_checkpoint(path):
        return
    if not path.exists():
        found = "it does not exist"
    elif not path.is_dir():
        found = "it is not a directory"
    else:
        found = f"it has no {STATE}, {MANIFEST} or {DS_TAG}/"
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    inner = _step_dirs(root) if path.is_dir() else []
    hint = (f" It holds checkpoints: give one of them (the newest is {inner[0]}), or continue "
            f"that run with trainer.resume=auto and its trainer.output_dir." if inner else "")
    others = sorted(p.name for p in root.glob("step_*")) if path.is_dir() and not inner else []
    if others:  # copies or renamed checkpoints: not found by name, never guessed at
        hint = (f" It holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}, not "
                f"named as a save names a checkpoint (step_ and 8 digits): give one of them "
                f"itself if it is a checkpoint.")
    raise NotACheckpoint(
        f"{what}={path} is not a checkpoint: {found}.{hint} A checkpoint is a directory "
        f"<output_dir>/checkpoints/step_NNNNNNNN written by llama-train.")


def resume_candidate(output_dir: str, resume: str) -> Optional[Path]:
    """The checkpoint a resume will most likely load, found by reading files only (sizes, no
    checksums): preflight compares its config with the run's before data preparation and the
    process group. None for a fresh start. The trainer still verifies and checks what it loads.
    An explicit path that is no checkpoint at all is bad input (:class:`NotACheckpoint`)."""
    if resume == "never":
        return None
    if resume != "auto":
        require_checkpoint(Path(resume), "trainer.resume")
        return Path(resume) if verify(Path(resume), checksums=False) is None else None
    path, _ = find_latest(Path(output_dir) / "checkpoints", checksums=False)
    return path


def read_state(ckpt: Path) -> Dict[str, Any]:
    """trainer_state.json; CheckpointError naming it when it cannot be read as one."""
    path = Path(ckpt) / STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8
        state, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}"
    else:
        why = f"a JSON {type(state).__name__}, not an object"
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} cannot be read ({why}): the checkpoint is damaged or was not written by "
            f"llama-train; use another checkpoint.")
    return state


def checkpoint_step(ckpt: Path) -> int:
    """The training step a checkpoint holds (its trainer_state.json)."""
    return int(read_state(ckpt)["step"])


def resolve_checkpoint(ckpt_dir: str) -> Path:
    """The ``step_N`` directory that ``ckpt_dir`` names: itself, or the latest complete one in
    an output or checkpoints directory. Raises :class:`NotACheckpoint` for a path that holds no
    checkpoint at all and CheckpointError when none of its saves is complete."""
    path = Path(ckpt_dir)
    if is_checkpoint(path):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    partial = sorted(p.name for p in root.glob(".tmp-step_*")) if path.is_dir() else []
    if not path.is_dir() or not (_step_dirs(root) or partial):
        require_checkpoint(path, "checkpoint_dir")
    found, warnings = find_latest(root, checksums=False)
    for w in warnings:
        log.warning(w)
    if found is None:
        why = [w.removeprefix("skipping checkpoint ") for w in warnings]
        why += [f"{n} is a save that did not finish" for n in partial]
        raise CheckpointError(f"no complete checkpoint in {root}: {'; '.join(why)}")
    return found
