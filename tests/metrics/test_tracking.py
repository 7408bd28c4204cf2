"""Tracking: the wall-clock ``time`` of every metrics.jsonl record, TensorBoard event files that
show each step once through resumes and rollbacks, and the one ``wandb sync`` command an offline
W&B run ends with (checked offline: ``wandb sync --dry-run`` parses it and finds every directory).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import BIN, REPO, cfg_for, rows, step_rows
from llama_train.config import TensorBoardConfig, TrackingConfig, WandbConfig
from llama_train.metrics.tracking import Tracker, offline_run_dirs
from llama_train.train import train


pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    """No API key anywhere (environment or ~/.netrc): W&B's mode null resolves to offline."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    return home


def tb_scalars(d: Path) -> dict:
    """{tag: [(step, value), ...]} as TensorBoard's EventAccumulator reads the directory (purges
    applied), in the order it keeps them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(v):
    """A metrics.jsonl value as TensorBoard stores it (float32; NaN written as "nan")."""
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        v = float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    x = float(np.float32(v))
    return "nan" if math.isnan(x) else x  # NaN != NaN: compare a stand-in


def expected_scalars(records) -> dict:
    """What TensorBoard must hold for these metrics.jsonl records: every numeric field against
    its step; events as ``event/<name>`` = 1 and ``event/<name>/<field>`` (W&B's tags)."""
    want: dict = {}
    for r in records:
        if "event" in r:
            items = [(f"event/{r['event']}", 1.0)] + [
                (f"event/{r['event']}/{k}", v) for k, v in r.items()
                if k not in ("step", "time", "event")]
        else:
            items = [(k, v) for k, v in r.items() if k not in ("step", "time")]
        for tag, v in items:
            x = _f32(v)
            if x is not None:
                want.setdefault(tag, []).append((r["step"], x))
    return want


def assert_tensorboard_matches(tb_dir: Path, records) -> dict:
    got = {tag: [(s, "nan" if math.isnan(v) else v) for s, v in pts]
           for tag, pts in tb_scalars(tb_dir).items()}
    want = expected_scalars(records)
    assert sorted(got) == sorted(want)
    for tag in want:  # sorted: events may come back in another order than the file's
        assert sorted(got[tag], key=str) == sorted(want[tag], key=str), tag
    loss_steps = [s for s, _ in got["loss"]]
    assert loss_steps == sorted(set(loss_steps)), f"a step twice or going back: {loss_steps}"
    return got


def _cfg(tensorboard: bool = False, mode="disabled", **wandb) -> TrackingConfig:
    return TrackingConfig(wandb=WandbConfig(mode=mode, **wandb),
                          tensorboard=TensorBoardConfig(enabled=tensorboard))


# ------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_every_record_has_its_wall_clock_time(tmp_path):
    """Steps and events alike carry unix seconds, so throughput can be recomputed from the file."""
    t = Tracker(_cfg(), str(tmp_path), rank=0)
    t.start()
    t0 = time.time()
    t.log(1, {"loss": 3.0, "tokens": 256})
    t.log(1, {"val_loss": 3.1, "val_ppl": 22.2})
    t.event(1, "checkpoint", path="ckpt", seconds=0.25)
    t1 = time.time()
    t.finish()
    records = rows(tmp_path)
    assert len(records) == 3
    for r in records:
        assert isinstance(r["time"], float) and t0 - 0.01 <= r["time"] <= t1 + 0.01, r
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)


def test_other_ranks_write_nothing(tmp_path):
    """Every rank calls the tracker; only rank 0 may write, or files would get lines twice."""
    t = Tracker(_cfg(tensorboard=True), str(tmp_path), rank=1)
    t.start()
    t.log(1, {"loss": 3.0})
    t.event(1, "checkpoint", path="x")
    t.finish()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


# ------------------------------------------------------------------------------------------------
# TensorBoard


def test_tracking_tensorboard_preset_composes(tmp_path):
    """``tracking=tensorboard``: TensorBoard on, W&B off, the directory under the run."""
    from hydra import compose, initialize_config_dir

    from llama_train.config import load_config
    from llama_train.paths import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = load_config(compose("config", overrides=["tracking=tensorboard",
                                                       f"trainer.output_dir={tmp_path}"]))
    assert cfg.tracking.tensorboard.enabled and cfg.tracking.wandb.mode == "disabled"
    t = Tracker(cfg.tracking, cfg.trainer.output_dir, rank=0)
    assert t.tb_dir == tmp_path / "tensorboard" and t.mode == "disabled"


