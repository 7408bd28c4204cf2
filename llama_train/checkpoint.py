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
(:func:`_step_dirs`).

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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from llama_train.config import ConfigError
from llama_train.engine.ds_checkpoint import (consolidate_fp32, convert_to_universal, failed_file,
                                              load_error_cause)
from llama_train.engine.wrapper import host_copy
from llama_train.hooks import Hook
from llama_train.watchdog import phase as watchdog_phase
from llama_train.util import free_bytes, fsync_dir, fsync_tree, within

log = logging.getLogger("llama_train")

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
DS_TAG = "ds"
UNIVERSAL_TAG = "universal"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded (exit 3)."""


class NotACheckpoint(ConfigError):
    """A path given as a checkpoint holds none at all, complete or not: bad input (exit 2)."""


class _SaveRefused(Exception):
    """A save that must not happen (its ``fix`` says what to do instead of freeing space)."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.fix = fix


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


# ----------------------------------------------------------------------------------------------


# What saves write in ``checkpoints/`` besides the step directories: the hint, its temporary,
# partial saves (``.tmp-step_N``, removed by the next save) and preflight's write probe.
_OWN_ENTRIES = ("latest", ".latest.tmp")
_OWN_PREFIXES = (".tmp-step_", ".write-probe-")
_STEP_NAME = re.compile(r"step_(\d{8,})")
_STRAYS_WARNED: set = set()  # (root, name): each stray entry is warned about once a process


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name as a save writes it (``step_00000004``: 4), or
    None for any other name (``step_00000004.bak``, ``step_abc``, ``step_4``, a README)."""
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m and name == f"step_{int(m.group(1)):08d}" else None


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


@dataclass
class SaveRecord:
    """One save as the metrics record it: how long the loop was blocked (waiting for the
    previous write, the checks and the copy to host memory) and how long until it was durable
    (the final name and manifest on disk), both from the save's start."""

    step: int
    path: Path
    blocked_s: float
    waited_s: float  # of blocked_s: waiting for the previous save's background write
    durable_s: Optional[float] = None
    error: Optional[BaseException] = None  # CheckpointError; or a lost rank's collective error


