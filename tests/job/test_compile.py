"""``trainer.compile`` (each transformer block compiled with torch.compile in place).

Fast: ``auto`` (the default) compiles on CUDA and leaves CPU eager, ``true``/``false`` in every
spelling keep their meaning, any other value is refused while the config loads (before any
process group), and the compile log (:class:`llama_train.job.trainer.CompileWatch`) says how long
compiling took and when dynamo recompiles.

Slow, through the real launcher (2 CPU ranks, gloo, fp32, the tiny model): compiled and eager
ZeRO-3 with activation checkpointing and document masking agree over 10 steps, a resume of the
compiled run is exact, and a compiled run with sequence parallelism (ZeRO-1) agrees with the eager
ZeRO-3 one. FP8 (emulated) compiled against eager runs in this process on one rank.

Tolerances. Eager vs compiled, fp32: inductor fuses the element-wise work (RMSNorm, SiLU,
residual adds, RoPE) and may reorder its reductions, so each step's numbers differ in the last
bits (~1e-7 relative) and the difference grows through 10 optimizer steps; measured at most
4.8e-7 on the loss here, so 1e-4 (absolute, on losses ~7.6) catches a wrong gradient or a missed
parameter gather by orders of magnitude while not failing on rounding. Sequence parallelism
also sums gradients in another order than two data-parallel ranks (tests/system/test_launcher_runs.py's
2e-4), so that comparison gets 2e-4 + 1e-4. A resume of the compiled run on the same ranks
runs the same kernels (the same code, from the inductor cache) on the same data: bit-identical.
FP8 emulated in bf16: 1e-2 on the loss (bf16's 8-bit mantissa; a scale rounded differently
moves whole FP8 values: 3e-4 measured after one step).

Cost: the first compiled launch compiles one forward and one backward graph for the 4 blocks
(plus the evaluation's forward), ~15 s of each rank's first step on 2 cores: mostly inductor's
C++ kernels, built once into the inductor cache every launch here shares (TORCHINDUCTOR_CACHE_DIR),
which the resume then loads whole (~1 s); the sequence-parallel launch builds its own. The warm
parent checks the CPU's vector instruction sets once for all of them (tests/warm_ranks.py). The
two launching tests took ~66 CPU-s (125 with ZeRO-3's hooks inside the compiled blocks).
"""

from __future__ import annotations

import contextlib
import logging
import re

import pytest

from helpers import (TINY, assert_losses_close, cfg_for, compose_cfg, copy_at_step, losses,
                     resumed_from, train, world_of_one)
from llama_train.config import ConfigError

STEPS = 10
COMPILE_TOL = 1e-4
SP_TOL = 2e-4 + COMPILE_TOL
FP8_TOL = 1e-2
# ZeRO-3, activation checkpointing and document masking in one launch; no end-of-run sample
# (its one-token decoding steps would only recompile)
Z3 = ["deepspeed.zero_stage=3", "model.activation_checkpointing=true",
      "trainer.document_mask=true", f"trainer.max_steps={STEPS}", "trainer.save_every=5",
      "sample.tokens=0"]


# -- fast: the value and its resolution --------------------------------------------------------

def test_auto_is_the_default_and_compiles_on_cuda_only():
    t = compose_cfg(TINY).trainer
    assert t.compile == "auto"
    assert t.compiles("cuda") == (True, "auto: CUDA")
    assert t.compiles("cpu") == (False, "auto: CPU stays eager")


@pytest.mark.parametrize("override,value,on", [
    ("trainer.compile=true", "true", True),  # Hydra parses a YAML boolean
    ("trainer.compile=false", "false", False),
    ("trainer.compile=True", "true", True),
    ("trainer.compile='true'", "true", True),  # a string
    ("trainer.compile='false'", "false", False),
    ("trainer.compile=auto", "auto", False),
    ("trainer.compile=AUTO", "auto", False),
])
def test_true_and_false_keep_their_meaning_in_every_spelling(override, value, on):
    t = compose_cfg([*TINY, override]).trainer
    assert t.compile == value
    assert t.compiles("cpu")[0] is on
    if value != "auto":
        assert t.compiles("cuda")[0] is on


def test_a_yaml_boolean_in_a_saved_config_loads():
    """A run's saved config.yaml (``--config-dir <run dir>``) written before ``auto`` holds
    ``compile: false``: it merges onto the schema as a plain boolean."""
    from omegaconf import OmegaConf

    from llama_train.config import load_config

    saved = OmegaConf.to_container(OmegaConf.structured(compose_cfg(TINY)))
    saved["trainer"]["compile"] = False
    assert load_config(OmegaConf.create(saved)).trainer.compile == "false"


@pytest.mark.parametrize("bad", ["yes", "maybe", "1", "eager"])
def test_any_other_value_is_refused_naming_the_key_and_the_choices(bad):
    with pytest.raises(ConfigError, match=r"trainer\.compile=.* must be one of auto, true, false"):
        compose_cfg([*TINY, f"trainer.compile={bad}"])