def test_tensorboard_resume_and_rollback_leave_one_value_per_step(tmp_path):
    """A run logs steps 1-6 (checkpoint at 4) and dies; the resumed one redoes 5-8 with other
    values, saving at 6, and rolls back from a spike at 7 to 6. TensorBoard must end with the
    values metrics.jsonl ends with, each step once, the spike and the rollback on record."""
    cfg = _cfg(tensorboard=True)
    a = Tracker(cfg, str(tmp_path), rank=0)
    a.start()
    for s in range(1, 5):
        a.log(s, {"loss": 10.0 - s, "lr": 0.1 * s})
    at_4 = a.state_dict()
    a.event(4, "checkpoint", path="c4", seconds=0.5)
    for s in (5, 6):
        a.log(s, {"loss": 100.0 + s, "lr": 0.1 * s})  # lost with the run that died
    a.finish()  # its events reached the disk: the worst case for a resume

    b = Tracker(cfg, str(tmp_path), rank=0)
    b.load_state_dict(at_4)
    b.start(resume_step=4, checkpoint="c4")
    b.event(4, "resume", checkpoint="c4")
    for s in (5, 6):
        b.log(s, {"loss": 20.0 - s, "lr": 0.1 * s})
    at_6 = b.state_dict()
    b.event(6, "checkpoint", path="c6", seconds=0.5)
    b.log(7, {"loss": 99.0, "lr": 0.7})
    b.event(7, "spike", step_loss=99.0, bad_streak=1)
    b.rewind(at_6["metrics_lines"], 6)
    b.event(7, "rollback", to_step=6, reason="spike")
    for s in (7, 8):
        b.log(s, {"loss": 20.0 - s, "lr": 0.1 * s})
    b.finish()

    records = rows(tmp_path)
    assert {s: r["loss"] for s, r in step_rows(tmp_path).items()} == \
        {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0, 5: 15.0, 6: 14.0, 7: 13.0, 8: 12.0}
    got = assert_tensorboard_matches(tmp_path / "tensorboard", records)
    assert got["loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 15.0), (6, 14.0),
                           (7, 13.0), (8, 12.0)]
    assert got["event/spike"] == [(7, 1.0)] and got["event/rollback/to_step"] == [(7, 6.0)]
    assert got["event/checkpoint"] == [(4, 1.0), (6, 1.0)]


def test_tensorboard_fresh_start_hides_an_earlier_start(tmp_path):
    """A run that died before its first checkpoint starts again from step 1 (metrics.jsonl is
    started afresh): TensorBoard must not keep the dead start's points either."""
    cfg = _cfg(tensorboard=True)
    a = Tracker(cfg, str(tmp_path), rank=0)
    a.start()
    for s in (1, 2, 3):
        a.log(s, {"loss": 50.0 + s})
    a.finish()
    b = Tracker(cfg, str(tmp_path), rank=0)
    b.start()
    for s in (1, 2):
        b.log(s, {"loss": 5.0 - s})
    b.finish()
    assert tb_scalars(tmp_path / "tensorboard")["loss"] == [(1, 4.0), (2, 3.0)]


@pytest.mark.slow
def test_tensorboard_in_a_training_run_through_rollback_and_resume(tmp_path, monkeypatch):
    """The real loop, in this process: batches 5 and 6 are NaN, so the run rolls back to step
    4 and skips them; it stops at 6 with a checkpoint. That checkpoint is then lost (as if the
    job died before saving it), and the resumed run, with another learning rate, redoes steps
    5-8 from step 4 (the NaN batches and the rollback again). TensorBoard's event files, read
    back, hold what metrics.jsonl holds: each step once, with the values of the run that went
    on."""
    monkeypatch.setenv("LLAMA_TRAIN_FAULTS", "nan:batch=5;nan:batch=6")
    out = tmp_path / "tb_run"
    args = ["trainer.max_steps=8", "trainer.save_every=4", "trainer.keep_last=20",
            "recovery.max_bad_steps=2", "tracking.tensorboard.enabled=true"]
    train(cfg_for(out, *args, "trainer.steps_this_run=6"))
    first = step_rows(out)
    assert sorted(first) == [1, 2, 3, 4, 5, 6]
    # throughput, recomputed from two records' time and tokens: the same order of magnitude (a
    # factor such as the world size or the accumulation would be off by 2x or more); steps of
    # ~50 ms on a loaded machine are too noisy for a closer match (4655 vs 4217 tok/s was seen)
    for a, b in ((2, 3), (3, 4)):
        rate = (first[b]["tokens"] - first[a]["tokens"]) / (first[b]["time"] - first[a]["time"])
        assert rate == pytest.approx(first[b]["tokens_per_s"], rel=0.4)
    assert_tensorboard_matches(out / "tensorboard", rows(out))

    shutil.rmtree(out / "checkpoints" / "step_00000006")
    train(cfg_for(out, *args, "optim.lr=1e-3", "trainer.allow_config_change=[optim.lr]"))
    records = rows(out)
    logged = step_rows(out)
    assert sorted(logged) == list(range(1, 9))
    assert [r["event"] for r in records if r.get("event") == "resume"] == ["resume"]
    assert all(logged[s]["loss"] == first[s]["loss"] for s in (1, 2, 3, 4))
    # another lr from step 5 on: other values at 5 and 6 than the first run logged there
    assert all(logged[s]["lr"] != first[s]["lr"] for s in (5, 6))
    assert logged[6]["loss"] != first[6]["loss"]
    got = assert_tensorboard_matches(out / "tensorboard", records)
    assert [s for s, _ in got["loss"]] == list(range(1, 9))
    assert [s for s, _ in got["event/rollback"]] == [6]  # the resumed run's own
    # every record, events too, has a wall-clock time that never goes back within one start
    assert all(isinstance(r["time"], float) for r in records)
    resume_at = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    later = [r["time"] for r in records[resume_at:]]
    assert later == sorted(later)


