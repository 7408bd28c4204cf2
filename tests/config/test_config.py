"""Config composition, cross-field validation and the learning-rate schedule (no processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from llama_train.config import ConfigError, resolve_batch
from llama_train.job.optim import lr_at, param_groups
from llama_train.job.preflight import preflight

from helpers import REPO, TINY, compose_cfg


# ---------------------------------------------------------------------------------------------
# Schedule


def test_schedule_boundaries():
    kw = dict(lr=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == 0.0  # warmup starts from 0
    assert lr_at(5, **kw) == pytest.approx(5e-4)
    assert lr_at(10, **kw) == pytest.approx(1e-3)  # peak at the end of warmup
    assert lr_at(60, **kw) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half way: mid value
    assert lr_at(110, **kw) == pytest.approx(1e-4)  # min_lr_ratio * peak at max_steps
    assert lr_at(500, **kw) == pytest.approx(1e-4)  # constant afterwards
    values = [lr_at(s, **kw) for s in range(0, 120)]
    assert all(b >= a for a, b in zip(values[:10], values[1:11]))  # rising in warmup
    assert all(b <= a + 1e-15 for a, b in zip(values[10:], values[11:]))  # falling after
    assert lr_at(0, lr=1.0, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == 1.0


def test_weight_decay_groups():
    from llama_train.config import OptimConfig
    from llama_train.model import ModelArgs, Transformer

    m = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16))
    groups = param_groups(m, OptimConfig())
    names = {id(p): n for n, p in m.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert "tok_embeddings.weight" in no_decay and "norm.weight" in no_decay
    assert "layers.0.attention_norm.weight" in no_decay
    assert "layers.0.attention.wq.weight" in decay and "output.weight" in decay
    assert groups[1]["weight_decay"] == 0.0
    groups = param_groups(m, OptimConfig(decay_embeddings=True, decay_norms_and_biases=True))
    assert len(groups) == 1
    # ZeRO-3 partitions leave each parameter's own tensor empty; its full shape is ds_shape
    for p in m.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    partitioned = param_groups(m, OptimConfig())
    assert {names[id(p)] for p in partitioned[0]["params"]} == decay


# ---------------------------------------------------------------------------------------------
# Batch arithmetic


def test_global_batch_resolution():
    cfg = compose_cfg(["trainer.micro_batch=2", "trainer.global_batch=8"])
    plan = resolve_batch(cfg.trainer, world_size=2)
    assert (plan.grad_accum, plan.global_batch) == (2, 8)
    cfg = compose_cfg(["trainer.micro_batch=2", "trainer.seq_len=64",
                       "trainer.global_batch_tokens=768"])
    plan = resolve_batch(cfg.trainer, world_size=3)
    assert (plan.global_batch, plan.grad_accum, plan.tokens_per_step) == (12, 2, 768)
    plan = resolve_batch(compose_cfg(["trainer.micro_batch=4"]).trainer, world_size=2)
    assert (plan.global_batch, plan.grad_accum) == (8, 1)


# ---------------------------------------------------------------------------------------------
# Bad configurations: a table. Each must fail before any process group starts, naming the key.

BAD = [
    # (overrides, key the message must name)
    (["model.dim=100", "model.n_heads=3"], "model.n_heads"),  # shapes
    (["model.n_heads=8", "model.n_kv_heads=3"], "model.n_kv_heads"),
    (["model.dim=24", "model.n_heads=8", "model.n_kv_heads=8"], "model"),  # odd head_dim for RoPE
    (["trainer.seq_len=512"], "model.max_seq_len"),  # tiny has max_seq_len 256
    (["trainer.global_batch=6"], "trainer.global_batch"),  # batch arithmetic (6 % (2*2))
    (["trainer.global_batch_tokens=100"], "trainer.global_batch_tokens"),
    (["trainer.global_batch=8", "trainer.global_batch_tokens=512"], "trainer.global_batch"),
    (["deepspeed.offload_params=true", "deepspeed.zero_stage=2"], "deepspeed.offload_params"),
    (["deepspeed.offload_optimizer=true", "deepspeed.zero_stage=0"],
     "deepspeed.offload_optimizer"),
    (["deepspeed.precision=fp16"], "deepspeed.precision"),  # fp16 on CPU
    (["deepspeed.zero_stage=4"], "deepspeed.zero_stage"),
    (["deepspeed.precision=fp8"], "deepspeed.precision"),
    (["trainer.max_steps=0"], "trainer.max_steps"),  # negative or zero values
    (["trainer.micro_batch=-1"], "trainer.micro_batch"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio"),
    (["optim.beta2=1.0"], "optim.beta2"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["trainer.resume=/no/such/checkpoint"], "trainer.resume"),
    (["tracking.wandb.mode=sometimes"], "tracking.wandb.mode"),
    (["data.source=/no/such/corpus.jsonl"], "/no/such/corpus.jsonl"),  # missing data
    (["data.val_fraction=1.5"], "data.val_fraction"),
    (["scaling.mode=compute_optimal"], "scaling.flops"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_fails_before_process_group(overrides, key, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError) as err:
        preflight(compose_cfg([*TINY, *overrides]))
    assert key in str(err.value), str(err.value)
    assert not dist.is_initialized()


BAD_COMPOSE = [
    (["trainer.max_step=5"], "max_step"),  # unknown key (typo)
    (["+trainer.foo=1"], "foo"),  # unknown key, even when forced with +
    (["trainer.max_steps=many"], "max_steps"),  # wrong type
    (["model=llama4_1t"], "llama4_1t"),  # unknown preset
]


@pytest.mark.parametrize("overrides,key", BAD_COMPOSE, ids=[" ".join(o) for o, _ in BAD_COMPOSE])
def test_unknown_keys_and_types_fail_at_composition(overrides, key):
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError, ConfigError)) \
            as err:
        compose_cfg(overrides)
    assert key in str(err.value) or key in str(err.value.__cause__)


@pytest.mark.slow  # a Python process of its own (imports torch): make test only
def test_cli_reports_config_error_without_starting(tmp_path):
    """The real entry point: a clear message, exit code 2, in seconds, no process group."""
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "llama_train.train", *TINY, "model.n_heads=3",
         f"trainer.output_dir={tmp_path}/out", "--local_rank=0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.n_heads" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "init_distributed" not in proc.stderr + proc.stdout
    assert time.time() - t0 < 120


def test_mfu_peak_is_decided_once_and_says_where_it_came_from(tmp_path, monkeypatch):
    """MFU's denominator never changes mid-run (it did: re-timed when the run beat it, so MFU
    jumped 98.9% -> 16.7% in one run); its source is stated."""
    from llama_train.engine import PeakFlops

    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path))
    peak = PeakFlops(torch.device("cpu"), "fp32", world_size=2)
    assert peak.value > 0 and "fp32 matmul on cpu" in peak.source
    assert f"cached in {tmp_path / 'peak_flops.json'}" in peak.source
    value = peak.value
    assert peak.mfu(10 * value) == pytest.approx(10.0)  # above 100%: reported, not re-timed
    assert peak.value == value
    given = PeakFlops(torch.device("cpu"), "fp32", world_size=2, override=1e6)
    assert given.source == "trainer.peak_flops" and given.mfu(2e8) == pytest.approx(100.0)


def test_the_cpu_peak_is_measured_once_per_machine_and_reused(tmp_path, monkeypatch):
    """Issue 28, item 5: a matmul timed at every start read 4.3e10-2.0e11 FLOP/s on one machine,
    so MFU read 5%-147% across identical runs. The first run measures and caches; later runs
    (another process: the file, not memory) reuse the figure, saying where it came from;
    another thread count is another entry; a damaged file is measured again and rewritten."""
    from llama_train.engine.flops import cached_matmul_flops

    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path))
    calls = []

    def measure(device, dtype, repeats, budget_s):
        calls.append((device.type, dtype, torch.get_num_threads()))
        return 1e11 * len(calls)

    cpu = torch.device("cpu")
    first, source = cached_matmul_flops(cpu, torch.float32, measure)
    assert first == 1e11 and "measured" in source and str(tmp_path) in source
    assert cached_matmul_flops(cpu, torch.float32, measure) == (first, source)
    assert len(calls) == 1
    assert cached_matmul_flops(cpu, torch.bfloat16, measure)[0] == 2e11  # its own entry
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert cached_matmul_flops(cpu, torch.float32, measure)[0] == 3e11
    finally:
        torch.set_num_threads(threads)
    assert cached_matmul_flops(cpu, torch.float32, measure)[0] == first  # still there
    (tmp_path / "peak_flops.json").write_text("{not json")
    assert cached_matmul_flops(cpu, torch.float32, measure)[0] == 4e11
    assert cached_matmul_flops(cpu, torch.float32, measure)[0] == 4e11
    assert len(calls) == 4


def test_a_slow_matmul_is_timed_within_the_budget(monkeypatch):
    """A bf16 matmul takes ~1 s on a CPU without bf16 units: the cached measurement stops at
    three runs once its 3 s are gone, instead of holding each rank's start for best of 21."""
    from llama_train.engine import flops

    clock, matmuls = iter(range(10**6)), []
    monkeypatch.setattr(flops.time, "perf_counter", lambda: float(next(clock)))  # 1 s a read
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__",
                        lambda a, b: matmuls.append(1) or real(a, b))
    cpu = torch.device("cpu")
    assert flops.measure_matmul_flops(cpu, n=8, repeats=20, budget_s=3.0) == 2 * 8**3 / 1.0
    assert len(matmuls) == 3
    matmuls.clear()
    flops.measure_matmul_flops(cpu, n=8, repeats=20)
    assert len(matmuls) == 21


