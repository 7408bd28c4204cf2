"""Saving and loading checkpoints: :class:`CheckpointManager`, which every rank calls.

A save writes ``.tmp-step_N`` and renames it to ``step_N`` only when it is whole (manifest last),
the ranks agreeing on every failure; with ``trainer.async_save`` the writes, fsync, checksums and
the commit run on a background thread, the ranks agreeing over the writer's own gloo group
(:func:`writer_group`, made with the manager). The protocol: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from llama_train.checkpoint.choice import choose
from llama_train.checkpoint.collective import _agree, _gather
from llama_train.checkpoint.discovery import (_step_dirs, find_latest, is_checkpoint,
                                              read_state)
from llama_train.checkpoint.disk import _full_disk_note, _save_fix, _space_note
from llama_train.checkpoint.errors import CheckpointError, _SaveRefused
from llama_train.checkpoint.layout import (DS_TAG, STATE, UNIVERSAL_TAG, _sha256, step_name,
                                           verify, write_manifest)
from llama_train.checkpoint.universal import prepare_universal
from llama_train.config import ConfigError
from llama_train.engine.distributed import checkpoint_group
from llama_train.engine.ds_checkpoint import failed_file, load_error_cause
from llama_train.engine.wrapper import host_copy
from llama_train.hooks import Hook
from llama_train.util import fsync_dir, fsync_tree
from llama_train.watchdog import phase as watchdog_phase

log = logging.getLogger("llama_train")

# How long a rank's background checkpoint write may wait for the other ranks' (their writes and
# checksums, then rank 0's commit): a write is slower than any collective of the loop.
WRITE_TIMEOUT_S = 3600


def writer_group(comm_timeout_s: float):
    """The background writer's own gloo group of every rank (``engine.checkpoint_group``), its
    timeout the longer of the loop's (``comm.timeout_s``) and :data:`WRITE_TIMEOUT_S`. A
    collective call: every rank makes it, at the same point of start-up (when the manager is
    built). None in a world of one and on a simulated rank."""
    return checkpoint_group(max(comm_timeout_s, WRITE_TIMEOUT_S))


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
                 async_save: bool = False, group: Any = None, comm_timeout_s: float = 0.0):
        """``lead``: whether this process does rank 0's part (the directory, the manifest, the
        choice of checkpoint); default: rank 0. A simulated rank leads its job of one.
        ``async_save``: write in the background (:meth:`save`), the ranks agreeing over
        ``group``, a process group no other thread uses while a write is in flight; by default
        the writer's own (:func:`writer_group`, ``comm_timeout_s``: the loop's collective
        timeout), made here: every rank builds its manager at the same point of start-up."""
        self.output_dir = output_dir
        self.root = Path(output_dir) / "checkpoints"
        self.hooks = list(hooks)  # on_checkpoint_dir / checkpoint_writes (fault injection)
        self.keep_last = keep_last
        self.checksums = checksums
        self.rank = rank
        self.world_size = world_size
        self.lead = rank == 0 if lead is None else lead
        self.async_save = async_save
        if async_save and group is None:  # a collective call, on every rank alike
            group = writer_group(comm_timeout_s)
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
        name = step_name(step)
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
        checkpoints (:func:`llama_train.checkpoint.choice.choose`)."""
        import torch.distributed as dist

        choice: List[Any] = [None, [], None]  # path, warnings, the error every rank raises
        if self.lead:
            try:
                choice = [*choose(self.root, self.output_dir, self.checksums, resume,
                                  on_existing, (metrics_file, *run_files)), None]
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
