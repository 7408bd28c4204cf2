"""Bounds checked before work starts (issue 54, class 6): every numeric config key and every
numeric option of the commands has a range, refused before any process group or data
preparation with a message that names the key (or option), the range and what it means.

The config table holds a bad value for EVERY numeric key of the schema (a new key without a
row fails test_every_numeric_key_has_a_row); the commands' tables name their options. The
simulated rank's bound (comm.simulate_ranks) is what keeps its saves short enough that a
SIGTERM during one ends the run as promptly as a real rank's (the slow test at the end).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
import typing
from pathlib import Path

import pytest

from helpers import REPO, TINY, compose_cfg, free_port, run_main, spawn, tail, wait_for
from llama_train.config import Config
from llama_train.job.preflight import preflight

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one

# key -> values each refused (below, above the range, or beside it: a NaN, a 0.5 spike factor)
BAD = {
    "model.dim": ["0", "262144"],
    "model.n_layers": ["0", "5000"],
    "model.n_heads": ["0", "-4"],
    "model.n_kv_heads": ["0"],
    "model.vocab_size": ["-1", "8589934592"],
    "model.multiple_of": ["0", "1000000"],
    "model.ffn_dim_multiplier": ["-1.3", "1e30"],
    "model.norm_eps": ["0", "2.0"],
    "model.rope_theta": ["-10000", "inf"],
    "model.rope_scaling.factor": ["0", "1e9"],
    "model.rope_scaling.low_freq_factor": ["0", "nan"],
    "model.rope_scaling.high_freq_factor": ["-4"],
    "model.rope_scaling.original_max_position_embeddings": ["0", "1073741824"],
    "model.max_seq_len": ["0", "1073741824"],
    "model.init_std": ["0", "1e30"],
    "model.loss_chunk_tokens": ["-1", "100000000"],
    "data.tokenizer_max_sentences": ["-1"],
    "data.tokenizer_max_line_bytes": ["0", "4294967296"],
    "data.val_fraction": ["-0.1", "1.0"],
    "data.num_proc": ["-1", "100000"],
    "data.shard_tokens": ["1", "100", "64"],  # 64: not one window (trainer.seq_len + 1 = 65)
    "data.num_workers": ["-1", "100000"],
    "data.seed": ["-1", "4294967296"],
    "data.max_documents": ["0"],
    "optim.lr": ["0", "-3e-4", "10"],
    "optim.min_lr_ratio": ["-0.1", "1.5"],
    "optim.warmup_steps": ["-5"],
    "optim.beta1": ["-0.1", "1.0"],
    "optim.beta2": ["1.0"],
    "optim.eps": ["0", "1e30"],
    "optim.weight_decay": ["-0.1", "1e30"],  # lr x weight_decay >= 1 zeroes the weights
    "optim.grad_clip": ["-1", "inf"],
    "trainer.max_steps": ["0", "-3", "2147483648000"],
    "trainer.seq_len": ["0"],
    "trainer.micro_batch": ["0", "1000000000"],
    "trainer.global_batch": ["0", "-8"],
    "trainer.global_batch_tokens": ["-512"],
    "trainer.log_every": ["0"],
    "trainer.eval_every": ["-1"],
    "trainer.eval_sequences": ["0"],
    "trainer.save_every": ["0"],
    "trainer.keep_last": ["0"],
    "trainer.steps_this_run": ["0"],
    "trainer.seed": ["-1", "4294967296"],
    "trainer.peak_flops": ["0", "1e30"],
    "recovery.max_bad_steps": ["-1"],
    "recovery.spike_factor": ["-1", "0.5"],  # 0.5: every step a spike
    "recovery.spike_warmup_steps": ["-1"],
    "recovery.max_rollbacks": ["-1"],
    "sample.tokens": ["-1"],
    "sample.temperature": ["-0.5", "1000"],
    "sample.top_k": ["0"],
    "deepspeed.zero_stage": ["-1", "4"],
    "deepspeed.reduce_bucket_size": ["0", "1000000000000"],
    "deepspeed.allgather_bucket_size": ["0", "50000001"],  # odd: DeepSpeed asserts even
    "deepspeed.stage3_prefetch_bucket_size": ["-1"],
    "deepspeed.stage3_param_persistence_threshold": ["-1"],
    "deepspeed.stage3_max_reuse_distance": ["-1"],
    "deepspeed.stage3_max_live_parameters": ["0"],
    "deepspeed.sub_group_size": ["0"],
    "deepspeed.steps_per_print": ["0"],
    "deepspeed.zeropp.hpz_partition_size": ["0", "65537"],
    "deepspeed.mics_shard_size": ["-1", "65537"],
    "comm.timeout_s": ["0", "100000000"],
    "comm.simulate_ranks": ["1", "-4", "1000000"],
    "comm.simulate_rank": ["3"],
    "parallel.sequence": ["0", "3"],
    "scaling.flops": ["-1", "1e31"],
    "scaling.inference_tokens": ["-5"],
    "scaling.params": ["0", "1e16"],
    "scaling.vocab_size": ["0"],
    "scaling.tolerance": ["0", "1"],
    "scaling.max_epochs": ["0"],
    "scaling.lr_ref_params": ["0"],
    "scaling.lr_exponent": ["5"],
    "scaling.lr_ref_flops": ["-1"],
    "scaling.lr_flops_exponent": ["-5"],
}
ROWS = [(k, v) for k, vs in BAD.items() for v in vs]


def numeric_keys(typ: type = Config, prefix: str = "") -> list:
    """Every int or float key of the schema (Optional ones too), by walking the dataclasses;
    not inside lists (data.mixture's weights: test_bad_inputs.py's mixture rows)."""
    out = []
    hints = typing.get_type_hints(typ)
    for f in dataclasses.fields(typ):
        hint = hints[f.name]
        if typing.get_origin(hint) is list:
            continue
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if dataclasses.is_dataclass(inner[0]):
            out += numeric_keys(inner[0], f"{prefix}{f.name}.")
        elif inner[0] in (int, float):
            out.append(f"{prefix}{f.name}")
    return out


def test_every_numeric_key_has_a_row():
    """A numeric knob added to the schema needs its range and a row here."""
    keys = set(numeric_keys())
    assert keys - set(BAD) == set(), "numeric keys without a bad-value row"
    assert set(BAD) - keys == set(), "rows for keys the schema no longer has"


@pytest.mark.parametrize("key,value", ROWS, ids=[f"{k}={v}" for k, v in ROWS])
def test_out_of_range_is_refused_before_any_work(key, value, tmp_path, monkeypatch):
    """Refused (a ValueError: exit 2 from llama-train) naming the key, before the process
    group, the output directory or any data is made."""
    import torch.distributed as dist

    cache, out = tmp_path / "cache", tmp_path / "out"
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(cache))
    with pytest.raises(ValueError) as err:
        preflight(compose_cfg([*TINY, f"trainer.output_dir={out}", f"{key}={value}"]))
    msg = str(err.value)
    assert f"{key}=" in msg, msg
    assert not dist.is_initialized()
    assert not cache.exists() and not out.exists()


@pytest.mark.parametrize("overrides,says", [
    (["comm.simulate_ranks=1000000"],
     "comm.simulate_ranks=1000000 must be in [0, 65536]: the ranks of the job to simulate"),
    (["data.shard_tokens=1"], "data.shard_tokens=1 must be in [512, 2**40]: tokens per shard"),
    (["trainer.max_steps=-3"], "trainer.max_steps=-3 must be in [1, 2**31 - 1]"),
    (["sample.top_k=0"], "sample.top_k=0 must be in [1, 2**31 - 1] or null: the number of most "
                         "likely tokens to sample from; null samples from all of them."),
    (["deepspeed.steps_per_print=0"], "deepspeed.steps_per_print=0 must be in [1, 2**63 - 1]"),
    (["recovery.spike_factor=0.5"], "give a factor > 1 (e.g. 3), or 0 to turn spike detection"),
])
def test_the_message_names_the_range_and_the_fix(overrides, says):
    with pytest.raises(ValueError) as err:
        compose_cfg([*TINY, *overrides])
    assert says in str(err.value), str(err.value)


def test_the_defaults_and_every_preset_are_in_range():
    """The bounds refuse nothing the project ships: every model preset and group option."""
    groups = {p.parent.name for p in (REPO / "configs").glob("*/*.yaml")} - {"study"}
    for group in sorted(groups):
        for f in sorted((REPO / "configs" / group).glob("*.yaml")):
            extra = ["scaling.flops=1e18"] if group == "experiment" else []
            compose_cfg([f"{group}={f.stem}", *extra])


# ---------------------------------------------------------------------------------------------
# llama-train itself: the examples of the issue refused at once, exit 2, nothing made


def llama_train(argv, monkeypatch, capsys):
    """``llama-train <argv>`` in this process: (exit code, stderr + stdout)."""
    from llama_train import train as train_mod

    return run_main(argv, monkeypatch, capsys)


@pytest.mark.parametrize("override", ["comm.simulate_ranks=1000000", "data.shard_tokens=1",
                                      "deepspeed.allgather_bucket_size=50000001",
                                      "optim.lr=10", "data.num_workers=100000"])
def test_llama_train_refuses_at_once(override, tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    cache, out = tmp_path / "cache", tmp_path / "out"
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(cache))
    t0 = time.monotonic()
    code, text = llama_train([*TINY, f"trainer.output_dir={out}", override], monkeypatch,
                             capsys)
    errors = [line for line in text.splitlines() if line.startswith("llama-train: error:")]
    assert code == 2 and len(errors) == 1, text[-2000:]
    assert override.split("=")[0] + "=" in errors[0] and "Traceback" not in text
    assert time.monotonic() - t0 < 60
    assert not dist.is_initialized() and not cache.exists() and not out.exists()


def test_a_simulated_group_beyond_the_bound_is_refused():
    """The group itself refuses a size the config would (a caller that built a CommConfig by
    hand): before any collective could take minutes."""
    import datetime

    from llama_train.comm import simulate
    from llama_train.job.simulation import MAX_RANKS

    for rank, world in ((0, 1_000_000), (0, MAX_RANKS + 1), (5, 4), (0, 1)):
        with pytest.raises(ValueError, match="comm.simulate_ranks"):
            simulate.init(rank, world, datetime.timedelta(seconds=10))


# ---------------------------------------------------------------------------------------------
# The commands: a numeric option out of range is refused before anything is loaded


@pytest.mark.parametrize("argv,says", [
    (["--limit", "-1"], "--limit=-1.0 must be in (0, 2**31 - 1]"),
    (["--limit", "0"], "--limit=0.0 must be"),
    (["--limit", "2.5"], "--limit=2.5: a fraction below 1"),
    (["--limit", "nan"], "--limit=nan is not a finite number"),
    (["--batch-size", "0"], "--batch-size=0 must be"),
    (["--num-fewshot", "-1"], "--num-fewshot=-1 must be"),
    (["--seed", "-1"], "--seed=-1 must be in [0, 2**32 - 1]"),
])
def test_llama_eval_refuses_options_at_once(argv, says, tmp_path, capsys):
    """``llama-eval --limit -1`` failed after 72 s of building tasks: now exit 2 before the
    checkpoint is looked at (it does not exist: the option must be what is named)."""
    from llama_train.inference.downstream import main

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nowhere"), "--tasks", "arc_easy", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "does not exist" not in err, err
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("argv,says", [
    (["--temperature", "nan"], "--temperature=nan is not a finite number"),
    (["--temperature", "inf"], "--temperature=inf is not a finite number"),
    (["--temperature", "1000"], "--temperature=1000.0 must be in [0, 100]"),
    (["--temperature", "-1"], "--temperature=-1.0 must be"),
    (["--top-p", "2"], "--top-p=2.0 must be in (0, 1]"),
    (["--top-p", "nan"], "--top-p=nan is not a finite number"),
    (["--top-k", "0"], "--top-k=0 must be"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0 must be"),
    (["--seed", "-1"], "--seed=-1 must be"),
])
def test_llama_generate_refuses_options_at_once(argv, says, tmp_path, capsys):
    """``--temperature nan`` was a traceback after the load (``inf`` sampled uniformly)."""
    from llama_train.inference.generate import main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nowhere"), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "does not exist" not in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,says", [
    (["model-info", "--model", "tiny", "--gpu-mem", "nan"], "--gpu-mem=nan is not a finite"),
    (["model-info", "--model", "tiny", "--gpu-mem", "-3"], "--gpu-mem=-3.0 must be"),
    (["shape", "--params", "1e9", "--max-seq-len", "0"], "--max-seq-len=0 must be"),
    (["shape", "--params", "1e9", "--tolerance", "nan"], "--tolerance=nan is not a finite"),
    (["inference-optimal", "--loss", "nan", "--inference-tokens", "1e12"], "--loss=nan"),
    (["fit", "{tmp}/nowhere", "--seed", "-1"], "--seed=-1 must be"),
    (["fit", "{tmp}/nowhere", "--bootstrap-top-k", "0"], "--bootstrap-top-k=0 must be"),
    (["fit", "{tmp}/nowhere", "--min-flops", "nan"], "--min-flops=nan is not a finite"),
])
def test_llama_plan_refuses_options(argv, says, tmp_path, capsys):
    from llama_train.scaling.cli import main

    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("bench,argv,says", [
    ("checkpoint", ["--timeout", "nan"], "--timeout=nan is not a finite number"),
    ("checkpoint", ["--nprocs", "0"], "--nprocs=0 must be"),
    ("data", ["--scale", "0"], "--scale=0 must be"),
    ("memory", ["--mem-fraction", "nan"], "--mem-fraction=nan is not a finite number"),
    ("startup", ["--timeout", "-5"], "--timeout=-5.0 must be"),
    ("train", ["--timeout", "0"], "--timeout=0.0 must be"),
    ("allreduce", ["--master-port", "70000"], "--master-port=70000 must be"),
    ("docmask", ["--seed", "-1"], "--seed=-1 must be"),
])
def test_llama_bench_refuses_options(bench, argv, says):
    from llama_train.bench import main

    with pytest.raises(SystemExit) as e:
        main([bench, *argv])
    assert says in str(e.value.code), e.value.code


# ---------------------------------------------------------------------------------------------
# A simulated save answers SIGTERM like a real one


@pytest.mark.slow
def test_sigterm_during_a_simulated_save_stops_promptly(tmp_path):
    """The largest simulation allowed, SIGTERM'd while it saves (the save of step 2 held 3 s
    by the slow_save fault): the save completes, the next step saves and the run exits 143
    (128 + SIGTERM) with the stopped line, within seconds as a real rank does. At 1,000,000
    ranks (refused now) each save took 57 s and the SIGTERM'd run exited after 128 s."""
    from llama_train.job.simulation import MAX_RANKS

    out, log = tmp_path / "out", tmp_path / "train.log"
    cmd = [sys.executable, "-m", "llama_train.train", *TINY, f"trainer.output_dir={out}",
           "trainer.max_steps=50", "trainer.save_every=2", f"comm.simulate_ranks={MAX_RANKS}"]
    with spawn(cmd, log, {"LLAMA_TRAIN_FAULTS": "slow_save:step=2,seconds=3"}, warm=True) as proc:
        saving = out / "checkpoints" / ".tmp-step_00000002"
        assert wait_for(lambda: saving.exists() or proc.poll() is not None, 300, 0.05), tail(log)
        assert proc.poll() is None, tail(log)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rc = proc.wait(timeout=180)
        took = time.monotonic() - t0
    text = log.read_text()
    assert rc == 128 + signal.SIGTERM, tail(log)
    assert "stopped by SIGTERM: saved step 3" in text, tail(log)
    assert took < 90, f"{took:.0f} s from SIGTERM to exit\n{tail(log)}"
    assert (out / "checkpoints" / "step_00000003").is_dir()
