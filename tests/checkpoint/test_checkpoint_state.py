"""What a checkpoint carries of the loop (llama_train.checkpoint.state, .meta): the trainer's
registry of stateful parts writes trainer_state.json and the rank files exactly as the
hand-built dicts before it did (keys, nesting, order: the bytes), and hands each part its entry
back; CheckpointMeta reads the facts of a save as the dict lookups before it did.

No process group, no engine: the trainer's own registration runs on stand-ins for its parts.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llama_train.checkpoint import (CheckpointMeta, Fixed, RngState, StateRegistry, read_state,
                                    rng_state)
from llama_train.job.simulation import NoSimulation, SimulationReport
from llama_train.job.trainer import Trainer, TrainState


class Part:
    """A stand-in for the loader or the tracker: its state, and what it was handed back."""

    def __init__(self, state):
        self.state, self.loaded = state, []

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state, *extra):
        self.loaded.append(state)


def trainer_stub(simulated: bool, fresh: bool = False):
    """What Trainer._register_parts reads of a Trainer (``fresh``: a TrainState at step 0)."""
    state = TrainState() if fresh else TrainState(
        step=8, tokens=2048, skipped_steps=1, rollbacks=1, skip_windows=[[4, 8]], loss_ema=7.5,
        bad_streak=2, streak_start=12)
    loader = Part({"consumed_samples": 32, "seed": 1234, "seq_len": 64, "global_batch": 4,
                   "data_fingerprint": "e82a"})
    tracker = Part({"wandb_run_id": None, "metrics_lines": 9})
    rt = SimpleNamespace(world_size=2, rank=1)
    return SimpleNamespace(
        state=state, loader=loader, tracker=tracker, rt=rt,
        cfg=SimpleNamespace(deepspeed=SimpleNamespace(zero_stage=2),
                            trainer=SimpleNamespace(seq_len=64)),
        plan=SimpleNamespace(global_batch=4),
        # the loop's simulation component, as build_job chooses it (the same rank's rt)
        simulation=SimulationReport(SimpleNamespace(rt=rt)) if simulated else NoSimulation())


def before(t) -> dict:
    """trainer_state.json as Trainer._save and Trainer.save built it by hand before the registry
    (commit 39155e2), for the same parts."""
    extra = ({"simulated": {"ranks": t.rt.world_size, "rank": t.rt.rank}}
             if isinstance(t.simulation, SimulationReport) else {})
    return {**t.state.state_dict(), "data": t.loader.state_dict(),
            "tracker": t.tracker.state_dict(),
            "world_size": t.rt.world_size,
            "zero_stage": t.cfg.deepspeed.zero_stage,
            "global_batch": t.plan.global_batch,
            "seq_len": t.cfg.trainer.seq_len, **extra}


@pytest.mark.parametrize("simulated", [False, True])
def test_the_trainers_registry_writes_the_trainer_state_of_before(simulated):
    t = trainer_stub(simulated)
    Trainer._register_parts(t)
    saved = t.parts.state_dict()
    # as CheckpointManager writes it: the same bytes, so the same keys in the same order
    assert json.dumps(saved, indent=1) == json.dumps(before(t), indent=1)
    assert list(saved) == ["step", "tokens", "skipped_steps", "rollbacks", "skip_windows",
                           "fault", "data", "tracker", "world_size", "zero_stage",
                           "global_batch", "seq_len", *(["simulated"] if simulated else [])]
    assert list(t.rank_parts.state_dict()) == ["rng"]  # ranks/rank_N.pt: {"rng": rng_state()}


def test_the_trainers_registry_hands_each_part_its_entry_back():
    saver = trainer_stub(simulated=False)
    Trainer._register_parts(saver)
    saved = json.loads(json.dumps(saver.parts.state_dict()))  # as read back from the file
    t = trainer_stub(simulated=True, fresh=True)  # a simulated rank may continue a real
    Trainer._register_parts(t)  # checkpoint of its world size: no "simulated" entry to load
    t.parts.load_state_dict(saved)
    assert t.state.state_dict() == {k: saved[k] for k in ("step", "tokens", "skipped_steps",
                                                          "rollbacks", "skip_windows", "fault")}
    assert t.loader.loaded == [saved["data"]]
    assert t.tracker.loaded == []  # loaded back by Trainer.resume (forked or not), not here
    with pytest.raises(KeyError, match="data"):  # as saved["data"] was
        t.parts.load_state_dict({k: v for k, v in saved.items() if k != "data"})


def test_a_registry_refuses_a_name_twice_and_a_key_saved_twice():
    reg = StateRegistry()
    reg.register("train", TrainState(), merged=True)
    with pytest.raises(RuntimeError, match="registered already"):
        reg.register("train", Fixed({}))
    reg.register("run", Fixed({"step": 3}), merged=True, restore=False)
    with pytest.raises(RuntimeError, match="'step'"):
        reg.state_dict()
    assert reg.names() == ["train", "run"]


def test_the_rng_part_round_trips_every_generator():
    part = RngState()
    state = part.state_dict()
    assert set(state) >= {"python", "numpy", "torch"} and state.keys() == rng_state().keys()
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    part.load_state_dict(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def test_checkpoint_meta_reads_what_the_dict_lookups_read(tmp_path):
    t = trainer_stub(simulated=True)
    Trainer._register_parts(t)
    (tmp_path / "trainer_state.json").write_text(json.dumps(t.parts.state_dict(), indent=1))
    meta = CheckpointMeta.read(tmp_path)
    state = read_state(tmp_path)
    assert (meta.world_size, meta.zero_stage, meta.global_batch, meta.step, meta.tokens,
            meta.seq_len, meta.simulated) == (
        state["world_size"], state["zero_stage"], state["global_batch"], state["step"],
        state["tokens"], state["seq_len"], state["simulated"])
    assert CheckpointMeta.of(meta) is meta and CheckpointMeta.of(state) == meta
    with pytest.raises(AttributeError):  # frozen
        meta.step = 1  # type: ignore[misc]
    assert CheckpointMeta.of({"world_size": 1, "zero_stage": 0, "global_batch": 8}).step is None
    with pytest.raises(KeyError, match="global_batch"):  # as state["global_batch"] did
        CheckpointMeta.of({"world_size": 1, "zero_stage": 0})