# ------------------------------------------------------------------------------------------------
# W&B offline: one sync command for every directory of the run


@pytest.mark.parametrize("where", [None, "env", "api.wandb.ai", "api.forge.coreweave.com",
                                   "wandb.example.com"])
def test_mode_null_is_online_iff_wandb_would_find_a_key(where, no_wandb_key, monkeypatch):
    """``tracking.wandb.mode: null`` resolves to online only with a key W&B itself would use:
    WANDB_API_KEY, or a .netrc entry for its server; wandb 0.31's ``wandb login`` stores the
    key under api.forge.coreweave.com, its new default, and WANDB_BASE_URL names one's own."""
    from llama_train.metrics.tracking import resolve_wandb_mode

    key = "0123456789abcdef0123456789abcdef01234567"
    if where == "env":
        monkeypatch.setenv("WANDB_API_KEY", key)
    elif where is not None:
        netrc_file = no_wandb_key / ".netrc"
        netrc_file.write_text(f"machine {where}\n  login user\n  password {key}\n")
        netrc_file.chmod(0o600)  # as `wandb login` leaves it
        if where == "wandb.example.com":
            monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert resolve_wandb_mode(None) == ("offline" if where is None else "online")
    assert resolve_wandb_mode("disabled") == "disabled"


def test_wandb_project_and_entity_come_from_the_environment_unless_configured(
        tmp_path, no_wandb_key, monkeypatch, caplog):
    """WANDB_PROJECT / WANDB_ENTITY, as every W&B tool reads them, name where a run goes when
    the config does not (tracking.wandb.project is null by default); the config wins; neither
    set: our project and W&B's default entity. An offline run records what it was given."""
    monkeypatch.setenv("WANDB_PROJECT", "env-project-q7")
    monkeypatch.setenv("WANDB_ENTITY", "env-team-q7")
    caplog.set_level(logging.INFO, logger="llama_train")
    t = Tracker(_cfg(mode="offline"), str(tmp_path / "run"), rank=0)
    t.start()
    # the run W&B made holds them (its offline file is written by W&B's service, asynchronously:
    # read right after finish() it was sometimes only its header, under load)
    assert (t._wandb.project, t._wandb.entity) == ("env-project-q7", "env-team-q7")
    t.log(1, {"loss": 3.0})
    t.finish()
    assert any("project env-project-q7, entity env-team-q7" in r.getMessage()
               for r in caplog.records)
    from llama_train.metrics.tracking import resolve_wandb_target

    assert cfg_for(tmp_path).tracking.wandb.project is None
    given = WandbConfig(mode="offline", project="ci", entity="team")
    assert resolve_wandb_target(given) == ("ci", "team")
    monkeypatch.delenv("WANDB_PROJECT")
    monkeypatch.delenv("WANDB_ENTITY")
    assert resolve_wandb_target(WandbConfig()) == ("llama_train", None)


