"""The dry run and ``--cfg job`` show the run's own plan (plan.plan_job, scope "preview"): a
resume's kept global batch is the batch they print and the run trains (they printed the
config's micro_batch x ranks, which the resume then replaced), and float8 on a machine without
FP8 matmuls is planned, its device left to the launch, which still refuses it. (init_from's
tokenizer: tests/hf/test_init_from_tokenizer.py.)"""

from __future__ import annotations

import re

import pytest

from helpers import TINY, cfg_for, launch_vars_restored, run_main, step_rows, world_of_one


def _dry_run(cfg, capsys) -> str:
    from llama_train.job.dry_run import dry_run

    with launch_vars_restored():
        dry_run(cfg)
    return capsys.readouterr().out


def _cfg_job(overrides, capsys) -> str:
    from llama_train.job.dry_run import print_job_config

    with launch_vars_restored():
        print_job_config(list(overrides))
    return capsys.readouterr().out


@pytest.mark.slow  # two real runs in this process: ~20 s, too long for make test-fast's tier
def test_a_resumes_dry_run_prints_the_batch_it_keeps_and_the_run_trains_it(tmp_path, capsys):
    """A checkpoint trained with a global batch of 8 (micro 4 x accum 2) in trainer.output_dir:
    the same command without trainer.global_batch resumes with 8 (the data order is a function
    of it), so the dry run's batch is 8 sequences, said as the run says it, --cfg job's
    trainer.global_batch is 8, and the run trains 2 micro-batches of 4 per step."""
    import yaml

    from llama_train.train import train

    out = tmp_path / "run"
    with world_of_one():
        train(cfg_for(out, "trainer.max_steps=1", "trainer.save_every=1",
                      "trainer.global_batch=8"))
    ckpt = out / "checkpoints" / "step_00000001"
    assert ckpt.is_dir(), sorted(p.name for p in (out / "checkpoints").iterdir())

    text = _dry_run(cfg_for(out, "trainer.max_steps=2", "trainer.dry_run=true"), capsys)
    assert ("  batch: 1 rank(s) x micro 4 x accum 2 = 8 sequences x 64 tokens = 512 tokens/step"
            in text), text
    assert (f"  resuming {ckpt}: keeping its global batch of 8 sequences (trainer.micro_batch=4 "
            f"x 1 rank(s) x 2 accumulation steps): the global batch cannot change within a run"
            in text), text
    shown = _cfg_job([*TINY, "trainer.micro_batch=4", f"trainer.output_dir={out}",
                      "trainer.max_steps=2"], capsys)
    assert f"\n# resuming {ckpt}: keeping its global batch of 8 sequences" in shown, shown
    assert yaml.safe_load(shown)["trainer"]["global_batch"] == 8

    with world_of_one():  # the run itself: the batch the dry run printed
        train(cfg_for(out, "trainer.max_steps=2", "trainer.save_every=1"))
    assert step_rows(out)[2]["tokens"] == 2 * 8 * 64  # 8 sequences of 64 tokens a step


def test_float8_dry_run_on_cpu_plans_and_leaves_the_device_to_the_launch(tmp_path, monkeypatch,
                                                                         capsys):
    """float8.enabled=true without emulation on this CPU machine (a login node of a GPU job):
    the dry run prints its plan and exits 0, saying the FP8 device is checked at launch and
    what the check says here; the run itself is refused before any process group, by key."""
    import torch.distributed as dist

    from llama_train.config import ConfigError
    from llama_train.job.preflight import preflight

    out = tmp_path / "run"
    fp8 = ["float8.enabled=true", "deepspeed.precision=bf16"]
    code, text = run_main([*TINY, f"trainer.output_dir={out}", *fp8, "trainer.dry_run=true"],
                          monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert "dry run (trainer.dry_run=true): the plan, nothing started" in text, text[-3000:]
    assert "tokens/step" in text and "estimated time: " in text, text[-3000:]
    said = re.search(r"\n  float8: the FP8 device .* is checked at launch, on the job's devices; "
                     r"here it would be refused: float8.enabled=true on cpu.*float8.emulate=true",
                     text)
    assert said, text[-3000:]
    assert not out.exists() and not dist.is_initialized()
    shown = _cfg_job([*TINY, f"trainer.output_dir={out}", *fp8], capsys)
    assert "\n# float8: the FP8 device" in shown and "\nfloat8:\n  enabled: true\n" in shown
    # a precision float8 cannot run with on any device is still refused by the dry run
    with pytest.raises(ConfigError, match="float8.enabled=true needs deepspeed.precision=bf16"):
        _dry_run(cfg_for(out, "float8.enabled=true", "deepspeed.precision=fp32"), capsys)

    with launch_vars_restored(), pytest.raises(ConfigError, match=r"float8.emulate=true"):
        preflight(cfg_for(out, *fp8))  # the launch: refused, nothing started or written
    assert not out.exists() and not dist.is_initialized()


def test_the_layout_scope_judges_nothing_but_the_layout():
    """plan_job(scope="layout"), for a config that already ran (the simulation's replan) or
    is no training job (the bench's memory worker): the layout and batch a check would give,
    where config.validate refuses the config; a layout that cannot work is still refused."""
    from dataclasses import replace

    from helpers import compose_cfg
    from llama_train.config import BatchPlan, ConfigError, validate
    from llama_train.engine import Runtime
    from llama_train.job.plan import plan_job
    from llama_train.layout import ParallelLayout

    cfg = compose_cfg([*TINY, "trainer.micro_batch=2", "trainer.global_batch=8",
                       "parallel.sequence=2"])
    rt = Runtime("cpu", 3, 1, 4, 2)
    bad = replace(cfg, sample=replace(cfg.sample, tokens=cfg.model.max_seq_len))
    with pytest.raises(ConfigError, match="sample.tokens="):
        validate(bad, 4, "cpu")
    job = plan_job(bad, rt, scope="layout")
    assert job.layout == ParallelLayout(4, 3, 2) and job.batch == BatchPlan(2, 2, 2, 8, 64)
    assert job.batch == plan_job(cfg, rt, scope="check").batch and job.cfg is bad
    with pytest.raises(ConfigError, match="parallel.sequence=3 does not divide"):
        plan_job(replace(cfg, parallel=replace(cfg.parallel, sequence=3)), rt, scope="layout")
