"""Resume compatibility has one owner (llama_train.job.resume) and one source of truth: the marks on
the config fields (llama_train.policy). In process, no launcher."""

from __future__ import annotations

import json

import pytest

from helpers import cfg_for, rows, world_of_one
from llama_train import policy
from llama_train.config import ConfigError
from llama_train.job.resume import ResumeRefused, check_resume, config_changes, keys_with, policy_of
from llama_train.train import train

# The keys that may change between launches of one run, as the hand-kept list in config.py had
# them before the policy moved onto the fields, plus the three ZeRO-3 knobs it had left out.
MAY_CHANGE = {
    "trainer.max_steps", "trainer.save_every", "trainer.keep_last", "trainer.log_every",
    "trainer.eval_every", "trainer.eval_sequences", "trainer.micro_batch", "trainer.global_batch",
    "trainer.global_batch_tokens", "trainer.device", "trainer.compile", "trainer.peak_flops",
    "trainer.verify_checksums", "trainer.async_save", "deepspeed.zero_stage", "parallel.sequence",
    "deepspeed.offload_optimizer",
    "deepspeed.offload_params", "deepspeed.overlap_comm", "deepspeed.contiguous_gradients",
    "deepspeed.reduce_bucket_size", "deepspeed.allgather_bucket_size",
    "deepspeed.stage3_prefetch_bucket_size", "deepspeed.stage3_param_persistence_threshold",
    "deepspeed.steps_per_print", "data.name", "data.prepared_dir", "data.num_proc",
    "data.num_workers", "data.verify", "data.shard_tokens", "data.dtype", "data.streaming",
    "data.tokenizer", "data.tokenizer_max_sentences", "data.tokenizer_max_line_bytes",
    "model.activation_checkpointing", "model.loss_chunk_tokens",
    "deepspeed.stage3_max_live_parameters", "deepspeed.stage3_max_reuse_distance",
    "deepspeed.sub_group_size", "deepspeed.extra",
    # ZeRO++ changes who sends what, never the checkpoint (tests/engine/test_zeropp.py)
    "deepspeed.zeropp.hpz_partition_size", "deepspeed.zeropp.quantized_weights",
    "deepspeed.zeropp.quantized_gradients",
}
# float8: FP8 matmuls on or off change the rounding of later steps, not the weights or state
MAY_CHANGE_GROUPS = ("recovery.", "sample.", "tracking.", "comm.", "float8.")
PER_LAUNCH = {"trainer.output_dir", "trainer.resume", "trainer.steps_this_run",
              "trainer.on_existing", "trainer.allow_config_change", "trainer.init_from",
              "trainer.dry_run", "scaling.max_epochs", "scaling.tolerance"}


def test_the_marks_on_the_fields_are_the_policy():
    may = set(keys_with(policy.MAY_CHANGE))
    assert {k for k in may if not k.startswith(MAY_CHANGE_GROUPS)} == MAY_CHANGE
    assert set(keys_with(policy.PER_LAUNCH)) == PER_LAUNCH
    # a mark on a group covers every key under it, nested ones included
    assert policy_of("tracking.wandb.mode") == policy.MAY_CHANGE
    assert policy_of("comm.timeout_s") == policy.MAY_CHANGE
    # unmarked keys and keys the schema lacks define the run
    for key in ("model.dim", "optim.lr", "data.source", "trainer.seed", "deepspeed.precision",
                "trainer.document_mask", "model.not_a_key", "nosuchgroup.x"):
        assert policy_of(key) == policy.DEFINES_RUN, key


def test_every_deepspeed_knob_but_precision_may_change():
    """Buckets, prefetch and partitioning knobs change speed and memory, never the run: a
    resume may change any of them (stage3_max_live_parameters refused one before). Except
    MiCS's shard size: a MiCS checkpoint holds partitions over the shard group, which neither
    plain ZeRO-3 nor the universal conversion reads (config.DeepSpeedConfig.mics_shard_size)."""
    from llama_train.config import config_keys

    ds = [k for k in config_keys() if k.startswith("deepspeed.")]
    assert [k for k in ds if policy_of(k) != policy.MAY_CHANGE] == [
        "deepspeed.mics_shard_size", "deepspeed.precision"]