def _dry_run(command: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    """The printed command with --dry-run added: wandb parses it and lists what it would
    upload, without an API key or the network."""
    argv = shlex.split(command)
    assert argv[:2] == ["wandb", "sync"], argv
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(home)
    return subprocess.run([str(BIN / "wandb"), "sync", "--dry-run", *argv[2:]], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def test_offline_run_ends_with_one_sync_command_for_all_its_directories(
        tmp_path, no_wandb_key, caplog):
    """No API key: W&B runs offline. A start and a resume write two offline directories of one
    run id; finish() names both and prints one ``wandb sync`` command that wandb 0.31 accepts
    and that selects exactly these two (a path with a space in it stays one argument)."""
    caplog.set_level(logging.INFO, logger="llama_train")
    out = tmp_path / "run dir"
    cfg = _cfg(mode=None, project="ci")
    a = Tracker(cfg, str(out), rank=0)
    assert a.mode == "offline"
    a.start()
    a.log(1, {"loss": 3.0})
    state = a.state_dict()
    a.finish()
    b = Tracker(cfg, str(out), rank=0)
    b.load_state_dict(state)
    b.start(resume_step=1)
    b.log(2, {"loss": 2.5})
    b.finish()

    run_id = state["wandb_run_id"]
    dirs = offline_run_dirs(out / "wandb", run_id)
    assert len(dirs) == 2 and all(d.name.startswith("offline-run-") for d in dirs)
    said = [r.getMessage() for r in caplog.records if "wandb sync" in r.getMessage()]
    assert len(said) == 2  # one at the end of each start
    assert "no W&B API key" in said[-1] and "2 directories" in said[-1]
    command = said[-1].splitlines()[-1].strip()
    assert shlex.split(command)[2:] == [str(d.resolve()) for d in dirs]
    assert "1 directory; each resume adds another" in said[0]

    other = tmp_path / "elsewhere"  # the command works from any directory
    other.mkdir()
    res = _dry_run(command, other, no_wandb_key)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "Would sync 2 run(s)" in text, text
    for d in dirs:
        assert f"{d.name}/run-{run_id}.wandb" in text, text


@pytest.mark.slow
def test_offline_run_that_fails_still_says_how_to_sync(tmp_path, no_wandb_key):
    """An error after W&B started: the process still prints the command (at exit), and W&B's
    own exit hook still closes the offline file with what was logged."""
    out = tmp_path / "failed"
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from llama_train.config import TrackingConfig, WandbConfig\n"
        "from llama_train.metrics.tracking import Tracker\n"
        "t = Tracker(TrackingConfig(wandb=WandbConfig(mode='offline', project='ci')), "
        "sys.argv[1], 0)\n"
        "t.start()\n"
        "t.log(1, {'loss': 3.0, 'tokens_per_s': 10.0})\n"
        "raise RuntimeError('boom')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(no_wandb_key)
    res = subprocess.run([sys.executable, "-c", script, str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "RuntimeError: boom" in res.stderr, res.stderr
    assert "stopped before its end" in res.stderr, res.stderr
    command = next(line.strip() for line in res.stderr.splitlines()
                   if line.strip().startswith("wandb sync "))
    d, = offline_run_dirs(out / "wandb", next(iter(
        p.name[len("run-"):-len(".wandb")] for p in (out / "wandb").glob("*/run-*.wandb"))))
    assert shlex.split(command)[2:] == [str(d.resolve())]
    assert b"tokens_per_s" in next(d.glob("run-*.wandb")).read_bytes()
    res = _dry_run(command, tmp_path, no_wandb_key)
    assert res.returncode == 0 and "Would sync 1 run(s)" in res.stdout + res.stderr


@pytest.mark.slow
def test_wandb_offline_continues_same_run_and_never_writes_the_key(tmp_path, monkeypatch, capfd):
    """A training run with W&B offline, stopped at step 12 and resumed: the checkpoint keeps the
    run id, the resume logs to the same run (a second offline directory of that id, both with
    the metrics), and the API key lands in no file and no log line."""
    out = tmp_path / "wandb"
    common = ["trainer.max_steps=24", "trainer.save_every=4", "tracking.wandb.mode=offline",
              "tracking.wandb.project=ci", "trainer.log_every=1"]
    secret = "test-key-5c0a1d9e7b3f48a2a6e0d4c3b2a19f87e6d5c4b3"  # 40 chars, like a real key
    monkeypatch.setenv("WANDB_API_KEY", secret)
    train(cfg_for(out, *common, "trainer.steps_this_run=12"))
    state = json.loads((out / "checkpoints" / "step_00000012" / "trainer_state.json").read_text())
    run_id = state["tracker"]["wandb_run_id"]
    assert run_id
    train(cfg_for(out, *common))
    assert sorted(step_rows(out)) == list(range(1, 25))
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(run_id) for d in run_dirs)
    for d in run_dirs:
        data = (d / f"run-{run_id}.wandb").read_bytes()
        assert b"loss" in data and b"tokens_per_s" in data
    # the API key never lands in a saved config, checkpoint, W&B file or log
    for f in out.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
    logged = capfd.readouterr()
    assert secret not in logged.out + logged.err