@pytest.mark.slow  # an interpreter of its own: not in make test-fast's in-process tier
def test_a_bad_value_stops_the_entry_point_before_any_process_group(tmp_path):
    """Exit 2 with the one line, from the real entry point, without a process group."""
    import subprocess
    import sys

    from helpers import REPO

    r = subprocess.run([sys.executable, "-m", "llama_train.train", *TINY,
                        f"trainer.output_dir={tmp_path / 'run'}", "trainer.compile=maybe"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-2000:]
    assert "trainer.compile='maybe' must be one of auto, true, false" in text
    assert "process group up" not in text and "Traceback" not in text


# -- fast: the compile log ----------------------------------------------------------------------

def test_compile_watch_logs_the_compile_time_and_each_recompile(caplog):
    """The first step's line gives the time inside the compiler; a later step that compiles
    again (a new shape here) gets one line with the guard that failed; a step that compiles
    nothing gets none. The eager backend keeps it fast: dynamo's callbacks fire all the same."""
    import torch

    from llama_train.job.trainer import CompileWatch

    def f(x):
        return torch.nn.functional.silu(x) * 2

    g = torch.compile(f, backend="eager", dynamic=False)
    watch = CompileWatch()
    try:
        with caplog.at_level(logging.INFO, logger="llama_train"):
            g(torch.ones(4))
            watch.on_step_end(3, {})
            g(torch.ones(4))
            watch.on_step_end(4, {})
            g(torch.ones(5))
            watch.on_step_end(5, {})
    finally:
        watch.close()
    lines = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("torch.compile: ") and "compiling 1 graphs" in lines[0]
    assert "during step 3" in lines[0]
    assert "recompiled during step 5" in lines[1] and "1 of them recompiles" in lines[1]
    assert "size mismatch" in lines[1], lines[1]  # the guard that failed: x's shape
    g(torch.ones(6))  # closed: no callbacks left behind
    assert watch.graphs == 0


def test_the_blocks_share_one_graph_without_breaks(monkeypatch):
    """compile_blocks: the tiny model's 4 blocks (grouped K/V heads, document masking,
    activation checkpointing: what the slow tests train) trace as one graph, compiled once for
    all 4 and kept over a second step: no graph break in RoPE or attention (each split a block
    into more graphs, and the heads' shapes then recompiled them). aot_eager: dynamo and AOT
    autograd run for real, without inductor's code generation."""
    import dataclasses

    import torch
    from torch._dynamo.utils import counters

    from llama_train.engine import compile_blocks
    from llama_train.model import Transformer, document_ids, load_preset

    plain_compile = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, *a, **k: plain_compile(fn, *a, backend="aot_eager", **k))
    args = dataclasses.replace(load_preset("tiny"), activation_checkpointing=True)
    model = Transformer(args, seed=0).train()
    compile_blocks(model, zero_stage=0)
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch._dynamo.reset()
    counters.clear()
    try:
        for _ in range(2):
            model(x, y, doc_ids=document_ids(x, eos_id=x[0, 5].item()))[1].backward()
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("overrides,linear", [
    (["deepspeed.zero_stage=3"], False),
    (["deepspeed.zero_stage=3",
      "deepspeed.extra={zero_optimization: {memory_efficient_linear: true}}"], True),
    (["deepspeed.zero_stage=2"], None),  # no zero.Init, no linear of DeepSpeed's
])
def test_compiled_zero3_plain_linear_unless_extra_says(overrides, linear):
    """engine.compiled_ds_config: compiled ZeRO-3 blocks keep F.linear (AOT autograd's cache
    stores no graph that holds DeepSpeed's memory-efficient linear); deepspeed.extra decides."""
    from llama_train.config import resolve_batch
    from llama_train.engine import build_ds_config, compiled_ds_config

    cfg = compose_cfg([*TINY, *overrides])
    ds_config = build_ds_config(cfg.deepspeed, cfg.optim, resolve_batch(cfg.trainer, 1), "cuda",
                                model_dim=cfg.model.dim)
    compiled_ds_config(ds_config)
    assert ds_config["zero_optimization"].get("memory_efficient_linear") is linear


# -- slow: through the launcher -----------------------------------------------------------------

