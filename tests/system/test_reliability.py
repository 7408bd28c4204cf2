"""Reliability: faults, bad input and load, with nothing lost (docs/reliability.md).

Multi-rank runs go through the real deepspeed launcher (2 CPU ranks, gloo, fp32, the tiny model).
They share one fault scenario, SCENARIO: global batch 3 gives a NaN loss (skipped), batches 6 and
7 give NaN twice in a row (max_bad_steps=2: rollback, data window skipped), batch 9 gives a loss
x1000 (a spike: rollback, window skipped). Batches are counted in the data stream, so after a
rollback the bad data stays bad, as real bad data would; G = 4 sequences per global batch.

What "a skipped step leaves no trace" means here, precisely: the weights and optimizer state
after the skipped step are bit-identical to those before it, and the next step's logged loss is
the loss of those unchanged weights on the next global batch of the stream (computed here, in
this process, from the checkpoint); after a rollback the same holds with the batch after the
skipped window.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (REPO, TINY, WORKERS, _env, launcher_cmd, losses, losses_so_far, metrics,
                     rank_pid, run, spawn, tail, tiny_prepared, train, wait_for)
from llama_train.checkpoint import find_latest, load_consolidated, read_state

FAULTS = "nan:batch=3;nan:batch=6;nan:batch=7;loss_scale:batch=9,factor=1000"
STEPS = 10
SCENARIO = [f"trainer.max_steps={STEPS}", "trainer.save_every=1", "trainer.keep_last=50",
            "recovery.max_bad_steps=2", "recovery.spike_factor=3",
            "recovery.spike_warmup_steps=2"]
G = 4  # 2 ranks x micro batch 2
WINDOWS = [[5 * G, 7 * G], [8 * G, 9 * G]]  # batches 6-7 (NaN streak) and 9 (spike)
TOL = 2e-4  # ZeRO-0 vs ZeRO-2: only the order of float sums differs (see test_launcher_runs.py)


def _ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def _ckpt_tensors(path: Path) -> dict:
    """Every tensor DeepSpeed saved (weights, fp32 partitions, Adam moments and step counts)."""
    from llama_train.engine import restricted_loads

    flat = {}

    def walk(prefix, obj):
        if torch.is_tensor(obj):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)

    with restricted_loads():
        for f in sorted((path / "ds").glob("*.pt")):
            walk(f.name, torch.load(f, map_location="cpu"))
    return flat


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def prepared():
    """The tiny config and its prepared data (what the launched runs train on)."""
    return tiny_prepared()


def _batch_loss(prepared, ckpt: Path, batch: int) -> float:
    """Loss of the checkpoint's weights on global batch `batch` (1-based) of the data stream,
    averaged over the two ranks' micro-batches exactly as the training loop does."""
    from llama_train.data import TrainLoader
    from llama_train.model import Transformer

    cfg, prep = prepared
    args, sd, _ = load_consolidated(str(ckpt))
    model = Transformer(args)
    model.load_state_dict(sd)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (OMP_NUM_THREADS=1)
    total = 0.0
    try:
        for rank in range(2):
            loader = TrainLoader(prep.dir, seq_len=64, global_batch=G, micro_batch=2,
                                 dp_rank=rank, dp_world=2, seed=cfg.data.seed, num_workers=0)
            loader.load_state_dict({**loader.state_dict(), "consumed_samples": (batch - 1) * G})
            x, y = next(iter(loader))
            with torch.no_grad():
                total += model(x, y)[1].double().item()
    finally:
        torch.set_num_threads(threads)
    return total / 2


@pytest.fixture(scope="module")
def reference(runs):
    """ZeRO-2, the scenario, uninterrupted: what every faulted run must reproduce."""
    out = runs / "reference"
    train(out, ["deepspeed.zero_stage=2", *SCENARIO], env={"LLAMA_TRAIN_FAULTS": FAULTS})
    return out


# ------------------------------------------------------------------------------------------------
# 3. Non-finite loss or gradients, streaks, spikes: skipped, rolled back, logged


