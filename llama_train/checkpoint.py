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
(:func:`restricted_torch_load`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

log = logging.getLogger("llama_train")

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
DS_TAG = "ds"
UNIVERSAL_TAG = "universal"


class CheckpointError(RuntimeError):
    pass


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


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _hold_io_errors(engine, held: List[BaseException]) -> Iterator[None]:
    """Around ``engine.save_checkpoint``: DeepSpeed's file writes (its checkpoint engine's
    ``save``/``makedirs`` and the copy of its recovery scripts) record their exception in
    ``held`` instead of raising, and write nothing after the first one, while DeepSpeed's
    barriers still run on every rank."""
    targets = [(getattr(engine, "checkpoint_engine", None), "save"),
               (getattr(engine, "checkpoint_engine", None), "makedirs"),
               (engine, "_copy_recovery_script")]
    patched = []
    for obj, name in targets:
        fn = getattr(obj, name, None) if obj is not None else None
        if fn is None or name in vars(obj):
            continue

        def guarded(*args, _fn=fn, **kwargs):
            if held:
                return None
            try:
                return _fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - reported after DeepSpeed returns
                held.append(e)
                return None

        setattr(obj, name, guarded)  # an instance attribute shadows the method
        patched.append((obj, name))
    try:
        yield
    finally:
        for obj, name in patched:
            delattr(obj, name)


# ----------------------------------------------------------------------------------------------
# Untrusted checkpoint files: tensors only, never arbitrary pickled objects


def _deepspeed_safe_globals() -> List[Any]:
    """The non-tensor classes DeepSpeed pickles into its checkpoint files (ZeRO 0-3, fp32/bf16/
    fp16, with or without offload): plain value holders, safe to rebuild."""
    out: List[Any] = []
    for module, names in (("deepspeed.runtime.zero.config", ["ZeroStageEnum"]),
                          ("deepspeed.utils.tensor_fragment", ["fragment_address"]),
                          ("deepspeed.runtime.fp16.loss_scaler",
                           ["LossScaler", "DynamicLossScaler"])):
        try:
            mod = __import__(module, fromlist=names)
        except ImportError:
            continue
        out += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return out


@contextlib.contextmanager
def restricted_torch_load() -> Iterator[None]:
    """Inside: every ``torch.load`` (DeepSpeed's included, which asks for ``weights_only=False``)
    uses torch's restricted unpickler, extended only by :func:`_deepspeed_safe_globals`. A file
    that smuggles in any other object fails to load instead of running code."""
    real_load = torch.load
    allowed = _deepspeed_safe_globals()

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            return real_load(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real_load


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


def read_state(ckpt: Path) -> Dict[str, Any]:
    return json.loads((ckpt / STATE).read_text())


class CheckpointManager:
    """Saves and finds checkpoints; every rank calls ``save`` (DeepSpeed writes shards per rank)."""

    def __init__(self, output_dir: str, keep_last: int, checksums: bool, rank: int,
                 world_size: int):
        self.root = Path(output_dir) / "checkpoints"
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

        from llama_train.faults import FaultPlan

        faults = FaultPlan.from_env()
        name = f"step_{step:08d}"
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        error: Optional[str] = None
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                faults.check_mkdir(step, self.rank, tmp)
                tmp.mkdir()
        except OSError as e:
            error = f"rank 0 could not create {tmp}: {e}"
        error = _agree(error)
        if error is None:
            try:
                held: List[BaseException] = []
                with faults.failing_writes(step, self.rank):
                    # DeepSpeed's save has barriers between its writes: a write that raised on
                    # one rank would leave the ranks in different collectives. Hold the error
                    # until DeepSpeed returns, so all ranks reach the agreement below together.
                    with _hold_io_errors(engine, held):
                        engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=False,
                                               client_state=_universal_info())
                    if held:
                        raise held[0]
                    (tmp / "ranks").mkdir(exist_ok=True)
                    torch.save(rank_state, tmp / "ranks" / f"rank_{self.rank:05d}.pt")
            except Exception as e:  # noqa: BLE001 - disk full, permissions, ...
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
            error = _agree(error)
        if error is None and self.rank == 0:
            try:
                (tmp / STATE).write_text(json.dumps(trainer_state, indent=1))
                self._describe(tmp, describe)
                _fsync_tree(tmp)
                write_manifest(tmp, self.checksums)
                _fsync_tree(tmp)
                if final.exists():  # an older run's checkpoint of the same step
                    shutil.rmtree(final)
                os.rename(tmp, final)
                _fsync_dir(self.root)
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
    def resolve_resume(self, resume: str) -> Optional[Path]:
        """Rank 0 picks (and verifies) the checkpoint to resume from; all ranks get its path."""
        import torch.distributed as dist

        choice: List[Any] = [None, []]
        if self.rank == 0:
            if resume == "never":
                choice = [None, []]
            elif resume == "auto":
                path, warnings = find_latest(self.root, self.checksums)
                choice = [str(path) if path else None, warnings]
            else:
                reason = verify(Path(resume), self.checksums)
                if reason is not None:
                    choice = [None, [f"ERROR: trainer.resume={resume}: {reason}"]]
                else:
                    choice = [str(Path(resume)), []]
        dist.broadcast_object_list(choice, src=0)
        path, warnings = choice
        for w in warnings:
            if w.startswith("ERROR: "):
                raise CheckpointError(w[len("ERROR: "):])
            if self.rank == 0:
                log.warning(w)
        return Path(path) if path else None

    # -- load --------------------------------------------------------------------------------
    def load(self, engine, ckpt: Path, universal: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Restore engine (weights, optimizer, scheduler) and return (trainer_state, rank_state)."""
        tag = UNIVERSAL_TAG if universal else DS_TAG
        with restricted_torch_load():
            load_path, _ = engine.load_checkpoint(str(ckpt), tag=tag, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load {ckpt}/{tag}")
        state = read_state(ckpt)
        rank_file = ckpt / "ranks" / f"rank_{self.rank:05d}.pt"
        rank_state = torch.load(rank_file, weights_only=True) if rank_file.exists() else {}
        return state, rank_state


def _universal_info() -> Dict[str, Any]:
    """What ds_to_universal needs to re-partition our (tensor-parallel-free) model."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO,
                                                UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {UNIVERSAL_CHECKPOINT_INFO: {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def prepare_universal(ckpt: Path, rank: int) -> Path:
    """Convert a ZeRO checkpoint to DeepSpeed's universal format (once, by rank 0), so it can be
    loaded on a different data-parallel world size."""
    out = ckpt / UNIVERSAL_TAG
    error = None
    if rank == 0 and not (out / "zero").is_dir():
        tmp = ckpt / ".universal.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-c", "from llama_train.checkpoint import _ds_to_universal_main; "
               "_ds_to_universal_main()", "--input_folder", str(ckpt / DS_TAG),
               "--output_folder", str(tmp), "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
        log.info("converting %s to a universal checkpoint for a new world size", ckpt)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            error = f"ds_to_universal failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        else:
            os.rename(tmp, out)
    error = _agree(error)
    if error:
        raise CheckpointError(error)
    return out


def _ds_to_universal_main() -> None:
    """DeepSpeed's ds_to_universal, with its torch.load calls restricted (see
    :func:`restricted_torch_load`); its worker processes are forked and inherit that."""
    from deepspeed.checkpoint import ds_to_universal

    with restricted_torch_load():
        ds_to_universal.main(ds_to_universal.parse_arguments())


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
    if state.get("zero_stage", 0) == 0:
        files = sorted((path / DS_TAG).glob("mp_rank_*_model_states.pt"))
        with restricted_torch_load():
            sd = torch.load(files[0], map_location="cpu")["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with restricted_torch_load():
            sd = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DS_TAG)
    sd = {k.removeprefix("module.").replace("_orig_mod.", ""): v.float() for k, v in sd.items()}
    tok = path / "tokenizer.model"
    return args, sd, (str(tok) if tok.exists() else None)


def model_args_dict(args) -> Dict[str, Any]:
    return asdict(args)
