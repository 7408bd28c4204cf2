"""``deepspeed.extra``: raw DeepSpeed settings we do not model, merged last into the config the
engine builds. Keys we set are refused by name before anything starts; what is merged reaches
DeepSpeed's engine and the dry run."""

from __future__ import annotations

import itertools
import re
import sys

import pytest

from helpers import TINY, cfg_for, compose_cfg, free_port, world_of_one
from llama_train.config import ConfigError, DeepSpeedConfig, OptimConfig, resolve_batch

# What build_ds_config states that deepspeed.extra may change: defaults of DeepSpeed's, not
# settings of ours (every other key it writes is in DEEPSPEED_OWNED).
DEFAULTS = {"wall_clock_breakdown", "fp16.loss_scale", "fp16.initial_scale_power",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            "zero_optimization.offload_optimizer.pin_memory",
            "zero_optimization.offload_param.pin_memory"}


def _ds_config(cfg, device="cpu"):
    from llama_train.engine.ds_config import build_ds_config

    return build_ds_config(cfg.deepspeed, cfg.optim, resolve_batch(cfg.trainer, 1), device,
                           model_dim=cfg.model.dim)


def test_extra_merges_deeply_and_last():
    extra = ("deepspeed.extra={zero_optimization: {round_robin_gradients: true, "
             "stage3_gather_16bit_weights_on_model_save: true}, wall_clock_breakdown: true, "
             "comms_logger: {enabled: true, prof_ops: [all_reduce]}}")
    plain = _ds_config(compose_cfg(["deepspeed=zero3"]))
    cfg = compose_cfg(["deepspeed=zero3", extra])
    merged = _ds_config(cfg)
    zero = merged["zero_optimization"]
    # ours kept beside the merged keys; a default of DeepSpeed's replaced; new sections added
    assert {k: v for k, v in zero.items() if k != "round_robin_gradients"} == {
        **plain["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True}
    assert zero["round_robin_gradients"] is True and zero["stage"] == 3
    assert merged["wall_clock_breakdown"] is True
    assert merged["comms_logger"] == {"enabled": True, "prof_ops": ["all_reduce"]}
    assert {k: v for k, v in merged.items()
            if k not in ("zero_optimization", "wall_clock_breakdown", "comms_logger")} == {
        k: v for k, v in plain.items() if k not in ("zero_optimization", "wall_clock_breakdown")}
    # a list replaces, never appends; the config's own dict is left as it was
    cfg2 = compose_cfg(["deepspeed.extra.comms_logger.prof_ops=[a]",
                        "deepspeed.extra.comms_logger.enabled=true"])
    assert _ds_config(cfg2)["comms_logger"]["prof_ops"] == ["a"]
    assert cfg.deepspeed.extra["zero_optimization"] == {
        "round_robin_gradients": True, "stage3_gather_16bit_weights_on_model_save": True}
    # '+' is not needed for a key of its own (the node is out of Hydra's struct mode)
    assert compose_cfg(["+deepspeed.extra.comms_logger.enabled=true"]).deepspeed.extra == \
        compose_cfg(["deepspeed.extra.comms_logger.enabled=true"]).deepspeed.extra


def _owned():
    from llama_train.config import DEEPSPEED_OWNED

    return DEEPSPEED_OWNED


def test_every_key_we_generate_is_owned_or_a_stated_default():
    """DEEPSPEED_OWNED lists what build_ds_config sets, over every stage, precision, offload and
    the universal load: a key added there without a line here would be silently overridable."""
    from llama_train.config import flatten
    from llama_train.engine.ds_config import build_ds_config

    owned = _owned()
    batch = resolve_batch(compose_cfg([]).trainer, 1)
    seen = set()
    for stage, precision, offload, universal, device in itertools.product(
            (0, 1, 2, 3), ("fp32", "bf16", "fp16"), (False, True), (False, True),
            ("cpu", "cuda")):
        if offload and stage == 0:
            continue
        ds = DeepSpeedConfig(zero_stage=stage, precision=precision, offload_optimizer=offload,
                             offload_params=offload and stage == 3)
        seen |= set(flatten(build_ds_config(ds, OptimConfig(), batch, device, universal,
                                            model_dim=64)))
    ours = {k for k in seen if not any(k == o or k.startswith(o + ".") for o in owned)}
    assert ours == DEFAULTS
    # and every owned key is one we generate (or a section whose keys we set: the scheduler is
    # ours as the learning rate of every step is)
    assert {o for o in owned if not any(k == o or k.startswith(o + ".") for k in seen)} == {
        "scheduler"}


@pytest.mark.parametrize("override,message", [
    ("deepspeed.extra.zero_optimization.stage=2",
     "deepspeed.extra.zero_optimization.stage: set deepspeed.zero_stage instead"),
    ("deepspeed.extra={zero_optimization: {stage3_prefetch_bucket_size: 5e7}}",
     "deepspeed.extra.zero_optimization.stage3_prefetch_bucket_size: set "
     "deepspeed.stage3_prefetch_bucket_size instead"),
    ("deepspeed.extra.bf16.enabled=true", "deepspeed.extra.bf16.enabled: set deepspeed.precision"),
    ("deepspeed.extra.train_micro_batch_size_per_gpu=8", "set trainer.micro_batch instead"),
    ("deepspeed.extra.gradient_clipping=0.5", "set optim.grad_clip instead"),
    ("deepspeed.extra.optimizer.params.lr=1.0",
     "deepspeed.extra.optimizer.params.lr: set optim.lr"),
    ("deepspeed.extra.scheduler.type=WarmupLR", "set optim.warmup_steps"),
    ("deepspeed.extra.zero_optimization.offload_optimizer.device=nvme",
     "set deepspeed.offload_optimizer instead"),
    # a scalar that would replace a section holding a key of ours
    ("deepspeed.extra.zero_optimization=null", "would replace DeepSpeed's zero_optimization "
                                               "section, which holds zero_optimization.stage"),
    ("deepspeed.extra.fp16=true", "which holds fp16.enabled (set deepspeed.precision instead)"),
])
def test_a_key_we_set_is_refused_by_name(override, message):
    with pytest.raises(ConfigError) as e:
        compose_cfg([override])
    assert message in str(e.value), str(e.value)


def test_every_owned_key_is_refused():
    for key in _owned():
        with pytest.raises(ConfigError, match=re.escape(f"deepspeed.extra.{key}: ")):
            compose_cfg([f"deepspeed.extra.{key}=1"])


def _cli(argv, monkeypatch, capsys):
    """``llama-train <argv>`` in this process: (exit code, stderr + stdout)."""
    from llama_train import train as train_mod

    monkeypatch.setattr(sys, "argv", ["llama-train", *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        train_mod.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.err + out.out


def test_the_command_line_refuses_it_before_any_process_group(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    out = tmp_path / "never"
    with world_of_one():
        code, text = _cli([*TINY, f"trainer.output_dir={out}",
                           "deepspeed.extra.zero_optimization.stage=3"], monkeypatch, capsys)
        assert not dist.is_initialized()
    assert code == 2, text[-3000:]
    assert "deepspeed.extra.zero_optimization.stage: set deepspeed.zero_stage instead" in text
    assert not out.exists()


def test_the_dry_run_shows_the_merged_config(tmp_path, monkeypatch, capsys):
    with world_of_one():
        code, text = _cli([*TINY, f"trainer.output_dir={tmp_path / 'never'}",
                           "trainer.dry_run=true", "deepspeed=zero2",
                           "deepspeed.extra.zero_optimization.round_robin_gradients=true",
                           "deepspeed.extra.comms_logger.enabled=true"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    line = next(x for x in text.splitlines() if "DeepSpeed config" in x)
    assert "(deepspeed.extra merged last)" in line
    assert '"comms_logger": {"enabled": true}' in line
    assert '"round_robin_gradients": true' in line and '"stage": 2' in line


def test_a_change_on_resume_may_go_ahead_and_is_logged():
    """May change like the other DeepSpeed knobs: a changed value is listed among the changes
    a resume logs, never refused (what defines the numerics is ours, and refused in extra)."""
    from llama_train import policy
    from llama_train.job.resume import config_changes, policy_of

    assert policy_of("deepspeed.extra.zero_optimization.round_robin_gradients") == \
        policy.MAY_CHANGE
    old = {"deepspeed": {"extra": {"comms_logger": {"enabled": False}}}}
    new = {"deepspeed": {"extra": {"comms_logger": {"enabled": True}}}}
    assert config_changes(old, new) == (
        [], [("deepspeed.extra.comms_logger.enabled", False, True)])


@pytest.mark.slow
def test_extra_reaches_deepspeeds_engine(tmp_path, monkeypatch):
    """One step of ZeRO-2 on a world of one: DeepSpeed's own engine config has the merged keys
    (a default of ours replaced, a key of DeepSpeed's added under a section of ours)."""
    import llama_train.engine as eng
    from llama_train.train import train

    built = []
    real = eng.initialize

    def spy(model, groups, ds_config, **kw):
        engine = real(model, groups, ds_config, **kw)
        built.append((ds_config, engine.ds.config, engine.ds._config))
        return engine

    monkeypatch.setattr(eng, "initialize", spy)
    with world_of_one():
        train(cfg_for(tmp_path / "out", "trainer.max_steps=1", "trainer.eval_every=1000",
                      "sample.tokens=0", "deepspeed=zero2",
                      "deepspeed.extra.wall_clock_breakdown=true",
                      "deepspeed.extra.zero_optimization.round_robin_gradients=true"))
    (ds_config, raw, parsed), = built
    assert ds_config["zero_optimization"]["round_robin_gradients"] is True
    assert raw["zero_optimization"]["stage"] == 2 and raw["wall_clock_breakdown"] is True
    assert parsed.zero_config.round_robin_gradients is True
    assert parsed.wall_clock_breakdown is True and parsed.zero_optimization_stage == 2
