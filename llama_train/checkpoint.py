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
    latest                       name of the newest complete checkpoint (a hint; the scan decides)

A checkpoint counts only if its directory has the final name and its manifest verifies, so a
save cut by ``kill -9`` or a full disk is never picked up, and a corrupted one is skipped.
A save that fails on any rank fails on all of them, removes its partial directory and leaves the
``latest`` hint alone.

Untrusted files: the manifest's sha256 is checked before anything in a checkpoint is unpickled,
and every ``torch.load`` of a checkpoint (DeepSpeed's own included) runs with torch's restricted
``weights_only`` unpickler, allowing only three plain DeepSpeed value classes
(:func:`llama_train.engine.restricted_loads`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from llama_train.config import ConfigError
from llama_train.engine.ds_checkpoint import consolidate_fp32, convert_to_universal
from llama_train.hooks import Hook
from llama_train.util import fsync_dir, fsync_tree

log = logging.getLogger("llama_train")

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
DS_TAG = "ds"
UNIVERSAL_TAG = "universal"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded (exit 3)."""


# ----------------------------------------------------------------------------------------------
# RNG and small per-rank state (plain tensors and ints, so weights_only=True can load them)


def rng_state() -> Dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": np_state[0], "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached": float(np_state[4]), "state": torch.from_numpy(np_state[1].copy())},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["key"], n["state"].numpy(), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Manifest


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt: Path, checksums: bool) -> Dict[str, Any]:
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(ckpt).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": _sha256(p) if checksums else None}
    manifest = {"version": 1, "files": files}
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify(ckpt: Path, checksums: bool = True) -> Optional[str]:
    """None if the checkpoint is complete and intact, else the reason it is not."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        files = json.loads(mpath.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for rel, info in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != info["size"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {info['size']} (truncated?)"
        if checksums and info.get("sha256") and _sha256(p) != info["sha256"]:
            return f"{rel} fails its sha256 checksum (corrupted)"
    return None


# ----------------------------------------------------------------------------------------------


def _step_dirs(root: Path) -> List[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")),
                  key=lambda p: int(p.name.split("_")[1]), reverse=True)


def find_latest(root: Path, checksums: bool = True) -> Tuple[Optional[Path], List[str]]:
    """Newest checkpoint that verifies, and warnings for the newer ones that were skipped."""
    warnings = []
    for ckpt in _step_dirs(root):
        reason = verify(ckpt, checksums)
        if reason is None:
            return ckpt, warnings
        warnings.append(f"skipping checkpoint {ckpt}: {reason}")
    return None, warnings


def resume_candidate(output_dir: str, resume: str) -> Optional[Path]:
    """The checkpoint a resume will most likely load, found by reading files only (sizes, no
    checksums): preflight compares its config with the run's before data preparation and the
    process group. None for a fresh start. The trainer still verifies and checks what it loads."""
    if resume == "never":
        return None
    if resume != "auto":
        return Path(resume) if verify(Path(resume), checksums=False) is None else None
    path, _ = find_latest(Path(output_dir) / "checkpoints", checksums=False)
    return path


def read_state(ckpt: Path) -> Dict[str, Any]:
    return json.loads((ckpt / STATE).read_text())


# ----------------------------------------------------------------------------------------------
# One output_dir, one history: what a run leaves there, and setting it aside to start over

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
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics_file)
    return found


def set_aside_history(output_dir: str, mode: str, extra: Tuple[str, ...] = ()) -> Optional[Path]:
    """trainer.on_existing=archive: move the run's files to ``archive/<UTC time>/`` (returned);
    overwrite: delete them. ``extra``: more names (the metrics file, the W&B dir)."""
    import time

    out = Path(output_dir)
    present = [out / n for n in (*RUN_FILES, *extra) if (out / n).exists()]
    if mode == "overwrite":
        for p in present:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
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


class CheckpointManager:
    """Saves and finds checkpoints; every rank calls ``save`` (DeepSpeed writes shards per rank)."""

    def __init__(self, output_dir: str, keep_last: int, checksums: bool, rank: int,
                 world_size: int, hooks: Sequence[Hook] = ()):
        self.output_dir = output_dir
        self.root = Path(output_dir) / "checkpoints"
        self.hooks = list(hooks)  # on_checkpoint_dir / checkpoint_writes (fault injection)
        self.keep_last = keep_last
        self.checksums = checksums
        self.rank = rank
        self.world_size = world_size

    # -- save --------------------------------------------------------------------------------
    def save(self, engine, step: int, trainer_state: Dict[str, Any], rank_state: Dict[str, Any],
             describe: Dict[str, Any]) -> Path:
        """Write ``step_N`` atomically. On any rank's failure every rank raises CheckpointError
        and the earlier checkpoints are left untouched."""
        import torch.distributed as dist

        name = f"step_{step:08d}"
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        error: Optional[str] = None
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                for h in self.hooks:
                    h.on_checkpoint_dir(step, tmp)
                tmp.mkdir()
        except OSError as e:
            error = f"rank 0 could not create {tmp}: {e}"
        error = _agree(error)
        if error is None:
            try:
                with contextlib.ExitStack() as writes:
                    for h in self.hooks:
                        writes.enter_context(h.checkpoint_writes(step))
                    engine.save(str(tmp), DS_TAG)  # holds an I/O error until all ranks return
                    (tmp / "ranks").mkdir(exist_ok=True)
                    torch.save(rank_state, tmp / "ranks" / f"rank_{self.rank:05d}.pt")
            except Exception as e:  # noqa: BLE001 - disk full, permissions, ...
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
            error = _agree(error)
        if error is None and self.rank == 0:
            try:
                (tmp / STATE).write_text(json.dumps(trainer_state, indent=1))
                self._describe(tmp, describe)
                fsync_tree(tmp)
                write_manifest(tmp, self.checksums)
                fsync_tree(tmp)
                if final.exists():  # an older run's checkpoint of the same step
                    shutil.rmtree(final)
                os.rename(tmp, final)
                fsync_dir(self.root)
            except Exception as e:  # noqa: BLE001
                error = f"rank 0: {type(e).__name__}: {e}"
        error = _agree(error)
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            previous, _ = find_latest(self.root, checksums=False)
            left = " (could not remove it: remove it by hand)" if tmp.exists() else ""
            raise CheckpointError(
                f"saving checkpoint {final} failed ({error}){_space_note(self.root, previous)}. "
                f"The partial save {tmp} was removed{left}; earlier checkpoints are intact, the "
                f"newest is {previous or 'none'}. Free space or fix permissions in {self.root}, "
                f"then relaunch: it resumes from the newest (trainer.resume=auto)."
            )
        if self.rank == 0:
            try:  # only a hint (the scan decides): failing to update it loses nothing
                latest_tmp = self.root / ".latest.tmp"
                latest_tmp.write_text(name + "\n")
                os.replace(latest_tmp, self.root / "latest")
            except OSError as e:
                log.warning("checkpoint %s is complete but the 'latest' hint was not updated: %s",
                            final, e)
            self._prune()
        dist.barrier()
        return final

    def _describe(self, ckpt: Path, describe: Dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(describe["config"])))
        (ckpt / "model_args.json").write_text(json.dumps(describe["model_args"], indent=1))
        tok = describe.get("tokenizer")
        if tok:
            shutil.copyfile(tok, ckpt / "tokenizer.model")

    def _prune(self) -> None:
        for old in _step_dirs(self.root)[self.keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)

    # -- find --------------------------------------------------------------------------------
    def resolve_resume(self, resume: str, on_existing: str = "refuse",
                       metrics_file: str = "metrics.jsonl",
                       run_files: Tuple[str, ...] = ()) -> Optional[Path]:
        """Rank 0 picks (and verifies) the checkpoint to resume from; all ranks get its path, or
        all raise the same error.

        ``auto`` with checkpoints of which none verifies refuses (CheckpointError, nothing
        touched) unless ``on_existing`` archives or overwrites the old history; so does
        ``never`` in a directory that holds a history (ConfigError; preflight refuses that case
        earlier). ``run_files``: more of the run's files (its W&B dir), set aside with the
        checkpoints."""
        import torch.distributed as dist

        choice: List[Any] = [None, [], None]  # path, warnings, the error every rank raises
        if self.rank == 0:
            try:
                choice = [*self._choose(resume, on_existing, (metrics_file, *run_files)), None]
            except (CheckpointError, ConfigError) as e:
                choice = [None, [], e]
        dist.broadcast_object_list(choice, src=0)
        path, warnings, error = choice
        if error is not None:
            raise error
        if self.rank == 0:
            for w in warnings:
                log.warning(w)
        return Path(path) if path else None

    def _choose(self, resume: str, on_existing: str,
                run_files: Tuple[str, ...]) -> Tuple[Optional[str], List[str]]:
        """Rank 0: (checkpoint path or None, warnings); raises what refuses the start."""
        if resume == "never":
            return None, self._start_over(on_existing, run_files, None)
        if resume == "auto":
            path, warnings = find_latest(self.root, self.checksums)
            if path is None and warnings:
                warnings = self._start_over(on_existing, run_files, warnings)
            return (str(path) if path else None), warnings
        reason = verify(Path(resume), self.checksums)
        if reason is not None:
            raise CheckpointError(f"trainer.resume={resume}: {reason}")
        return str(Path(resume)), []

    def _start_over(self, on_existing: str, run_files: Tuple[str, ...],
                    unusable: Optional[List[str]]) -> List[str]:
        """Rank 0, starting from step 0: the old history stays (refused: raises) or is set
        aside. Returns the warnings to log. ``run_files``: the metrics file first, then more
        names to set aside."""
        history = existing_history(self.output_dir, run_files[0])
        if not history:
            return list(unusable or [])
        if on_existing == "refuse":
            if unusable is None:  # resume=never (preflight refuses this before the group)
                raise ConfigError(
                    f"trainer.resume=never but {self.output_dir} holds a run "
                    f"({', '.join(history[-3:])}); set trainer.on_existing=archive or "
                    f"overwrite, or use another trainer.output_dir.")
            listed = "; ".join(w.removeprefix("skipping checkpoint ") for w in unusable)
            raise CheckpointError(
                f"trainer.resume=auto: none of the {len(unusable)} checkpoint(s) in {self.root} "
                f"verifies: {listed}. Nothing was changed. Restore a good copy and relaunch, or "
                f"start over explicitly with trainer.on_existing=archive (moves the old history "
                f"to {Path(self.output_dir) / ARCHIVE}/<time>/) or trainer.on_existing=overwrite "
                f"(deletes it).")
        dest = set_aside_history(self.output_dir, on_existing, run_files)
        what = f"archived to {dest}" if dest else "deleted (trainer.on_existing=overwrite)"
        return [*(unusable or []), f"starting over at step 0: the previous history in "
                f"{self.output_dir} ({len(history)} item(s): {', '.join(history[-3:])}) was "
                f"{what}"]

    # -- load --------------------------------------------------------------------------------
    def load(self, engine, ckpt: Path, universal: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Restore engine (weights, optimizer, scheduler) and return (trainer_state, rank_state)."""
        tag = UNIVERSAL_TAG if universal else DS_TAG
        if not engine.load(str(ckpt), tag):
            raise CheckpointError(f"DeepSpeed could not load {ckpt}/{tag}")
        state = read_state(ckpt)
        rank_file = ckpt / "ranks" / f"rank_{self.rank:05d}.pt"
        rank_state = torch.load(rank_file, weights_only=True) if rank_file.exists() else {}
        return state, rank_state


def prepare_universal(ckpt: Path, rank: int) -> Path:
    """Convert a ZeRO checkpoint to DeepSpeed's universal format (once, by rank 0), so it can be
    loaded on a different data-parallel world size."""
    out = ckpt / UNIVERSAL_TAG
    error = None
    if rank == 0 and not (out / "zero").is_dir():
        tmp = ckpt / ".universal.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("converting %s to a universal checkpoint for a new world size", ckpt)
        proc = convert_to_universal(ckpt / DS_TAG, tmp)
        if proc.returncode != 0:
            error = f"ds_to_universal failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        else:
            os.rename(tmp, out)
    error = _agree(error)
    if error:
        raise CheckpointError(error)
    return out


def _space_note(root: Path, previous: Optional[Path]) -> str:
    """Free space beside the error: a full disk often surfaces as an obscure write error."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    need = sum(p.stat().st_size for p in previous.rglob("*") if p.is_file()) if previous else 0
    note = f"; {free / 2**20:.1f} MiB free on the filesystem of {root}"
    if need and free < need:
        note += f", less than one checkpoint ({need / 2**20:.1f} MiB): the disk is full"
    return note


def _agree(error: Optional[str]) -> Optional[str]:
    """All ranks learn whether any rank failed (and the first message)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    return failed[0] if failed else None


# ----------------------------------------------------------------------------------------------
# Consolidation for export (no process group needed)


def load_consolidated(ckpt_dir: str):
    """(ModelArgs, full fp32 state dict, tokenizer path or None) from a checkpoint directory.

    Accepts a ``step_N`` directory or an output/checkpoints directory (then the latest complete
    one is used). ZeRO shards are merged with DeepSpeed's zero_to_fp32.
    """
    from llama_train.model import ModelArgs

    path = Path(ckpt_dir)
    if not (path / STATE).is_file():
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found, warnings = find_latest(root, checksums=False)
        for w in warnings:
            log.warning(w)
        if found is None:
            raise CheckpointError(f"no complete checkpoint found in {ckpt_dir}")
        path = found
    reason = verify(path, checksums=True)
    if reason is not None:
        raise CheckpointError(f"checkpoint {path} does not verify: {reason}")
    state = read_state(path)
    args = ModelArgs(**json.loads((path / "model_args.json").read_text()))
    sd = consolidate_fp32(path, DS_TAG, state.get("zero_stage", 0))
    sd = {k.removeprefix("module.").replace("_orig_mod.", ""): v.float() for k, v in sd.items()}
    tok = path / "tokenizer.model"
    return args, sd, (str(tok) if tok.exists() else None)
