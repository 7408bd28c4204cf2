"""One process (world of 1, a real DeepSpeed engine) for tests/system/test_reliability.py: checkpoint
saves that fail (injected errors; a full tmpfs and a read-only bind mount when this process may
mount), the resume afterwards, and tampered checkpoint files.

Prints one JSON object of observations; the test makes the assertions.
    python tests/workers/fault_ckpt_worker.py <workdir>
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import torch


def _engine(seed: int = 0):
    from llama_train import engine as eng
    from llama_train.config import BatchPlan, DeepSpeedConfig, OptimConfig
    from llama_train.job.optim import param_groups
    from llama_train.model import ModelArgs, Transformer

    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, multiple_of=16,
                                  max_seq_len=32), seed=seed)
    ds = eng.build_ds_config(DeepSpeedConfig(zero_stage=0, precision="fp32"), OptimConfig(),
                             BatchPlan(1, 2, 1, 2, 16), "cpu", model_dim=64)
    return eng.initialize(model, param_groups(model, OptimConfig()), ds)


def _train_step(engine) -> None:
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()


def _weights(engine):
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _save(mgr, engine, step: int, faults: str = ""):
    """Returns (path or None, error message or None, .tmp dirs left, latest hint)."""
    from llama_train.checkpoint import CheckpointError

    from llama_train.job.faults import FaultInjector, FaultPlan

    mgr.hooks = [FaultInjector(FaultPlan.parse(faults), mgr.rank)]
    try:
        path, err = mgr.save(engine, step, trainer_state={"step": step},
                             rank_state={"x": torch.zeros(1)},
                             describe={"config": {}, "model_args": {}, "tokenizer": None}), None
    except CheckpointError as e:
        path, err = None, str(e)
    finally:
        mgr.hooks = []
    latest = mgr.root / "latest"
    return {"path": str(path) if path else None, "error": err,
            "tmp_left": sorted(p.name for p in mgr.root.glob(".tmp-*")),
            "latest": latest.read_text().strip() if latest.exists() else None,
            "complete": sorted(p.name for p in mgr.root.glob("step_*"))}


def _resumes_exactly(mgr, saved_weights) -> bool:
    """A fresh engine loads the newest complete checkpoint and has the saved weights."""
    from llama_train.checkpoint import find_latest

    engine = _engine(seed=123)  # different initial weights: the load must replace them
    newest, _ = find_latest(mgr.root)
    mgr.load(engine, newest, universal=False)
    now = _weights(engine)
    return newest is not None and all(torch.equal(now[k], saved_weights[k]) for k in now)


def _mount(args) -> str | None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    return proc.stderr.strip() or f"mount exit {proc.returncode}"


class _Payload:
    """Unpickling this runs os.mkdir(marker): what a malicious checkpoint file could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def tamper(path: Path, marker: Path) -> None:
    """Replace ``path`` by a pickle that runs code when loaded, padded to the same size."""
    blob = pickle.dumps(_Payload(str(marker)), protocol=2)
    size = path.stat().st_size
    assert len(blob) < size
    path.write_bytes(blob + b"\0" * (size - len(blob)))


def main() -> None:
    from llama_train import engine as eng
    from llama_train.checkpoint import CheckpointError, CheckpointManager, verify
    from llama_train.comm import CommConfig
    from llama_train.job.preflight import _check_writable

    work = Path(sys.argv[1])
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    rt = eng.detect_runtime("cpu")
    eng.init_distributed(CommConfig(), rt.device_type)
    res = {}

    # --- injected failures on a normal disk ------------------------------------------------------
    engine = _engine()
    _train_step(engine)
    mgr = CheckpointManager(str(work / "injected"), keep_last=5, checksums=True, rank=0,
                            world_size=1)
    res["first_save"] = _save(mgr, engine, 1)
    saved = _weights(engine)
    _train_step(engine)
    res["erofs_mkdir"] = _save(mgr, engine, 2, "save_error:step=2,rank=0,errno=EROFS,at=mkdir")
    res["enospc_deepspeed_write"] = _save(mgr, engine, 2, "save_error:step=2,rank=0,errno=ENOSPC")
    res["enospc_rank_file"] = _save(mgr, engine, 2, "save_error:step=2,rank=0,write=2")
    res["injected_resume_exact"] = _resumes_exactly(mgr, saved)

    # --- a real full disk and a real read-only directory (needs CAP_SYS_ADMIN) -----------------
    one_ckpt = sum(p.stat().st_size for p in (mgr.root / "step_00000001").rglob("*") if p.is_file())
    small = work / "tmpfs"
    small.mkdir()
    why = _mount(["-t", "tmpfs", "-o", f"size={int(one_ckpt * 1.5) + 65536}", "tmpfs", str(small)])
    res["tmpfs"] = {"skipped": why}
    if why is None:
        try:
            full = CheckpointManager(str(small), keep_last=5, checksums=True, rank=0, world_size=1)
            first = _save(full, engine, 2)
            saved_full = _weights(engine)
            _train_step(engine)
            second = _save(full, engine, 3)
            res["tmpfs"] = {"skipped": None, "checkpoint_bytes": one_ckpt, "first": first,
                            "second": second, "resume_exact": _resumes_exactly(full, saved_full)}
        finally:
            subprocess.run(["umount", "-l", str(small)])
    ro = work / "readonly"
    (ro / "checkpoints").mkdir(parents=True)
    shutil.copytree(mgr.root / "step_00000001", ro / "checkpoints" / "step_00000001")
    why = _mount(["--bind", str(ro), str(ro)]) or _mount(["-o", "remount,bind,ro", str(ro)])
    res["readonly"] = {"skipped": why}
    if why is None:
        try:
            rom = CheckpointManager(str(ro), keep_last=5, checksums=True, rank=0, world_size=1)
            try:
                _check_writable(str(ro))
                pre = None
            except ValueError as e:
                pre = str(e)
            res["readonly"] = {"skipped": None, "preflight": pre, "save": _save(rom, engine, 4),
                               "resume_exact": _resumes_exactly(rom, saved)}
        finally:
            subprocess.run(["umount", "-l", str(ro)])

    # --- tampered checkpoint: refused before anything is unpickled -------------------------------
    good = mgr.root / "step_00000001"
    bad = mgr.root / "step_00000009"
    shutil.copytree(good, bad)
    marker = work / "PAYLOAD_RAN"
    victim = bad / "ds" / "mp_rank_00_model_states.pt"
    tamper(victim, marker)
    res["tampered_verify"] = verify(bad)
    try:
        mgr.resolve_resume(str(bad))
        res["tampered_explicit_resume"] = None
    except CheckpointError as e:
        res["tampered_explicit_resume"] = str(e)
    res["payload_ran_after_verify"] = marker.exists()
    # defence in depth: even with checksums off, the loader refuses to run the payload
    lax = CheckpointManager(str(work / "injected"), keep_last=5, checksums=False, rank=0,
                            world_size=1)
    try:
        lax.load(_engine(), bad, universal=False)
        res["tampered_unchecked_load"] = None
    except Exception as e:  # noqa: BLE001
        res["tampered_unchecked_load"] = f"{type(e).__name__}: {str(e)[:300]}"
    res["payload_ran_after_restricted_load"] = marker.exists()
    # control: the payload is live (plain pickle loading runs it)
    try:
        torch.load(victim, weights_only=False)
    except Exception:  # noqa: BLE001 - it runs, then torch finds no checkpoint
        pass
    res["payload_runs_with_plain_pickle"] = marker.exists()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