def _checkpoint(tmp_path, model=None, world_size=2, zero_stage=2, global_batch=8):
    """A checkpoint directory with the files the check reads: config.yaml and its state."""
    from omegaconf import OmegaConf

    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    cfg = {"model": model or {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512},
           "optim": {"lr": 1e-3}, "deepspeed": {"stage3_max_live_parameters": 100}}
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    state = {"world_size": world_size, "zero_stage": zero_stage, "global_batch": global_batch}
    return ckpt, state, cfg


def test_check_resume_lists_a_shape_change_once_and_says_what_goes_ahead(tmp_path):
    ckpt, state, cfg = _checkpoint(tmp_path)
    # a knob that may change, on one rank instead of two: goes ahead, through the universal format
    ours = json.loads(json.dumps(cfg))
    ours["deepspeed"]["stage3_max_live_parameters"] = 200
    check = check_resume(ckpt, state, ours, world_size=1, global_batch=8, allowed=[])
    assert check.changes == {"deepspeed.stage3_max_live_parameters": [100, 200]}
    assert check.universal
    # ZeRO-0 on another world size needs no conversion
    state0 = {**state, "zero_stage": 0}
    assert not check_resume(ckpt, state0, cfg, world_size=1, global_batch=8, allowed=[]).universal

    # a new width: the shape is refused once, as the shape, not again as model.dim
    ours = json.loads(json.dumps(cfg))
    ours["model"]["dim"] = 128
    ours["optim"]["lr"] = 2e-3
    with pytest.raises(ResumeRefused) as e:
        check_resume(ckpt, state, ours, world_size=2, global_batch=8, allowed=[])
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)
    assert "model shape" in msg and "dim=64" in msg and "dim=128" in msg
    assert "model.dim" not in msg
    assert "optim.lr" in msg and "trainer.allow_config_change=[optim.lr]" in msg
    # allowing optim.lr does not allow a new shape or global batch
    with pytest.raises(ResumeRefused, match="global batch"):
        check_resume(ckpt, state, cfg, world_size=2, global_batch=16, allowed=["optim"])


@pytest.mark.slow
def test_a_resume_is_judged_once(tmp_path, monkeypatch):
    """Preflight judges the checkpoint the resume will load; the trainer does not judge it
    again (it re-judges only when that checkpoint failed its checksums meanwhile)."""
    import llama_train.job.resume as resume

    out = tmp_path / "run"
    with world_of_one():
        train(cfg_for(out, "trainer.max_steps=2", "trainer.save_every=2"))
    calls = []
    real = resume.check_resume
    monkeypatch.setattr(resume, "check_resume", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    with world_of_one():
        train(cfg_for(out, "trainer.max_steps=4", "trainer.save_every=2"))
    assert calls == [out / "checkpoints" / "step_00000002"]
    resumed = [r for r in rows(out) if r.get("event") == "resume"]
    assert resumed[-1]["config_changes"] == {"trainer.max_steps": [2, 4]}

    # the newest checkpoint rots after preflight read it: the trainer falls back to the older
    # one and judges that one, by the same rules
    calls.clear()
    import llama_train.checkpoint as checkpoint

    newest = out / "checkpoints" / "step_00000004"
    older = out / "checkpoints" / "step_00000002"
    real_candidate = checkpoint.resume_candidate

    def candidate_then_rot(*a, **k):
        found = real_candidate(*a, **k)
        shard = newest / "ranks" / "rank_00000.pt"  # same size, one byte flipped
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        return found

    monkeypatch.setattr(checkpoint, "resume_candidate", candidate_then_rot)
    with world_of_one():
        train(cfg_for(out, "trainer.max_steps=6", "trainer.save_every=2",
                      "trainer.keep_last=5"))
    assert calls == [newest, older]


def test_config_changes_ignores_per_launch_keys_and_keys_the_checkpoint_lacks():
    old = {"trainer": {"output_dir": "a", "resume": "auto", "seed": 1}, "model": {"dim": 64}}
    new = {"trainer": {"output_dir": "b", "resume": "never", "seed": 2},
           "model": {"dim": 64, "added_later": 1}}
    defining, safe = config_changes(old, new)
    assert defining == [("trainer.seed", 1, 2)] and safe == []
