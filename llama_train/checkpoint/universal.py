"""DeepSpeed's universal format of a ZeRO checkpoint, to resume it on another data-parallel world
size: converted once by rank 0 into the checkpoint's ``universal/`` with its own manifest,
verified before every load, converted again when it does not verify; a failed conversion (a
full disk, above all) said in a few lines."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

from llama_train.checkpoint.collective import _agree
from llama_train.checkpoint.discovery import read_state
from llama_train.checkpoint.disk import _DISK_FULL, _filesystem
from llama_train.checkpoint.errors import CheckpointError
from llama_train.checkpoint.layout import DS_TAG, UNIVERSAL_TAG, verify, write_manifest
from llama_train.engine.ds_checkpoint import convert_to_universal
from llama_train.util import fsync_dir, fsync_tree

log = logging.getLogger("llama_train")


# universal dir -> its files' (name, size, mtime) when this process last verified or wrote them:
# the load right after a conversion or a check does not hash them again
_UNIVERSAL_CHECKED: Dict[str, Tuple[Tuple[str, int, int], ...]] = {}


def prepare_universal(ckpt: Path, rank: int, checksums: bool = True) -> Path:
    """DeepSpeed's universal format of a ZeRO checkpoint, to load it on another data-parallel
    world size: converted by rank 0 into ``universal/`` with its own manifest (the checkpoint's
    was written before it), and verified before it is loaded; a conversion that fails to verify
    is converted again. Every rank raises CheckpointError if the conversion fails."""
    out = ckpt / UNIVERSAL_TAG
    error = None
    if rank == 0:
        try:
            error = _universal_ready(ckpt, out, checksums)
        except OSError as e:
            error = f"preparing the universal checkpoint {out} failed: {e}"
    error = _agree(error)
    if error:
        raise CheckpointError(error)
    return out


def _files_stat(d: Path) -> Tuple[Tuple[str, int, int], ...]:
    return tuple((p.relative_to(d).as_posix(), st.st_size, st.st_mtime_ns)
                 for p in sorted(d.rglob("*")) if p.is_file() for st in [p.stat()])


def _universal_ready(ckpt: Path, out: Path, checksums: bool) -> Optional[str]:
    """Rank 0: ``out`` verified (every file in it listed: all of it is loaded), or converted
    (again); None, or why it cannot be."""
    if out.is_dir():
        if _UNIVERSAL_CHECKED.get(str(out)) == _files_stat(out):
            return None
        reason = verify(out, checksums, loaded=("",))
        if reason is None:
            _UNIVERSAL_CHECKED[str(out)] = _files_stat(out)
            return None
        log.warning("the universal checkpoint %s does not verify (%s): converting %s again",
                    out, reason, ckpt)
        shutil.rmtree(out)
    tmp = ckpt / ".universal.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s to a universal checkpoint for a new world size", ckpt)
    proc = convert_to_universal(ckpt / DS_TAG, tmp)
    if proc.returncode != 0:
        return _conversion_failed(ckpt, tmp, f"{proc.stdout}\n{proc.stderr}",
                                  f"ds_to_universal exit {proc.returncode}")
    try:
        write_manifest(tmp, checksums)
        fsync_tree(tmp)
        os.rename(tmp, out)
        fsync_dir(ckpt)
    except OSError as e:
        return _conversion_failed(ckpt, tmp, f"{type(e).__name__}: {e}", "writing its manifest")
    _UNIVERSAL_CHECKED[str(out)] = _files_stat(out)
    return None


# The conversion's peak use of space over its input (extracted fragments beside the merged
# result): 1.55x on the tiny model's ZeRO-1 checkpoint.
_CONVERSION_PEAK = 1.6


def _conversion_failed(ckpt: Path, tmp: Path, output: str, what: str) -> str:
    """Remove the partial conversion (a full disk stays full otherwise) and say why it failed in
    a few lines: a full disk as such (torch's writer often says only "unexpected pos"), where and
    how much is free; else the child's last lines."""
    shutil.rmtree(tmp, ignore_errors=True)
    left = (f"the partial {tmp} could not be removed: remove it by hand" if tmp.exists() else
            f"the partial {tmp} was removed")
    try:
        saved_on = f"{read_state(ckpt)['world_size']} rank(s)"
    except (CheckpointError, KeyError):
        saved_on = "the world size it was saved with"
    need = _CONVERSION_PEAK * sum(p.stat().st_size for p in (ckpt / DS_TAG).rglob("*")
                                  if p.is_file())
    mount, free = _filesystem(ckpt)
    if any(m in output for m in _DISK_FULL) or (free is not None and free < need):
        room = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
        return (f"converting {ckpt} to a universal checkpoint (to resume on a new world size) "
                f"failed: the disk is full (the filesystem at {mount} has {room}; the conversion "
                f"needs about {need / 2**20:.1f} MiB at its peak, {_CONVERSION_PEAK:g}x its "
                f"{DS_TAG}/); {left}. Free space there, or resume on {saved_on}, which needs no "
                f"conversion; then relaunch.")
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    last = " | ".join(line[:200] for line in lines[-3:])
    return (f"converting {ckpt} to a universal checkpoint (to resume on a new world size) "
            f"failed ({what}): {last}; {left}. Resume on {saved_on}, which needs no conversion, "
            f"or fix the cause and relaunch.")