class CheckpointManager:
    """Saves and finds checkpoints; every rank calls ``save`` (DeepSpeed writes shards per rank)."""

    def __init__(self, output_dir: str, keep_last: int, checksums: bool, rank: int,
                 world_size: int, hooks: Sequence[Hook] = (), lead: Optional[bool] = None,
                 async_save: bool = False, group: Any = None):
        """``lead``: whether this process does rank 0's part (the directory, the manifest, the
        choice of checkpoint); default: rank 0. A simulated rank leads its job of one.
        ``async_save``: write in the background (:meth:`save`), the ranks agreeing over
        ``group``, a process group no other thread uses while a write is in flight."""
        self.output_dir = output_dir
        self.root = Path(output_dir) / "checkpoints"
        self.hooks = list(hooks)  # on_checkpoint_dir / checkpoint_writes (fault injection)
        self.keep_last = keep_last
        self.checksums = checksums
        self.rank = rank
        self.world_size = world_size
        self.lead = rank == 0 if lead is None else lead
        self.async_save = async_save
        self.group = group  # the ranks' agreement in a background write (not the loop's group)
        # the write in flight (async_save): its thread and the record it completes
        self._inflight: Optional[Tuple[threading.Thread, SaveRecord]] = None
        self._done: List[SaveRecord] = []  # saves finished since finished() was last asked

    # -- save --------------------------------------------------------------------------------
    def save(self, engine, step: int, trainer_state: Dict[str, Any], rank_state: Dict[str, Any],
             describe: Dict[str, Any]) -> Path:
        """Write ``step_N`` atomically; returns its final path. On any rank's failure every rank
        raises CheckpointError and the earlier checkpoints are left untouched.

        With ``async_save`` the save returns once the state is copied to host memory and the
        writes, fsync, checksums and manifest run on a background thread: the checkpoint is
        complete only when :meth:`wait` returns, and a failed write raises there, or at the next
        save, which waits for the write in flight (at most one)."""
        t0 = time.perf_counter()
        previous = self._inflight[1].path.name if self._inflight is not None else None
        waited = self.wait()  # at most one write in flight
        if waited >= 0.01 and self.lead:
            log.info("the save of step %d waited %.1fs for the background write of %s (the "
                     "disk is slower than trainer.save_every steps)", step, waited, previous)
        name = f"step_{step:08d}"
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        self._refuse_nonfinite(engine, step, final)
        error: Optional[str] = None
        fix: Optional[str] = None
        try:
            if self.lead:
                self.root.mkdir(parents=True, exist_ok=True)
                _refuse_foreign_tmp(tmp)
                if tmp.exists():
                    shutil.rmtree(tmp)
                for h in self.hooks:
                    h.on_checkpoint_dir(step, tmp)
                tmp.mkdir()
        except _SaveRefused as e:
            error, fix = f"rank 0: {e}", e.fix
        except OSError as e:
            error = f"rank 0 could not create {tmp}: {e}{_full_disk_note(e, self.root)}"
        agreed = _agree((error, fix) if error is not None else None)
        error, fix = agreed if agreed is not None else (None, None)
        if self.async_save and error is None:
            error = self._start_background(engine, SaveRecord(step, final, 0.0, waited), t0,
                                           tmp, trainer_state, rank_state, describe)
            if error is None:
                return final
        if error is None:
            error = self._write_rank_files(step, tmp, rank_state, engine=engine)
        self._commit(step, tmp, final, error, trainer_state, describe, group=None, hashed={},
                     fix=fix)
        self._done.append(SaveRecord(step, final, blocked_s=time.perf_counter() - t0,
                                     waited_s=waited, durable_s=time.perf_counter() - t0))
        return final

    def _start_background(self, engine, record: "SaveRecord", t0: float, tmp: Path,
                          trainer_state: Dict[str, Any], rank_state: Dict[str, Any],
                          describe: Dict[str, Any]) -> Optional[str]:
        """An asynchronous save's part in the loop: DeepSpeed's collectives and directories,
        its files' states copied to host memory, the rest taken as it is now (the loop moves
        on, a file may change meanwhile); then the writer thread. None, or what failed (agreed
        by every rank)."""
        snapshot: List[Tuple[str, Any]] = []
        error = None
        try:
            engine.save(str(tmp), DS_TAG, snapshot=snapshot)
            rank_state = host_copy(rank_state)
            trainer_state = json.loads(json.dumps(trainer_state))
            if self.lead and describe.get("tokenizer"):
                describe = {**describe,
                            "tokenizer_bytes": Path(describe["tokenizer"]).read_bytes()}
        except Exception as e:  # noqa: BLE001 - a directory DeepSpeed could not create
            error = f"rank {self.rank}: {type(e).__name__}: {e}{_full_disk_note(e, tmp)}"
        error = _agree(error)
        if error is None:
            record.blocked_s = time.perf_counter() - t0
            thread = threading.Thread(
                target=self._write_in_background, name=f"checkpoint-writer-{tmp.name}",
                args=(record, t0, tmp, snapshot, rank_state, trainer_state, describe),
                daemon=True)
            self._inflight = (thread, record)
            thread.start()
        return error

    def _write_rank_files(self, step: int, tmp: Path, rank_state: Dict[str, Any], engine=None,
                          snapshot: Sequence[Tuple[str, Any]] = ()) -> Optional[str]:
        """This rank's files: DeepSpeed's shards (through ``engine``, or its ``snapshot`` from
        host memory) and the rank's own state. None, or what failed."""
        try:
            with contextlib.ExitStack() as writes:
                for h in self.hooks:
                    writes.enter_context(h.checkpoint_writes(step))
                if engine is not None:
                    engine.save(str(tmp), DS_TAG)  # holds an I/O error until all ranks return
                for file, state in snapshot:
                    torch.save(state, file)
                (tmp / "ranks").mkdir(exist_ok=True)
                torch.save(rank_state, tmp / "ranks" / f"rank_{self.rank:05d}.pt")
        except Exception as e:  # noqa: BLE001 - disk full, permissions, ...
            # measured now, while the partial files still fill the disk
            return f"rank {self.rank}: {type(e).__name__}: {e}{_full_disk_note(e, tmp)}"
        return None

    def _write_in_background(self, record: "SaveRecord", t0: float, tmp: Path,
                             snapshot: List[Tuple[str, Any]], rank_state: Dict[str, Any],
                             trainer_state: Dict[str, Any], describe: Dict[str, Any]) -> None:
        """The writer thread of an asynchronous save: this rank's files from the snapshot, made
        durable and hashed here (every rank hashes its own, in parallel), then the commit, with
        the ranks agreeing over the checkpoint group (the training loop's group is busy)."""
        hashed: Dict[str, Dict[str, Any]] = {}
        error = self._write_rank_files(record.step, tmp, rank_state, snapshot=snapshot)
        written = [Path(f) for f, _ in snapshot] + [tmp / "ranks" / f"rank_{self.rank:05d}.pt"]
        snapshot.clear()  # the host copy is no longer needed
        if error is None:
            try:
                for p in written:
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
                    hashed[p.relative_to(tmp).as_posix()] = {
                        "size": p.stat().st_size,
                        "sha256": _sha256(p) if self.checksums else None}
            except OSError as e:
                error = f"rank {self.rank}: {type(e).__name__}: {e}{_full_disk_note(e, tmp)}"
        try:
            self._commit(record.step, tmp, record.path, error, trainer_state, describe,
                         group=self.group, hashed=hashed)
        except Exception as e:  # noqa: BLE001 - raised by wait(), on the loop's thread
            # a CheckpointError; or a lost rank (its collective failed): raised as it is, so
            # the entry point names the rank that is gone, as for the loop's own collectives
            record.error = e
        record.durable_s = time.perf_counter() - t0

    def wait(self) -> float:
        """Wait for the background write in flight, if any (async saves); the seconds waited.
        Raises its CheckpointError (every rank the same one) if it failed."""
        if self._inflight is None:
            return 0.0
        (thread, record), self._inflight = self._inflight, None
        t0 = time.perf_counter()
        if thread.is_alive():
            with watchdog_phase("save"):
                thread.join()
        waited = time.perf_counter() - t0
        self._done.append(record)
        if record.error is not None:
            if not isinstance(record.error, CheckpointError):
                log.error("the background write of checkpoint %s did not finish (%s: %s); its "
                          "partial save is never loaded, earlier checkpoints are intact",
                          record.path, type(record.error).__name__, record.error)
            raise record.error
        return waited

    def finished(self) -> List["SaveRecord"]:
        """The saves that completed (or failed) since the last call, for the metrics; a write
        found finished here is no longer waited for."""
        if self._inflight is not None and not self._inflight[0].is_alive() and \
                self._inflight[1].error is None:
            self.wait()  # a failure is raised where every rank raises it: the next wait()
        done, self._done = self._done, []
        return done

    def _commit(self, step: int, tmp: Path, final: Path, error: Optional[str],
                trainer_state: Dict[str, Any], describe: Dict[str, Any], group: Any,
                hashed: Dict[str, Dict[str, Any]], fix: Optional[str] = None) -> None:
        """After every rank wrote its files (``error``: this rank's failure, if any): rank 0
        writes the run's files and the manifest (last), renames the directory, updates the
        ``latest`` hint and prunes; or every rank raises the same CheckpointError and the
        partial directory is removed. ``hashed``: this rank's files, already hashed. ``fix``:
        what to do about ``error`` where the cause is known (agreed by every rank already)."""
        import torch.distributed as dist

        gathered = _gather((error, hashed), group)
        error = next((e for e, _ in gathered if e), None)
        if error is None and self.lead:
            try:
                (tmp / STATE).write_text(json.dumps(trainer_state, indent=1))
                self._describe(tmp, describe)
                fsync_tree(tmp)
                known = {rel: info for _, h in gathered for rel, info in h.items()}
                write_manifest(tmp, self.checksums, known)
                fsync_tree(tmp)
                if final.exists() or final.is_symlink():
                    if final.is_symlink() or not final.is_dir() or not is_checkpoint(final):
                        raise _SaveRefused(  # not ours to delete
                            f"{final} exists and is not a checkpoint (a file, a link or a "
                            f"directory no save wrote)",
                            f"Move {final} out of {self.root}, then relaunch: it resumes from "
                            f"the newest (trainer.resume=auto).")
                    shutil.rmtree(final)  # an older run's checkpoint of the same step
                os.rename(tmp, final)
                fsync_dir(self.root)
            except _SaveRefused as e:
                error, fix = f"rank 0: {e}", e.fix
            except Exception as e:  # noqa: BLE001
                error = f"rank 0: {type(e).__name__}: {e}{_full_disk_note(e, tmp)}"
        agreed = _agree((error, fix) if error is not None else None, group)
        if agreed is not None:
            error, fix = agreed
            # what became of the partial save, as rank 0 (which removes it) saw it: another
            # rank looking for itself may look before the removal
            partial = _agree(_remove_partial(tmp) if self.lead else None, group)
            previous, _ = find_latest(self.root, checksums=False)
            space = "" if fix else _space_note(self.root, previous, error)
            raise CheckpointError(
                f"saving checkpoint {final} failed ({error}){space}. "
                f"{partial or 'The partial save was removed'}; earlier checkpoints are intact, "
                f"the newest is {previous or 'none'}. "
                + (fix or _save_fix(error, self.root)))
        if self.lead:
            try:  # only a hint (the scan decides): failing to update it loses nothing
                latest_tmp = self.root / ".latest.tmp"
                latest_tmp.write_text(final.name + "\n")
                os.replace(latest_tmp, self.root / "latest")
            except OSError as e:
                log.warning("checkpoint %s is complete but the 'latest' hint was not updated: %s",
                            final, e)
            self._prune(final)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier(group=group)

    def _refuse_nonfinite(self, engine, step: int, final: Path) -> None:
        """Every rank checks the weights it holds (its ZeRO partitions); if any rank finds a
        NaN or inf, all refuse the save before writing anything: a checkpoint that vouches for
        non-finite weights would replace good ones under keep_last and could never train."""
        bad = _agree(None if engine.weights_finite() else f"rank {self.rank}")
        if bad is None:
            return
        previous, _ = find_latest(self.root, checksums=False)
        raise CheckpointError(
            f"refusing to save checkpoint {final}: the weights at step {step} are not finite "
            f"(NaN or inf, found on {bad}), and a checkpoint of them could never train again. "
            f"Nothing was written; earlier checkpoints are intact, the newest is "
            f"{previous or 'none'}. The run diverged: lower optim.lr or look at the data of the "
            f"last steps, then relaunch: it resumes from the newest (trainer.resume=auto).")

    def _describe(self, ckpt: Path, describe: Dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(describe["config"])))
        (ckpt / "model_args.json").write_text(json.dumps(describe["model_args"], indent=1))
        tok = describe.get("tokenizer")
        if tok:
            copy = ckpt / "tokenizer.model"
            if "tokenizer_bytes" in describe:  # read when the save began (asynchronous save)
                copy.write_bytes(describe["tokenizer_bytes"])
            else:
                shutil.copyfile(tok, copy)
            self._check_tokenizer(Path(tok), copy, describe.get("tokenizer_sha256"))

    def _check_tokenizer(self, source: Path, copy: Path, want: Optional[str]) -> None:
        """The copy must be the tokenizer the data was encoded with (meta.json's sha256): the
        manifest would vouch for whatever was copied, and keep_last would prune the good
        checkpoints, leaving a run that can be neither resumed nor exported."""
        got = _sha256(copy) if want else None
        if got is None or got == want:
            return
        previous, _ = find_latest(self.root, checksums=False)
        good = (f"from {previous / 'tokenizer.model'} (a verified copy)" if previous else
                "from where it came (data.tokenizer), or prepare the data again")
        raise _SaveRefused(
            f"the tokenizer {source} has sha256 {got[:12]}, but the data was encoded with "
            f"sha256 {want[:12]} (the prepared data's meta.json): the file changed during the "
            f"run, and a checkpoint must not vouch for it",
            f"Put the tokenizer back: restore {source} {good}; then relaunch: it resumes from "
            f"the newest (trainer.resume=auto).")

    def _prune(self, saved: Path) -> None:
        """trainer.keep_last: the newest ``keep_last`` complete checkpoints stay (``saved``, the
        one just written, always), other checkpoints go, with partial saves. What is not a
        checkpoint stays: a stray name (:func:`_step_dirs`), or a ``step_N`` directory holding
        nothing a save writes. A damaged checkpoint never counts as one of those kept."""
        steps = _step_dirs(self.root)
        complete = [p for p in steps if verify(p, checksums=False) is None]
        kept = {*complete[:self.keep_last], saved}
        for old in steps:
            if old not in kept and is_checkpoint(old):
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
        if self.lead:
            try:
                choice = [*self._choose(resume, on_existing, (metrics_file, *run_files)), None]
            except (CheckpointError, ConfigError, OSError) as e:  # OSError: setting aside
                choice = [None, [], e]  # the old history (EBUSY, a full disk): all ranks raise
        if not (self.lead and self.rank != 0):  # else a simulated rank: it chose alone
            dist.broadcast_object_list(choice, src=0)
        path, warnings, error = choice
        if error is not None:
            raise error
        if self.lead:
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
        require_checkpoint(Path(resume), "trainer.resume")  # preflight said so already
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
        """Restore engine (weights, optimizer, scheduler) and return (trainer_state, rank_state).
        ``universal``: from the universal conversion, verified first (converted again if it
        fails). A file that verified but does not load (a foreign checkpoint, or one altered
        together with its manifest) is a CheckpointError naming it, on every rank."""
        tag = UNIVERSAL_TAG if universal else DS_TAG
        if universal:
            prepare_universal(ckpt, self.rank, self.checksums)
        state = read_state(ckpt)
        rank_file = ckpt / "ranks" / f"rank_{self.rank:05d}.pt"
        error, rank_state = None, {}
        try:
            if not engine.load(str(ckpt), tag):
                error = f"DeepSpeed found no checkpoint in {ckpt / tag}"
            elif rank_file.exists():
                try:
                    rank_state = torch.load(rank_file, weights_only=True)
                except Exception as e:  # noqa: BLE001 - named below like DeepSpeed's files
                    error = f"{rank_file}: {load_error_cause(e)}"
        except Exception as e:  # noqa: BLE001 - only a file's fault is ours to report
            file = failed_file(e)
            if file is None and "Error(s) in loading state_dict" not in str(e):
                raise  # not a file that failed to load: a lost rank, a bug
            error = f"{file or ckpt / tag}: {load_error_cause(e)}"
        error = _agree(error)
        if error is not None:
            raise CheckpointError(
                f"checkpoint {ckpt} cannot be loaded: {error}. It passed its manifest's checks, "
                f"so it was written by another program or version, or altered along with its "
                f"manifest (or trainer.verify_checksums=false let a damaged file through); "
                f"nothing in it was run. Resume from another checkpoint "
                f"(trainer.resume=<its path>) or start a new run.")
        return state, rank_state


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