def _check_scenario(out: Path, prepared) -> None:
    rows = metrics(out)
    steps = [r for r in rows if "loss" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), "one loss line per step"
    by_step = {r["step"]: r for r in steps}
    assert by_step[3]["loss"] == "nan" and by_step[6]["loss"] == "nan"
    assert [by_step[s]["skipped_steps"] for s in (2, 3, 5, 6, STEPS)] == [0, 1, 1, 2, 3]
    events = [(r["step"], r["event"]) for r in rows
              if r.get("event") not in (None, "checkpoint")]
    assert events == [(3, "skipped_step"), (6, "skipped_step"), (7, "skipped_step"),
                      (7, "rollback"), (7, "data_skipped"), (8, "spike"), (8, "rollback"),
                      (8, "data_skipped")], events
    rollbacks = [r for r in rows if r.get("event") == "rollback"]
    assert [(r["to_step"], r["skip_window"], r["reason"]) for r in rollbacks] == [
        (6, WINDOWS[0], "skipped_step"), (7, WINDOWS[1], "spike")]
    state = read_state(_ckpt(out, STEPS))
    assert (state["skipped_steps"], state["rollbacks"], state["skip_windows"]) == (3, 2, WINDOWS)
    assert state["data"]["consumed_samples"] == (STEPS + 2) * G  # batches 7 and 9 skipped

    # a skipped step changes nothing: weights, fp32 master copy, Adam moments, step counts
    assert _same(_ckpt_tensors(_ckpt(out, 2)), _ckpt_tensors(_ckpt(out, 3)))
    assert _same(_ckpt_tensors(_ckpt(out, 5)), _ckpt_tensors(_ckpt(out, 6)))
    # the next step's loss is that of the unchanged weights on the next batch of the stream:
    # step 4 reads batch 4 with the weights of step 2; after the first rollback (to step 6)
    # step 7 reads batch 8 (6-7 skipped); after the spike (rolled back to step 7) step 8 reads
    # batch 10 (9 skipped), step 9 batch 11
    loss = {s: r["loss"] for s, r in by_step.items()}
    for step, ckpt_step, batch in [(4, 3, 4), (7, 6, 8), (8, 7, 10), (9, 8, 11)]:
        assert abs(loss[step] - _batch_loss(prepared, _ckpt(out, ckpt_step), batch)) < 1e-6, step
    # and not the loss on the skipped batch (the check can tell them apart)
    assert abs(loss[7] - _batch_loss(prepared, _ckpt(out, 6), 7)) > 1e-3


@pytest.mark.slow
def test_zero2_skips_nonfinite_steps_and_rolls_back(reference, prepared):
    _check_scenario(reference, prepared)
    log = (reference.parent / "reference-train.log").read_text()
    assert "OVERFLOW! Skipping step" in log  # ZeRO>=1: DeepSpeed's own check did the skipping
    assert "process group up: 2 ranks over gloo" in log


@pytest.mark.slow
def test_zero0_same_scenario_with_wandb_offline(reference, runs, prepared):
    """ZeRO-0 skips by hand (its optimizer step is made a no-op); the run is logged to W&B."""
    out = runs / "zero0"
    train(out, ["deepspeed.zero_stage=0", *SCENARIO, "tracking.wandb.mode=offline",
                "tracking.wandb.project=ci"], env={"LLAMA_TRAIN_FAULTS": FAULTS})
    _check_scenario(out, prepared)
    a, b = losses(out), losses(reference)
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] == "nan" or abs(a[k] - b[k]) < TOL for k in a), (a, b)
    run_dir, = (out / "wandb").glob("offline-run-*")
    data = next(run_dir.glob("*.wandb")).read_bytes()
    for key in (b"event/skipped_step", b"event/spike", b"event/rollback", b"skipped_steps"):
        assert key in data, key


