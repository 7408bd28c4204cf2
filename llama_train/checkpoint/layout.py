"""What a checkpoint is on disk: the names of its files and directories (see the package's
docstring for the whole layout), the names of step directories, and its manifest: written last
by a save, verified before anything in a checkpoint is read."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
DS_TAG = "ds"
UNIVERSAL_TAG = "universal"
# Where a load reads every file it finds (DeepSpeed picks its shards by name): a file there that
# the manifest lacks would be loaded as part of the checkpoint without any check.
LOADED_DIRS = (DS_TAG, "ranks")


# ----------------------------------------------------------------------------------------------
# Names


# What saves write in ``checkpoints/`` besides the step directories: the hint, its temporary,
# partial saves (``.tmp-step_N``, removed by the next save) and preflight's write probe.
_OWN_ENTRIES = ("latest", ".latest.tmp")
_OWN_PREFIXES = (".tmp-step_", ".write-probe-")
_STEP_NAME = re.compile(r"step_(\d{8,})")


def step_name(step: int) -> str:
    """The name a save gives the checkpoint of ``step`` (4: ``step_00000004``)."""
    return f"step_{step:08d}"


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name as a save writes it (``step_00000004``: 4), or
    None for any other name (``step_00000004.bak``, ``step_abc``, ``step_4``, a README)."""
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m and name == step_name(int(m.group(1))) else None


# ----------------------------------------------------------------------------------------------
# Manifest


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _sha256_all(paths: Sequence[Path]) -> List[str]:
    """sha256 of each file, several at once: hashlib and file reads release the GIL, so the
    threads use as many cores (hashing is the bulk of verifying or writing a manifest, and the
    other ranks wait meanwhile)."""
    if len(paths) < 2:
        return [_sha256(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(paths))) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(ckpt: Path, checksums: bool,
                   known: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """manifest.json for every file under ``ckpt``. ``known``: files already hashed by the
    rank that wrote them (an asynchronous save: every rank hashes its own), taken as they are
    when their size still matches."""
    files = {}
    known = known or {}
    todo = []  # files to hash here
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(ckpt).as_posix()
            size = p.stat().st_size
            if rel in known and known[rel]["size"] == size and \
                    (known[rel]["sha256"] or not checksums):
                files[rel] = dict(known[rel])
                continue
            files[rel] = {"size": size, "sha256": None}
            todo.append((rel, p))
    if checksums:
        for (rel, _), digest in zip(todo, _sha256_all([p for _, p in todo])):
            files[rel]["sha256"] = digest
    manifest = {"version": 1, "files": files}
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


# Where a load reads every file it finds (DeepSpeed picks its shards by name): a file there that
# the manifest lacks would be loaded as part of the checkpoint without any check.
LOADED_DIRS = (DS_TAG, "ranks")


def verify(ckpt: Path, checksums: bool = True,
           loaded: Sequence[str] = LOADED_DIRS) -> Optional[str]:
    """None if the checkpoint is complete and intact, else the reason it is not. ``loaded``:
    directories under ``ckpt`` ("" for all of it) where every file must be in the manifest."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        files = json.loads(mpath.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({e})"
    for d in loaded:
        base = ckpt / d if d else ckpt
        for p in sorted(base.rglob("*")) if base.is_dir() else ():
            rel = p.relative_to(ckpt).as_posix()
            if p.is_file() and rel != MANIFEST and rel not in files:
                return (f"{rel} is not in its manifest (no save wrote it, and a load would read "
                        f"it): remove it, or restore the checkpoint")
    for rel, info in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != info["size"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {info['size']} (truncated?)"
    if checksums:
        hashed = [rel for rel, info in files.items() if info.get("sha256")]
        for rel, digest in zip(hashed, _sha256_all([ckpt / rel for rel in hashed])):
            if digest != files[rel]["sha256"]:
                return f"{rel} fails its sha256 checksum (corrupted)"
    return None