@pytest.fixture(scope="module")
def inductor_env(tmp_path_factory):
    """One inductor cache for every compiled launch and in-process run of this module."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor_cache"))}


@pytest.fixture(scope="module")
def z3_runs(tmp_path_factory, inductor_env):
    """The compiled and the eager ZeRO-3 run (10 steps, a checkpoint every 5)."""
    root = tmp_path_factory.mktemp("compile_runs")
    train(root / "compiled", [*Z3, "trainer.compile=true"], env=inductor_env)
    train(root / "eager", [*Z3, "trainer.compile=false"], env=inductor_env)
    return root


@pytest.mark.slow
def test_compiled_zero3_agrees_with_eager_and_resumes_exactly(z3_runs, inductor_env):
    compiled, eager = z3_runs / "compiled", z3_runs / "eager"
    lc, le = losses(compiled), losses(eager)
    assert len(lc) == STEPS
    assert_losses_close(lc, le, COMPILE_TOL)
    log = (z3_runs / "compiled-train.log").read_text()
    assert "trainer.compile=true: each of the 4 blocks compiled (as set)" in log
    # one forward and one backward graph for all 4 blocks, ZeRO-3's hooks outside them, no
    # recompile within the step (77 graphs, 28 recompiles with the hooks inside); the final
    # evaluation's no_grad compiles the forward once more
    assert _first_step_graphs(log) == 2
    assert "torch.compile recompiled during step 10: 1 graph(s)" in log
    assert "trainer.compile=false: eager (as set)" in (z3_runs / "eager-train.log").read_text()

    again = copy_at_step(compiled, z3_runs / "compiled_resumed", 5)
    train(again, [*Z3, "trainer.compile=true", "trainer.resume=auto"], env=inductor_env)
    assert len(resumed_from(again)) == 1
    assert losses(again) == lc  # steps 6-10 bit for bit
    # AOT autograd's cache held the graph: forward and backward loaded as one
    assert _first_step_graphs((z3_runs / "compiled_resumed-train.log").read_text()) == 1


@pytest.mark.slow
def test_compiled_sequence_parallelism_agrees_with_eager(z3_runs, inductor_env):
    """2 ranks sharing each sequence (one replica, micro-batch 4) train the eager 2-replica
    run's global batch of 4: the compiled blocks hold DeepSpeed-Ulysses' all-to-all. ZeRO-1
    here: the blocks compile as they are, not as ZeRO-3's leaf modules (the test above)."""
    sp = z3_runs / "compiled_sp"
    train(sp, [*Z3, "deepspeed.zero_stage=1", "trainer.compile=true", "parallel.sequence=2",
               "trainer.micro_batch=4", "trainer.max_steps=5"], env=inductor_env)
    eager = {k: v for k, v in losses(z3_runs / "eager").items() if k <= 5}
    assert_losses_close(losses(sp), eager, SP_TOL)
    log = (z3_runs / "compiled_sp-train.log").read_text()
    assert _first_step_graphs(log) == 2  # the all-to-all inside the one forward graph
    assert log.count("torch.compile: ") == 1  # rank 0's line, once


@pytest.mark.slow
def test_compiled_fp8_agrees_with_eager_fp8(tmp_path, monkeypatch):
    """float8.emulate=true (CPU) with compiled blocks: torchao's Float8Linear (a tensor
    subclass's casts) traces inside each compiled block and trains as the eager one does, in
    this process on one rank (bf16, 3 steps). The blocks compile with the aot_eager backend:
    dynamo and AOT autograd, what could refuse FP8's modules, run for real; inductor's code
    generation of the float8 casts costs ~3 minutes cold on this CPU (measured: 178 s for one
    forward and backward of 2 blocks), and its speed is the GPU check's to measure."""
    import torch

    from llama_train.train import train as train_in_process

    plain_compile = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, *a, **k: plain_compile(fn, *a, backend="aot_eager", **k))
    fp8 = ["float8.enabled=true", "float8.emulate=true", "deepspeed.precision=bf16",
           "trainer.max_steps=3", "sample.tokens=0"]
    out, said = {}, {}
    for mode in ("true", "false"):
        with world_of_one(), _logged() as lines:
            out[mode] = train_in_process(cfg_for(tmp_path / mode, *fp8,
                                                 f"trainer.compile={mode}"))["losses"]
        said[mode] = lines
    assert len(out["true"]) == 3
    assert_losses_close(out["true"], out["false"], FP8_TOL)
    assert "trainer.compile=true: each of the 4 blocks compiled (as set)" in said["true"]
    assert any(m.startswith("torch.compile: ") for m in said["true"])
    assert "trainer.compile=false: eager (as set)" in said["false"]
    assert not any(m.startswith("torch.compile") for m in said["false"])


def _first_step_graphs(log: str) -> int:
    """How many graphs rank 0's first step compiled (CompileWatch's first line), asserting
    that none of them was a recompile."""
    found = re.search(r"torch\.compile: [\d.]+ s compiling (\d+) graphs "
                      r"\(forward and backward\) during step", log)
    assert found, [line for line in log.splitlines() if "torch.compile" in line]
    return int(found.group(1))


@contextlib.contextmanager
def _logged():
    """The messages of the ``llama_train`` logger while inside (a handler on that logger
    itself: the entry point's logging set-up may replace the root's)."""
    lines: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, logger = Keep(level=logging.INFO), logging.getLogger("llama_train")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