def test_fault_guard_and_skip_windows():
    """The decisions in isolation, incl. a rollback target saved *inside* the bad window (the
    stream must jump from 24 to 28 when the window is [20, 28))."""
    from llama_train.config import RecoveryConfig
    from llama_train.job.recovery import Recovery
    from llama_train.job.trainer import TrainState

    class Events:
        def __init__(self):
            self.seen = []

        def event(self, step, name, **fields):
            self.seen.append((step, name, fields))

    state, events = TrainState(), Events()
    r = Recovery(RecoveryConfig(spike_factor=3.0, spike_warmup_steps=2, max_bad_steps=2), state,
                 events)
    assert r.judge(1, 7.0, True, False, 0, 1) is None and state.loss_ema == 7.0
    v = r.judge(2, 7.0, False, True, 4, 2)
    assert v == "skipped_step" and not r.must_roll_back(v)
    v = r.judge(3, 7.0, False, True, 8, 3)
    assert v == "skipped_step" and r.must_roll_back(v)
    assert state.streak_start == 4 and state.loss_ema == 7.0  # bad steps never move the mean
    assert state.skipped_steps == 2 and [e[1] for e in events.seen] == ["skipped_step"] * 2
    again = TrainState()
    again.load_state_dict(state.state_dict())
    assert again == state
    state.step = 3

    def restore(path):  # what the trainer does: the checkpoint's own state comes back
        state.load_state_dict({"step": 2, "tokens": 8, "fault": {"loss_ema": 6.5}})

    r.roll_back("skipped_step", 12, Path("ckpt"), restore, save_every=1)
    assert (state.step, state.bad_streak, state.loss_ema) == (2, 0, 6.5)
    assert (state.rollbacks, state.skipped_steps, state.skip_windows) == (1, 2, [[4, 12]])
    assert events.seen[-1][1] == "rollback" and events.seen[-1][2]["skip_window"] == [4, 12]
    assert r.judge(3, 25.0, True, False, 8, 3) == "spike"  # 25 > 3 x 6.5, past the warmup
    assert r.judge(4, 1.0, True, True, 8, 4) == "nonfinite_applied"  # applied although NaN
    state.skip_windows = [[32, 36], [20, 28], [28, 32]]
    assert r.skip_bad_windows(24, 5) == 36 and events.seen[-1][2]["window"] == [24, 36]
    assert r.skip_bad_windows(36, 5) is None
    with pytest.raises(Exception, match="no checkpoint yet"):
        r.roll_back("spike", 40, None, restore, save_every=100)


# ------------------------------------------------------------------------------------------------
# 1. kill -9 anywhere, N times in a row


@pytest.mark.slow
def test_kill_9_drill(reference, runs):
    """launch/fault_inject.py: 3 SIGKILLs of the whole job (in steps and in saves), each
    followed by a resume, then to the end: bit-identical weights and per-step losses. The drill
    runs forked from the warm parent, and so do the jobs it launches and kills
    (tests/warm_ranks.py: each a session of its own, SIGKILLed as a process group)."""
    work = runs / "drill"
    run([sys.executable, str(REPO / "launch" / "fault_inject.py"), "--trials", "3",
         "--workdir", str(work), "--reference", str(reference), "--seed", "1", "--timeout",
         "300", "--", *TINY, "deepspeed.zero_stage=2", *SCENARIO],
        runs / "drill.log", timeout=900, env={"LLAMA_TRAIN_FAULTS": FAULTS}, warm=True)
    report = json.loads((work / "report.json").read_text())
    assert report["identical"] and report["trials"] == 3 and report["kills_missed"] == 0
    assert report["kills_in_save"] >= 1 and report["kills_in_step"] >= 1
    assert report["partial_saves_left_by_kills"] >= 1  # a kill did cut a save in half
    assert report["comparison"]["weights_identical"] and report["comparison"]["tensors"] > 0


# ------------------------------------------------------------------------------------------------
# 2 + 4 + 6: one rank dies, then a disk fills up during a save, then a tampered checkpoint