_DISK_FULL = ("No space left on device", "[Errno 28]", "ENOSPC", "Disk quota exceeded",
              "[Errno 122]")
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


def _refuse_foreign_tmp(tmp: Path) -> None:
    """A save's partial directory is a plain directory it made: a link or a file in its place
    is no earlier partial save, and a save never writes through or removes it."""
    if tmp.is_symlink():
        raise _SaveRefused(
            f"{tmp} is a symbolic link (to {os.readlink(tmp)}), not a partial save: a save never "
            f"writes through a link or deletes what one points to",
            f"Remove the link (rm {tmp}: what it points to stays), then relaunch: it resumes "
            f"from the newest (trainer.resume=auto).")
    if tmp.exists() and not tmp.is_dir():
        raise _SaveRefused(
            f"{tmp} is a file, not a partial save",
            f"Move {tmp} out of {tmp.parent}, then relaunch: it resumes from the newest "
            f"(trainer.resume=auto).")


def _remove_partial(tmp: Path) -> str:
    """Rank 0, after a failed save: remove its partial directory and say what became of it."""
    if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):
        return f"Nothing was written ({tmp} is not this save's: left as it is)"
    if not tmp.exists():
        return "Nothing was written"
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():
        return f"The partial save {tmp} could not be removed: remove it by hand"
    return f"The partial save {tmp} was removed"


