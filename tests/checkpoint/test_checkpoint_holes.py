"""Checkpoint holes from the adversarial pass (issue 29): what a save vouches for, what a load
reads, and how a checkpoint that cannot be used is refused (docs/reliability.md).

1. a tokenizer.model changed mid-run is never copied into a checkpoint;
2. the universal checkpoint (a resume on a new world size) has its own manifest, verified before
   it is loaded (a bad one is converted again), and no load reads a file its manifest lacks;
3. non-finite weights are never saved (every rank checks what it holds, ZeRO-3 partitions too);
4. tampered, foreign or non-checkpoints through resume, llama-export and llama-import end in one
   line and a documented exit code (2: not a checkpoint at all; 3: a checkpoint that cannot be
   loaded), and no payload runs;
5. a full disk during the universal conversion is said as such and leaves nothing behind.

In-process (a world of one) wherever ranks do not matter; the launcher (2 CPU ranks, gloo) for
the all-ranks refusal of item 3; item 2 resumes copies of conftest's shared ZeRO-3 run.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import TINY, ZERO3, cfg_for, copy_at_step, tail, tiny_prepared, train as launch
from llama_train.checkpoint import CheckpointError, find_latest, verify, write_manifest
from llama_train.hooks import Hook
from llama_train.train import train

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _flip(path: Path, n: int = 16) -> None:
    """Same size, other bytes (the middle of the file: tensor data): only a sha256 sees it."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