@pytest.mark.slow
def test_rank_death_then_disk_full_then_tampered_checkpoint(reference, runs):
    out = runs / "chain"
    out.mkdir()
    env = {"LLAMA_TRAIN_FAULTS": FAULTS}

    # -- rank 1 is SIGKILLed mid-run: the whole job exits non-zero, promptly, naming rank 1 ------
    log1 = runs / "chain-1-rank-killed.log"
    with spawn(launcher_cmd([*TINY, f"trainer.output_dir={out}", "deepspeed.zero_stage=2",
                             *SCENARIO]), log1, env, warm=True) as proc:
        assert wait_for(lambda: max(losses_so_far(out), default=0) >= 4, 240, 0.02), tail(log1)
        pid = rank_pid(proc.pid, 1)
        assert pid is not None, f"no rank 1 under launcher {proc.pid}"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=120)
        seconds = time.monotonic() - t0
    text = log1.read_text()
    print(f"rank 1 SIGKILLed: job exited {rc} after {seconds:.1f}s")
    assert rc != 0 and seconds < 60, (rc, seconds)
    assert "rank 0 lost contact with the job" in text and "rank(s) 1 died or hung" in text, \
        tail(log1)
    killed_at, _ = find_latest(out / "checkpoints")
    k = int(killed_at.name.split("_")[1])
    assert 3 <= k <= STEPS - 2, k

    # -- the next launch resumes from it; the disk fills up on rank 1 in the save of step k+2 ---
    log2 = runs / "chain-2-disk-full.log"
    fault = f"{FAULTS};save_error:step={k + 2},rank=1,errno=ENOSPC"
    with spawn(launcher_cmd([*TINY, f"trainer.output_dir={out}", "deepspeed.zero_stage=2",
                             *SCENARIO]), log2, {"LLAMA_TRAIN_FAULTS": fault}, warm=True) as proc:
        rc = proc.wait(timeout=300)
    text = log2.read_text()
    assert rc == 3, tail(log2)  # every rank: CheckpointError -> exit 3
    failed = _ckpt(out, k + 2)
    assert f"saving checkpoint {failed} failed (rank 1: OSError: [Errno 28] No space left on " \
           f"device: '{out}/checkpoints/.tmp-step_{k + 2:08d}/ds/zero_pp_rank_1" in text, tail(log2)
    assert "Traceback" not in text
    resumed = [r for r in metrics(out) if r.get("event") == "resume"]
    assert resumed[-1]["checkpoint"] == str(killed_at)
    assert not list((out / "checkpoints").glob(".tmp-step_*"))
    assert not failed.exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{k + 1:08d}"
    assert find_latest(out / "checkpoints")[0] == _ckpt(out, k + 1)

    # -- the newest checkpoint is tampered (same size, a pickle that runs code): refused by its
    #    sha256 before anything unpickles it; the run resumes from the one before and finishes
    #    exactly as the uninterrupted run did
    from workers.fault_ckpt_worker import tamper

    marker = runs / "PAYLOAD_RAN"
    tamper(_ckpt(out, k + 1) / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", marker)
    train(out, ["deepspeed.zero_stage=2", *SCENARIO], env=env, log_name="3-tampered.log")
    text = (runs / "chain-3-tampered.log").read_text()
    assert f"skipping checkpoint {_ckpt(out, k + 1)}" in text and "sha256" in text
    assert not marker.exists()
    resumed = [r for r in metrics(out) if r.get("event") == "resume"]
    assert resumed[-1]["checkpoint"] == str(_ckpt(out, k))
    assert losses(out) == losses(reference)
    _, sa, _ = load_consolidated(str(out / "checkpoints"))
    _, sb, _ = load_consolidated(str(reference / "checkpoints"))
    assert _same(sa, sb)


# ------------------------------------------------------------------------------------------------
# 4 + 6 in one process: save failures (injected; a real full tmpfs and a read-only bind mount
# where this machine lets us mount) and tampered files, on a real DeepSpeed engine


@pytest.fixture(scope="module")
def ckpt_faults(tmp_path_factory):
    from helpers import free_port

    work = tmp_path_factory.mktemp("ckpt_faults")
    proc = subprocess.run([sys.executable, str(WORKERS / "fault_ckpt_worker.py"),
                           str(work), str(free_port())], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    for m in (work / "tmpfs", work / "readonly"):  # never leave a mount behind
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _failed_cleanly(r: dict, cause: str, path: str) -> None:
    assert r["path"] is None and cause in r["error"] and path in r["error"], r
    assert "earlier checkpoints are intact" in r["error"]
    assert r["tmp_left"] == [], r


@pytest.mark.slow
def test_save_failures_leave_previous_checkpoints_resumable(ckpt_faults):
    r = ckpt_faults
    assert r["first_save"]["error"] is None and r["first_save"]["latest"] == "step_00000001"
    _failed_cleanly(r["erofs_mkdir"], "Read-only file system", ".tmp-step_00000002")
    _failed_cleanly(r["enospc_deepspeed_write"], "No space left on device",
                    ".tmp-step_00000002/ds/mp_rank_00_model_states.pt")
    _failed_cleanly(r["enospc_rank_file"], "No space left on device",
                    ".tmp-step_00000002/ranks/rank_00000.pt")
    for case in ("erofs_mkdir", "enospc_deepspeed_write", "enospc_rank_file"):
        assert r[case]["latest"] == "step_00000001" and r[case]["complete"] == ["step_00000001"]
    assert r["injected_resume_exact"]


@pytest.mark.slow
def test_real_full_disk(ckpt_faults):
    r = ckpt_faults["tmpfs"]
    if r["skipped"]:
        pytest.skip(f"cannot mount a tmpfs here: {r['skipped']}")
    assert r["first"]["error"] is None
    _failed_cleanly(r["second"], "the disk is full", ".tmp-step_00000003")
    assert r["second"]["latest"] == "step_00000002" and r["resume_exact"]


@pytest.mark.slow
def test_read_only_output_dir(ckpt_faults):
    r = ckpt_faults["readonly"]
    if r["skipped"]:
        pytest.skip(f"cannot make a read-only bind mount here: {r['skipped']}")
    assert "trainer.output_dir=" in r["preflight"] and "Read-only file system" in r["preflight"]
    _failed_cleanly(r["save"], "Read-only file system", ".tmp-step_00000004")
    assert r["resume_exact"]


@pytest.mark.slow
def test_tampered_file_is_never_unpickled(ckpt_faults):
    r = ckpt_faults
    assert r["payload_runs_with_plain_pickle"]  # the payload is live: the checks below matter
    assert "sha256" in r["tampered_verify"]
    assert "trainer.resume=" in r["tampered_explicit_resume"] and "sha256" in \
        r["tampered_explicit_resume"]
    assert not r["payload_ran_after_verify"]
    # checksums off: DeepSpeed's own load goes through the restricted unpickler and refuses
    assert "UnpicklingError" in r["tampered_unchecked_load"]
    assert not r["payload_ran_after_restricted_load"]


# ------------------------------------------------------------------------------------------------
# 5. Bad data (and an unwritable output dir): refused before the process group, naming the fix


@pytest.fixture(scope="module")
def bad_inputs(prepared, tmp_path_factory):
    """name -> (overrides, text the error must contain)."""
    from llama_train.data import builtin_corpus, train_tokenizer

    _, prep = prepared
    root = tmp_path_factory.mktemp("bad_data")

    def copy(name):
        d = root / name
        shutil.copytree(prep.dir, d)
        return d

    cases = {}
    d = copy("truncated")
    shard = d / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    cases["truncated shard"] = ([f"data.prepared_dir={d}"], "train-00000.bin is truncated")
    d = copy("flipped")
    shard = d / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF
    shard.write_bytes(bytes(data))
    cases["same-size corruption, data.verify=true"] = (
        [f"data.prepared_dir={d}", "data.verify=true"], "fails its sha256")
    d = copy("corrupt_meta")
    (d / "meta.json").write_text((d / "meta.json").read_text()[:200])
    cases["corrupt meta.json"] = ([f"data.prepared_dir={d}"], "meta.json is corrupt")
    other = train_tokenizer(builtin_corpus()[:300], 1024, root / "other")
    d = copy("other_tokenizer_file")
    shutil.copyfile(other, d / "tokenizer.model")
    cases["tokenizer.model swapped"] = ([f"data.prepared_dir={d}"],
                                        "is not the tokenizer that encoded the shards")
    d = copy("other_tokenizer_meta")
    meta = json.loads((d / "meta.json").read_text())
    from llama_train.data.tokenizer import file_sha256

    meta["vocab_size"] = meta["tokenizer"]["vocab_size"] = 1024
    meta["tokenizer"]["sha256"] = file_sha256(other)
    (d / "meta.json").write_text(json.dumps(meta))
    cases["meta.json from another tokenizer"] = ([f"data.prepared_dir={d}"], "model.vocab_size")
    cases["data.tokenizer of another vocab size"] = ([f"data.tokenizer={other}"],
                                                     "model.vocab_size")
    empty = root / "empty_files"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("")
    cases["empty .txt files"] = ([f"data.source={empty}", f"data.tokenizer={prep.tokenizer_path}",
                                  f"data.prepared_dir={root / 'empty_prep'}"], "no documents")
    blank = root / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": "   "}\n')
    cases["a .jsonl of empty texts"] = ([f"data.source={blank}",
                                         f"data.tokenizer={prep.tokenizer_path}",
                                         f"data.prepared_dir={root / 'blank_prep'}"], "blank.jsonl")
    blocker = root / "a_file"
    blocker.write_text("not a directory")
    cases["output_dir not writable"] = ([f"trainer.output_dir={blocker}/out"], "trainer.output_dir")
    return root, cases


BAD_DATA = ["truncated shard", "same-size corruption, data.verify=true", "corrupt meta.json",
            "tokenizer.model swapped", "meta.json from another tokenizer",
            "data.tokenizer of another vocab size", "empty .txt files", "a .jsonl of empty texts",
            "output_dir not writable"]


@pytest.mark.parametrize("case", BAD_DATA)
@pytest.mark.slow
def test_bad_data_is_refused_before_the_process_group(case, bad_inputs, monkeypatch):
    import torch.distributed as dist

    from llama_train.errors import BadInput
    from llama_train.job.preflight import preflight
    from helpers import compose_cfg

    root, cases = bad_inputs
    overrides, needle = cases[case]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = compose_cfg([*TINY, f"trainer.output_dir={root}/out", *overrides])
    with pytest.raises(BadInput) as err:  # exit 2 with one line (a bare ValueError: a bug)
        preflight(cfg)
    assert needle in str(err.value), str(err.value)
    assert not dist.is_initialized()


@pytest.mark.slow
def test_launched_job_refuses_truncated_data(bad_inputs, runs):
    """Through the launcher: both ranks exit 2 with the message, before any process group."""
    root, cases = bad_inputs
    overrides, needle = cases["truncated shard"]
    out = runs / "bad_data_job"
    rc = train(out, overrides, check=False, timeout=120, launcher=True)  # deepspeed's exit
    text = (runs / "bad_data_job-train.log").read_text()
    assert rc == 2, tail(runs / "bad_data_job-train.log")
    assert "llama-train: error:" in text and needle in text and "delete" in text
    assert "Traceback" not in text and "process group up" not in text
    assert not (out / "checkpoints" / "latest").exists()


def test_out_of_range_token_ids_never_reach_the_model(prepared):
    """The training loop's last guard, for token ids no checksum covers (a shard changed on
    disk is refused by its checksum first: tests/data/test_data_loader.py): a batch with ids outside
    the vocabulary is refused before the forward pass."""
    import torch

    from llama_train.data import DataError, TrainLoader
    from llama_train.job.train_module import check_token_ids

    cfg, prep = prepared
    x = torch.full((2, 64), 65535, dtype=torch.long)  # what a shard of 0xff bytes would give
    with pytest.raises(DataError, match=r"outside \[0, model.vocab_size=2048\).*data.verify=true"):
        check_token_ids(x, x, cfg.model.vocab_size, prep.dir, 0)
    good = TrainLoader(prep.dir, seq_len=64, global_batch=G, micro_batch=2, num_workers=0)
    check_token_ids(*next(iter(good)), cfg.model.vocab_size, prep.dir, 0)  # no error


def test_fault_spec_errors():
    from llama_train.job.faults import FaultPlan, FaultSpecError

    plan = FaultPlan.parse("loss_scale:batch=9,factor=1000;save_error:step=4,rank=1,errno=EROFS;"
                           "nan:batch=3;nan:batch=6;exit:step=5,rank=1")
    assert plan.loss_factor(9) == 1000 and plan.loss_factor(8) == 1.0
    assert plan.save_errors[0].errno == 30 and plan.save_errors[0].rank == 1
    assert plan.nan_batches == {3, 6}
    assert (plan.exits[0].step, plan.exits[0].rank, plan.exits[0].code) == (5, 1, 17)
    hangs = FaultPlan.parse("hang:step=4,rank=1;hang:step=2,seconds=0.5").hangs
    assert [(h.step, h.rank, h.seconds) for h in hangs] == [(4, 1, float("inf")), (2, 0, 0.5)]
    for bad, needle in [("loss_scale:factor=2", "batch"), ("explode:step=1", "unknown fault"),
                        ("hang:rank=1", "step"), ("hang:step=3,seconds=soon", "hang:step=3"),
                        ("save_error:step=1,errno=EWHAT", "EWHAT"), ("save_error:step", "kind:"),
                        ("nan:batch=x", "nan:batch=x"), ("exit:rank=1", "step")]:
        with pytest.raises(FaultSpecError, match=needle):
            FaultPlan.parse(bad)


def test_fault_injector_hook():
    """The injection is one hook: NaN and spikes on data-stream batches, on the ranks asked."""
    from llama_train.job.faults import FaultInjector, FaultPlan

    hook = FaultInjector(FaultPlan.parse("nan:batch=3;loss_scale:batch=4,factor=10"), rank=0)
    one = torch.tensor(1.0)
    assert torch.isnan(hook.on_loss(3, one)) and hook.on_loss(4, one).item() == 10.0
    assert hook.on_loss(5, one) is one
    hook.on_step_begin(5)  # exit faults for other steps/ranks do nothing
    FaultInjector(FaultPlan.parse("exit:step=2,rank=1"), rank=0).on_step_begin(2)
    # a hang stops the loop for its seconds, on its rank and step only
    hang = FaultInjector(FaultPlan.parse("hang:step=2,rank=0,seconds=0.3"), rank=0)
    t0 = time.monotonic()
    hang.on_step_begin(1)
    FaultInjector(FaultPlan.parse("hang:step=2,rank=1"), rank=0).on_step_begin(2)
    assert time.monotonic() - t0 < 0.2
    hang.on_step_begin(2)
    assert time.monotonic() - t0 >= 0.3