def _gather(value: Any, group: Any = None) -> List[Any]:
    """Every rank's ``value`` (rank order), over ``group`` (None: the default group)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group)
    return values


def _agree(error: Any, group: Any = None) -> Any:
    """All ranks learn whether any rank failed (and the first message)."""
    failed = [e for e in _gather(error, group) if e]
    return failed[0] if failed else None


# ----------------------------------------------------------------------------------------------
# Consolidation for export (no process group needed)


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


def load_consolidated(ckpt_dir: str):
    """(ModelArgs, full fp32 state dict, tokenizer path or None) from a checkpoint directory.

    Accepts a ``step_N`` directory or an output/checkpoints directory (then the latest complete
    one is used: :func:`resolve_checkpoint`). ZeRO shards are merged with DeepSpeed's zero_to_fp32.
    Raises :class:`NotACheckpoint` for a path that holds no checkpoint at all (exit 2 in the
    CLIs) and CheckpointError, naming the file, for one that cannot be loaded (exit 3).
    """
    from llama_train.model import ModelArgs

    path = resolve_checkpoint(ckpt_dir)
    reason = verify(path, checksums=True)
    if reason is not None:
        raise CheckpointError(f"checkpoint {path} does not verify: {reason}")
    state = read_state(path)
    try:
        args = ModelArgs(**json.loads((path / "model_args.json").read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path / 'model_args.json'} cannot be read: {load_error_cause(e)}"
                              ) from None
    try:
        sd = consolidate_fp32(path, DS_TAG, state.get("zero_stage", 0))
    except Exception as e:  # noqa: BLE001 - whatever DeepSpeed trips on, the file is the cause
        raise CheckpointError(f"checkpoint {path} cannot be loaded: "
                              f"{failed_file(e) or path / DS_TAG}: {load_error_cause(e)}") from None
    sd = {k.removeprefix("module.").replace("_orig_mod.", ""): v for k, v in sd.items()}
    from llama_train.weights import WeightsError, check_state_dict

    try:  # before the cast to float: an integer tensor would pass as weights
        check_state_dict(sd, args, str(path / DS_TAG), config=str(path / "model_args.json"))
    except WeightsError as e:
        raise CheckpointError(f"checkpoint {path} cannot be used: {e}") from None
    sd = {k: v.float() for k, v in sd.items()}
    tok = path / "tokenizer.model"
    return args, sd, (str(tok) if tok.exists() else None)