class _Payload:
    """Unpickled by plain pickle, it creates ``marker``: the file must never run it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_payload(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Payload(str(marker)), protocol=2))


def _job(overrides, capsys, hooks=()) -> tuple:
    """llama-train's job (run_job: preflight, trainer, exit codes) in this process: (exit code,
    the 'llama-train: error:' lines, all of stderr)."""
    from hydra import compose, initialize_config_dir

    from llama_train.paths import CONFIG_DIR
    from llama_train.train import run_job

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        dcfg = compose("config", overrides=[*TINY, "trainer.micro_batch=4", *overrides])
    capsys.readouterr()
    code = 0
    try:
        run_job(dcfg, hooks)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("llama-train: error:")], err


def _cli(main, argv, capsys) -> tuple:
    """llama-export / llama-import in this process: (exit code, error lines, stderr)."""
    capsys.readouterr()
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if ": error:" in line], err


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """2 steps under ZeRO-1 (a real ZeRO checkpoint, convertible to the universal format), a
    checkpoint at step 2. Copied by the tests, never written to."""
    out = tmp_path_factory.mktemp("holes") / "small"
    train(cfg_for(out, "deepspeed.zero_stage=1", "trainer.max_steps=2", "trainer.save_every=2"))
    return out / "checkpoints" / "step_00000002"


# ------------------------------------------------------------------------------------------------
# 1. the tokenizer copied into a checkpoint is the one the data was encoded with


def test_tokenizer_changed_mid_run_fails_the_save_and_keeps_the_good_checkpoint(tmp_path, capsys):
    import shutil

    _, shared = tiny_prepared()
    data = tmp_path / "data"  # a copy: the session's prepared data is read by other tests
    shutil.copytree(shared.dir, data)  # (and by another pytest-xdist worker meanwhile)
    tok = data / "tokenizer.model"
    good = tok.read_bytes()
    assert _sha(tok) == shared.meta["tokenizer"]["sha256"]

    class Truncate(Hook):
        def on_step_begin(self, step):
            if step == 3:  # after the good save of step 2
                tok.write_bytes(good[: len(good) // 2])

    import multiprocessing

    out = tmp_path / "tok"
    before = set(multiprocessing.active_children())
    code, errors, err = _job([f"trainer.output_dir={out}", "trainer.max_steps=4",
                              "trainer.save_every=2", "trainer.keep_last=1",
                              f"data.prepared_dir={data}"], capsys, hooks=[Truncate()])
    prepared = shared
    assert code == 3, err[-3000:]
    # the failed last write stopped the run in Trainer.finish: its loader workers (which ignore
    # SIGTERM) were stopped too; one left behind made this process wait for it forever at exit
    assert not set(multiprocessing.active_children()) - before
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    msg = errors[0]
    assert "step_00000004" in msg and str(tok) in msg and "sha256" in msg, msg
    assert "restore" in msg and "step_00000002" in msg, msg  # what to do, and what is intact
    kept, _ = find_latest(out / "checkpoints")
    assert kept.name == "step_00000002"  # keep_last=1 pruned nothing: no later save vouched
    assert _sha(kept / "tokenizer.model") == prepared.meta["tokenizer"]["sha256"]
    assert not list((out / "checkpoints").glob(".tmp-*"))


# ------------------------------------------------------------------------------------------------
# 3. non-finite weights are never saved


def test_nonfinite_weights_are_never_saved(tmp_path, monkeypatch):
    """The optimizer step of step 3 leaves every weight NaN (as optim.lr=inf did): the save of
    step 3 is refused by name, the checkpoint of step 2 stays the newest."""
    monkeypatch.setenv("LLAMA_TRAIN_FAULTS", "nan_weights:step=3")
    out = tmp_path / "nan"
    with pytest.raises(CheckpointError) as err:
        train(cfg_for(out, "deepspeed.zero_stage=1", "trainer.max_steps=3",
                      "trainer.save_every=2"))
    msg = str(err.value)
    assert "step 3" in msg and "not finite" in msg and "step_00000002" in msg, msg
    assert find_latest(out / "checkpoints")[0].name == "step_00000002"
    saves = [p.name for p in (out / "checkpoints").iterdir()
             if p.name.startswith(("step_", ".tmp"))]
    assert saves == ["step_00000002"], saves


@pytest.mark.slow
def test_nonfinite_partition_on_one_rank_refuses_the_save_on_all(tmp_path):
    """ZeRO-3 on 2 ranks; only rank 1's partition turns NaN (rank 0's weights are finite): both
    ranks refuse the save of step 2 (exit 3), the checkpoint of step 1 is intact."""
    out = tmp_path / "z3nan"
    rc = launch(out, ["deepspeed.zero_stage=3", "trainer.max_steps=2", "trainer.save_every=1"],
                check=False, env={"LLAMA_TRAIN_FAULTS": "nan_weights:step=2,rank=1"})
    log = tmp_path / "z3nan-train.log"
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("llama-train: error:")]
    assert rc == 3, tail(log)
    # each rank says it, unless the launcher (seeing the first exit 3) stops the other first
    assert 1 <= len(errors) <= 2, tail(log)
    assert all("step 2" in e and "not finite" in e for e in errors), tail(log)
    assert "Traceback" not in text, tail(log)
    assert find_latest(out / "checkpoints")[0].name == "step_00000001"
    assert not (out / "checkpoints" / "step_00000002").exists()
    assert not list((out / "checkpoints").glob(".tmp-*"))


# ------------------------------------------------------------------------------------------------
# 4. what is not a checkpoint, or cannot be loaded, is refused in one line


def test_resume_from_a_directory_that_is_not_a_checkpoint_is_bad_input(tmp_path, capsys):
    from llama_train.config import ConfigError
    from llama_train.job.preflight import preflight

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.txt").write_text("not a checkpoint\n")
    cfg = cfg_for(tmp_path / "out", f"trainer.resume={notes}")
    with pytest.raises(ConfigError, match="trainer.resume=.*not a checkpoint"):
        preflight(cfg)  # before any process group
    code, errors, err = _job([f"trainer.output_dir={tmp_path / 'out'}",
                              f"trainer.resume={notes}"], capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert str(notes) in errors[0] and "trainer_state.json" in errors[0], errors


@pytest.mark.slow
def test_tampered_checkpoint_is_refused_in_one_line_by_resume_and_export(small_run, tmp_path,
                                                                         capsys):
    """A checkpoint whose model file is a code-running pickle and whose manifest was rewritten
    to match (a tampered or foreign checkpoint): resume and llama-export refuse it with exit 3
    and one line naming the file; the payload never runs."""
    from llama_train.hf import export_main

    bad = tmp_path / "step_00000002"
    shutil.copytree(small_run, bad)
    marker = tmp_path / "PAYLOAD_RAN"
    _plant_payload(bad / "ds" / "mp_rank_00_model_states.pt", marker)
    write_manifest(bad, checksums=True)  # verifies: only the loader stands in the way

    code, errors, err = _job([f"trainer.output_dir={tmp_path / 'resumed'}",
                              f"trainer.resume={bad}"], capsys)
    assert code == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "mp_rank_00_model_states.pt" in errors[0] and "posix.system" in errors[0], errors

    code, errors, err = _cli(export_main, [bad, tmp_path / "hf"], capsys)
    assert code == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith("llama-export: error:") and \
        "mp_rank_00_model_states.pt" in errors[0] and "posix.system" in errors[0], errors
    assert not marker.exists()

    # a trainer_state.json that is not JSON (manifest rewritten): the file is named, exit 3
    (bad / "trainer_state.json").write_text("{not json")
    write_manifest(bad, checksums=True)
    code, errors, err = _job([f"trainer.output_dir={tmp_path / 'resumed2'}",
                              f"trainer.resume={bad}"], capsys)
    assert code == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "trainer_state.json" in errors[0], errors
    code, errors, err = _cli(export_main, [bad, tmp_path / "hf"], capsys)
    assert code == 3 and len(errors) == 1 and "trainer_state.json" in errors[0], err[-3000:]


def test_export_refuses_what_is_not_a_checkpoint_or_does_not_verify(small_run, tmp_path, capsys):
    from llama_train.hf import export_main

    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (empty, tmp_path / "missing"):
        code, errors, err = _cli(export_main, [path, tmp_path / "hf"], capsys)
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert errors[0].startswith("llama-export: error:") and str(path) in errors[0], errors

    torn = tmp_path / "torn"
    shutil.copytree(small_run, torn)
    _flip(torn / "ds" / "mp_rank_00_model_states.pt")  # manifest left alone: fails its sha256
    code, errors, err = _cli(export_main, [torn, tmp_path / "hf"], capsys)
    assert code == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "mp_rank_00_model_states.pt" in errors[0] and "sha256" in errors[0], errors


def test_import_refuses_foreign_directories_in_one_line(tmp_path, capsys):
    import json

    from llama_train.hf import import_main, to_hf_config
    from llama_train.model import ModelArgs

    empty = tmp_path / "empty"
    empty.mkdir()
    code, errors, err = _cli(import_main, [empty, tmp_path / "out.pt"], capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith("llama-import: error:") and str(empty) in errors[0], errors

    hf = tmp_path / "hf"
    hf.mkdir()
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, multiple_of=16)
    (hf / "config.json").write_text(json.dumps(to_hf_config(args)))
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    code, errors, err = _cli(import_main, [hf, tmp_path / "out.pt"], capsys)
    assert code == 3 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "model.safetensors" in errors[0], errors

    (hf / "config.json").write_text("{not json")
    code, errors, err = _cli(import_main, [hf, tmp_path / "out.pt"], capsys)
    assert code == 3 and len(errors) == 1 and "config.json" in errors[0], err[-3000:]
    assert not (tmp_path / "out.pt").exists()


# ------------------------------------------------------------------------------------------------
# 2. the universal checkpoint has a manifest, and no load reads an unlisted file


def test_verify_refuses_unlisted_files_where_a_load_reads(small_run, tmp_path):
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(small_run, ckpt)
    (ckpt / "NOTES.txt").write_text("a note beside the checkpoint is harmless\n")
    assert verify(ckpt) is None
    # DeepSpeed finds its shards by name: a planted one would be read
    shutil.copy(ckpt / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                ckpt / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    reason = verify(ckpt, checksums=False)
    assert reason and "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt" in reason, reason


@pytest.mark.slow
def test_universal_checkpoint_is_verified_before_it_is_loaded(zero3_run, tmp_path, capsys):
    """Saved by 2 ranks under ZeRO-3, resumed by this one process through the universal format:
    the conversion gets its own manifest; a same-size corruption of a converted file is found
    before the load and the checkpoint is converted again, so the resumed run is the same."""
    a = copy_at_step(zero3_run, tmp_path / "a", 2)
    first = train(cfg_for(a, *ZERO3, "trainer.max_steps=3"))
    uni = a / "checkpoints" / "step_00000002" / "universal"
    assert (uni / "manifest.json").is_file()
    assert verify(uni, loaded=("",)) is None

    b = copy_at_step(a, tmp_path / "b", 2)  # the conversion travels with the copy
    victim = max((p for p in (b / "checkpoints" / "step_00000002" / "universal").rglob("*.pt")),
                 key=lambda p: p.stat().st_size)
    _flip(victim)
    capsys.readouterr()
    second = train(cfg_for(b, *ZERO3, "trainer.max_steps=3"))
    err = capsys.readouterr().err
    assert victim.name in err and "sha256" in err and "converting" in err, err[-3000:]
    assert second["losses"][3] == first["losses"][3]
    assert verify(b / "checkpoints" / "step_00000002" / "universal", loaded=("",)) is None


# ------------------------------------------------------------------------------------------------
# 5. a full disk during the universal conversion


def _mount(*args: str):
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


@pytest.mark.slow
def test_full_disk_during_universal_conversion(small_run, tmp_path, monkeypatch):
    """A real tmpfs with room for the checkpoint but not its conversion (where this machine lets
    us mount; else ENOSPC injected into the conversion's writes): one short message that says
    the disk is full, where, how much is free and what to do; the partial conversion removed."""
    from llama_train.checkpoint import prepare_universal

    size = sum(p.stat().st_size for p in small_run.rglob("*") if p.is_file())
    small = tmp_path / "tmpfs"
    small.mkdir()
    why = _mount("-t", "tmpfs", "-o", f"size={int(size * 1.3) + 65536}", "tmpfs", str(small))
    if why is not None:
        monkeypatch.setenv("LLAMA_TRAIN_FAULTS", "convert_error:errno=ENOSPC")
    try:
        ckpt = small / "step_00000002"
        shutil.copytree(small_run, ckpt)
        with pytest.raises(CheckpointError) as err:
            prepare_universal(ckpt, rank=0)
        msg = str(err.value)
        left = sorted(p.name for p in ckpt.iterdir())
    finally:
        if why is None:
            subprocess.run(["umount", "-l", str(small)], capture_output=True)
    print(f"tmpfs: {why or 'mounted'}; message: {msg}")
    assert "disk is full" in msg and "MiB free" in msg and "Free space" in msg, msg
    assert (f"filesystem at {small}" if why is None else "filesystem at") in msg, msg
    assert len(msg.splitlines()) <= 4 and len(msg) < 1500, msg
    assert ".universal.tmp" in msg and "removed" in msg, msg
    assert ".universal.tmp" not in left and "universal" not in left, left