def test_a_runs_saved_config_file_composes_onto_the_schema(tmp_path):
    """``llama-train --config-dir <run dir> --config-name config`` (a run's saved config.yaml
    as the primary config, no schema in its defaults) composed to plain dicts and failed with
    an AttributeError; it now trains with that config, checked like any composed one: a typo
    or a wrong type in the file is a ConfigError naming the key."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from llama_train.config import load_config, to_container

    saved = to_container(compose_cfg([*TINY, "trainer.max_steps=7"]))
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    with initialize_config_dir(str(tmp_path), version_base=None):
        cfg = load_config(compose("config", overrides=["model.dim=48", "model.n_heads=3",
                                                       "model.n_kv_heads=3"]))
    assert (cfg.trainer.max_steps, cfg.model.dim, cfg.data.max_documents) == (7, 48, 600)
    assert to_container(cfg) == {**saved, "model": {**saved["model"], "dim": 48, "n_heads": 3,
                                                     "n_kv_heads": 3}}
    for text, key in [("trainer:\n  max_stepz: 3\n", "trainer.max_stepz"),
                      ("trainer:\n  max_steps: many\n", "trainer.max_steps"),
                      ("trainerx:\n  max_steps: 3\n", "trainerx")]:
        (tmp_path / "config.yaml").write_text(text)
        with initialize_config_dir(str(tmp_path), version_base=None):
            dcfg = compose("config")
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(dcfg)


COMPOSITIONS = [
    TINY,
    [*TINY, "deepspeed=zero3", "optim.lr=0.002", "+trainer.nothing=1"],
    ["experiment=compute_optimal", "scaling.flops=1e18", "hydra.job.name=x"],
    ["model=nope"],
    [*TINY, "optim.lr=[1"],
]


@pytest.mark.parametrize("overrides", COMPOSITIONS, ids=[" ".join(o[-2:]) for o in COMPOSITIONS])
def test_remembered_compositions_are_hydras_own(overrides, monkeypatch, tmp_path):
    """tests/hydra_memo.py hands out what Hydra composes without it (the Hydra node included),
    the first time and the next, and fails as Hydra does; from a run's saved config too, and
    after that file changed."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import hydra_memo
    from llama_train.paths import CONFIG_DIR

    saved = tmp_path / "config.yaml"
    text = "defaults:\n  - llama_train_schema\n  - _self_\ntrainer:\n  max_steps: {}\n"

    def composed(config_dir=CONFIG_DIR, given=overrides):
        try:
            with initialize_config_dir(str(config_dir), version_base=None):
                cfg = compose("config", overrides=list(given), return_hydra_config=True)
            return OmegaConf.to_container(cfg)
        except Exception as e:  # the same failure, said the same way
            return type(e), str(e)

    def all_of_them():
        saved.write_text(text.format(7))
        out = [composed(), composed(tmp_path, ["trainer.seed=3"])]
        saved.write_text(text.format(9))  # the same size, at once: its bytes tell
        return out + [composed(tmp_path, ["trainer.seed=3"])]

    remembered = [all_of_them(), all_of_them()]
    hydra_memo.undone(monkeypatch)
    assert remembered[0] == remembered[1] == all_of_them()


def test_measuring_the_peak_leaves_the_global_rng_alone():
    """The first run on a machine measures the peak (a matmul of random matrices), later runs
    read it from the cache: the RNG state a run seeds and saves in its checkpoints must not
    depend on which of the two it was (tests/checkpoint/test_async_save.py compares a run's saved bytes)."""
    import torch

    from llama_train.engine.flops import measure_matmul_flops

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    measure_matmul_flops(torch.device("cpu"), n=64, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)
