"""ZeRO++ and MiCS as config keys (issue 58, part 3): ``deepspeed.zeropp.hpz_partition_size``,
``deepspeed.zeropp.quantized_weights``, ``deepspeed.zeropp.quantized_gradients`` and
``deepspeed.mics_shard_size``.

In process: every refusal, before any process group (config composition, ``config.validate``,
``llama-train``'s ``main()``, its dry run and its sweep check), the DeepSpeed JSON they become,
their resume policy and what the memory planner counts for them.

Through the launcher (slow): hpZ = 2 on a two-"node" CPU job (the two launches of
``launch/local_two_nodes.sh``, forked from the warm parent, 2 x 2 ranks over gloo; the script
itself runs in the docs' rows). What runs on CPU with DeepSpeed 0.19.8 and what does not:

* hpZ runs. Its losses must EQUAL plain ZeRO-3's on the same 4 ranks (tolerance 0): hpZ only
  changes which ranks a weight is all-gathered from (a secondary copy of the same fp32 values
  inside the node) and gathering copies values without arithmetic; the gradient reduce-scatter
  over all ranks is unchanged. A resume from its step-2 checkpoint is bit-identical, and the
  checkpoint (ZeRO-3's partitions over all 4 ranks: hpZ's copy is not saved) loads under plain
  ZeRO-3 on 2 ranks through DeepSpeed's universal conversion, within the 2e-4 that any world
  size change costs (gradients summed in another order: tests/engine/test_zero3.py). Its traffic is
  counted (``comm.count_traffic=true``): every rank's step 3 equals
  ``scaling.traffic.planned_traffic``'s hpZ plan byte for byte per phase, kind and group size
  (the forward all-gather over the 4 ranks, the backward's within the node of 2).
* qwZ and qgZ do not run on CPU: DeepSpeed's quantizer op has no CPU build. qwZ fails in
  ``zero.Init`` at ``deepspeed/runtime/zero/partition_parameters.py:865``
  (``CUDAQuantizer.__init__``: ``QuantizerBuilder().load()``); qgZ, on a job that spans two
  nodes, at ``deepspeed/runtime/comm/coalesced_collectives.py:35`` (``all_to_all_quant_reduce``),
  both raising ``ValueError: This op had not been implemented on CPU backend.``
  (``deepspeed/ops/op_builder/cpu/no_impl.py:21``). On one node DeepSpeed quietly falls back to
  a plain reduce-scatter for qgZ. Refused on CPU before anything starts.
* MiCS does not exist in DeepSpeed 0.19.8 (``runtime/zero/mics.py`` is gone; its config refuses
  ``zero_optimization.mics_shard_size``): refused, whatever the device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import (TINY, compose_cfg, copy_at_step, free_port, losses, metrics, node_cmds,
                     resumed_from, run_main, run_nodes, tail, train)
from llama_train import policy
from llama_train.config import ConfigError, validate
from llama_train.layout import ParallelLayout

ZERO3 = "deepspeed=zero3"
HPZ = "deepspeed.zeropp.hpz_partition_size"
QW = "deepspeed.zeropp.quantized_weights"
QG = "deepspeed.zeropp.quantized_gradients"
MICS = "deepspeed.mics_shard_size"
ON = {HPZ: "2", QW: "true", QG: "true", MICS: "2"}
DS_KEYS = {HPZ: "zero_hpz_partition_size", QW: "zero_quantized_weights",
           QG: "zero_quantized_gradients", MICS: "mics_shard_size"}


def cfg_of(*overrides):
    return compose_cfg(["model=tiny", *overrides])


def refused(*overrides, world=4, device="cpu", per_node=2) -> str:
    """The message of the ConfigError that composing or validating ``overrides`` raises."""
    with pytest.raises(ConfigError) as err:
        validate(cfg_of(*overrides), world, device, ranks_per_node=per_node)
    return str(err.value)


@pytest.fixture
def mics_available(monkeypatch):
    """As if this DeepSpeed had MiCS and our build used it: the checks after that one."""
    import llama_train.config.validation as validation  # where validate looks it up

    monkeypatch.setattr(validation, "mics_unavailable", lambda: None)


# -- the checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(ON))
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_needs_zero3(key, stage):
    with pytest.raises(ConfigError) as err:
        cfg_of(f"deepspeed.zero_stage={stage}", f"{key}={ON[key]}")
    msg = str(err.value)
    assert msg.startswith(f"{key} needs deepspeed.zero_stage=3 (got {stage})"), msg
    assert "set deepspeed.zero_stage=3" in msg and f"or turn {key} off" in msg, msg


@pytest.mark.parametrize("key,value,says", [
    (HPZ, "0", f"{HPZ}=0 must be in [1, 65536]"),
    (HPZ, "65537", f"{HPZ}=65537 must be in [1, 65536]"),
    (MICS, "-1", f"{MICS}=-1 must be in [0, 65536]"),
])
def test_sizes_out_of_range(key, value, says):
    with pytest.raises(ConfigError) as err:
        cfg_of(ZERO3, f"{key}={value}")
    assert says in str(err.value), str(err.value)


@pytest.mark.parametrize("world,per_node,size,says", [
    (6, 6, 4, "does not divide the 6 rank(s)"),
    (8, 2, 4, "does not fit inside a node of 2 rank(s)"),
    # 3 divides the 12 ranks, but groups {3,4,5} and {6,7,8} would span nodes of 4
    (12, 4, 3, "does not fit inside a node of 4 rank(s)"),
    (1, 1, 2, "does not divide the 1 rank(s)"),
])
@pytest.mark.parametrize("key", [HPZ, MICS])
def test_group_must_divide_the_world_and_a_node(key, world, per_node, size, says,
                                                mics_available):
    msg = refused(ZERO3, f"{key}={size}", world=world, per_node=per_node)
    assert msg.startswith(f"{key}={size} {says}"), msg
    assert f"{key}={'1' if key == HPZ else '0'} for off" in msg, msg


@pytest.mark.parametrize("world,per_node,size", [(4, 2, 2), (16, 8, 8), (16, 8, 4), (2, 2, 2)])
def test_groups_that_fit_are_accepted(world, per_node, size, mics_available):
    for key in (HPZ, MICS):
        plan = validate(cfg_of(ZERO3, f"{key}={size}"), world, "cpu", ranks_per_node=per_node)
        assert plan.world_size == world


def test_ranks_per_node_default_is_the_launchers(monkeypatch):
    """validate() without ranks_per_node (the dry run, a sweep's check) reads the ranks per
    node where engine.detect_runtime does: LOCAL_SIZE, then LOCAL_WORLD_SIZE, else one node."""
    cfg = cfg_of(ZERO3, f"{HPZ}=4")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    validate(cfg, 8, "cpu")  # one node of 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="does not fit inside a node of 2 rank"):
        validate(cfg, 8, "cpu")
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher's, first
    validate(cfg, 8, "cpu")


def test_a_simulated_rank_has_no_node():
    """comm.simulate_ranks: one process stands for the job, so only the world is checked."""
    validate(cfg_of(ZERO3, f"{HPZ}=8", "comm.simulate_ranks=64"), 64, "cpu", ranks_per_node=1)
    with pytest.raises(ConfigError, match="does not divide the 60 rank"):
        validate(cfg_of(ZERO3, f"{HPZ}=8", "comm.simulate_ranks=60"), 60, "cpu", ranks_per_node=1)


@pytest.mark.parametrize("key", [QW, QG])
def test_quantized_paths_are_refused_on_cpu(key):
    msg = refused(ZERO3, f"{key}=true")
    assert msg.startswith(f"{key}=true on cpu: "), msg
    for needle in ("CUDA quantizer kernels", "no CPU implementation",
                   "This op had not been implemented on CPU backend", f"set {key}=false"):
        assert needle in msg, (needle, msg)


def test_quantized_paths_are_accepted_on_cuda_and_become_deepspeed_keys():
    from llama_train.engine.ds_config import build_ds_config

    cfg = cfg_of(ZERO3, f"{HPZ}=8", f"{QW}=true", f"{QG}=true", "deepspeed.precision=bf16")
    plan = validate(cfg, 16, "cuda", ranks_per_node=8)
    zero = build_ds_config(cfg.deepspeed, cfg.optim, plan, "cuda", model_dim=64)["zero_optimization"]
    assert (zero["zero_hpz_partition_size"], zero["zero_quantized_weights"],
            zero["zero_quantized_gradients"]) == (8, True, True)


def test_deepspeed_json_is_unchanged_while_they_are_off():
    from llama_train.engine.ds_config import build_ds_config

    for stage in range(4):
        cfg = cfg_of(f"deepspeed.zero_stage={stage}")
        plan = validate(cfg, 1, "cpu")
        zero = build_ds_config(cfg.deepspeed, cfg.optim, plan, "cpu", model_dim=64)["zero_optimization"]
        assert not set(DS_KEYS.values()) & set(zero), zero
    cfg = cfg_of(ZERO3, f"{HPZ}=2")
    plan = validate(cfg, 4, "cpu", ranks_per_node=2)
    zero = build_ds_config(cfg.deepspeed, cfg.optim, plan, "cpu", model_dim=64)["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 2
    assert not {"zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size"} & set(zero)


def test_mics_is_refused_with_this_deepspeed():
    """DeepSpeed 0.19.8 has no MiCS; the message says so and what to use instead."""
    from importlib import metadata

    msg = refused(ZERO3, f"{MICS}=2")
    assert msg.startswith(f"{MICS}=2: MiCS cannot run here: the installed DeepSpeed "
                          f"{metadata.version('deepspeed')} has no MiCS"), msg
    assert f"Set {MICS}=0" in msg and f"{HPZ}=<ranks per node>" in msg, msg


def test_mics_becomes_its_deepspeed_key(mics_available):
    from llama_train.engine.ds_config import build_ds_config

    cfg = cfg_of(ZERO3, f"{MICS}=2")
    plan = validate(cfg, 4, "cuda", ranks_per_node=2)
    zero = build_ds_config(cfg.deepspeed, cfg.optim, plan, "cuda", model_dim=64)["zero_optimization"]
    assert zero["mics_shard_size"] == 2 and "zero_hpz_partition_size" not in zero


def test_hpz_and_mics_together_are_refused():
    with pytest.raises(ConfigError) as err:
        cfg_of(ZERO3, f"{HPZ}=2", f"{MICS}=2")
    msg = str(err.value)
    assert msg.startswith(f"{HPZ}=2 with {MICS}=2: DeepSpeed does not combine them"), msg
    assert f"{HPZ}=1 or {MICS}=0" in msg, msg


def test_hpz_with_sequence_parallelism_is_refused():
    msg = refused(ZERO3, f"{HPZ}=2", "parallel.sequence=2")
    assert msg.startswith(f"{HPZ}=2 with parallel.sequence=2: not verified together"), msg


@pytest.mark.parametrize("key", list(ON))
def test_extra_may_not_set_them_twice(key):
    """deepspeed.extra is DeepSpeed's keys we do not model: these we do (checked per node, per
    device), so the raw DeepSpeed key is refused with ours named."""
    ds_key = DS_KEYS[key]
    with pytest.raises(ConfigError) as err:
        cfg_of(ZERO3, f"deepspeed.extra.zero_optimization.{ds_key}={ON[key]}")
    assert str(err.value).startswith(
        f"deepspeed.extra.zero_optimization.{ds_key}: set {key} instead"), str(err.value)


# -- through llama-train's main(): exit 2, one line, before any process group ---------------------

@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("argv,says", [
    ([ZERO3, f"{HPZ}=2"], f"{HPZ}=2 does not divide the 1 rank(s)"),
    ([ZERO3, f"{QW}=true", "trainer.dry_run=true"], f"{QW}=true on cpu: "),
    (["--multirun", ZERO3, f"{QG}=false,true"],
     f"1 of the 2 jobs of this --multirun sweep cannot run; none was started. job 1 "),
], ids=["train", "dry-run", "sweep"])
def test_refused_through_main(argv, says, tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    flags = [a for a in argv if a.startswith("--")]
    out = tmp_path / "out"
    code, text = run_main([*flags, *TINY, f"trainer.output_dir={out}",
                           *[a for a in argv if not a.startswith("--")]], monkeypatch, capsys)
    assert code == 2, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("llama-train: error:")]
    assert len(errors) == 1 and says in errors[0], text[-3000:]
    assert "Traceback" not in text
    assert not dist.is_initialized() and not out.exists()


# -- on resume --------------------------------------------------------------------------------------

def test_zeropp_may_change_on_resume_mics_defines_the_run():
    from llama_train.job.resume import config_changes, policy_of

    for key in (HPZ, QW, QG):
        assert policy_of(key) == policy.MAY_CHANGE, key
    assert policy_of(MICS) == policy.DEFINES_RUN
    saved = {"deepspeed": {"zeropp": {"hpz_partition_size": 1}, "mics_shard_size": 4}}
    now = {"deepspeed": {"zeropp": {"hpz_partition_size": 8}, "mics_shard_size": 0}}
    defining, safe = config_changes(saved, now)
    assert defining == [(MICS, 4, 0)] and safe == [(HPZ, 1, 8)]
    # a checkpoint from before these keys existed is not compared on them
    assert config_changes({"deepspeed": {"zero_stage": 3}}, now) == ([], [])


# -- the memory planner -------------------------------------------------------------------------------

def test_model_memory_counts_hpz_and_mics():
    from llama_train.model.args import count_params, load_preset
    from llama_train.scaling.memory import model_memory

    psi = count_params(load_preset("llama3_70b"))["total"]
    plain = model_memory("llama3_70b", 3, 512, "bf16")
    hpz = model_memory("llama3_70b", 3, 512, "bf16", hpz_partition_size=8)
    assert hpz["hpz_secondary_params"] == 2 * psi / 8 and plain["hpz_secondary_params"] == 0
    assert hpz["total"] == pytest.approx(plain["total"] + 2 * psi / 8)
    mics = model_memory("llama3_70b", 3, 512, "bf16", mics_shard_size=64)
    assert mics["total"] == pytest.approx(model_memory("llama3_70b", 3, 64, "bf16")["total"])
    assert mics["world_size"] == 512 and mics["mics_shard_size"] == 64


@pytest.mark.parametrize("kwargs,says", [
    (dict(zero_stage=2, hpz_partition_size=8), "needs ZeRO stage 3"),
    (dict(zero_stage=3, world_size=12, hpz_partition_size=8), "must divide world_size=12"),
    (dict(zero_stage=3, world_size=12, mics_shard_size=8), "must divide world_size=12"),
    (dict(zero_stage=3, world_size=16, hpz_partition_size=8, mics_shard_size=8), "together"),
    (dict(zero_stage=3, hpz_partition_size=0), ">= 1"),
])
def test_planner_refuses_what_deepspeed_cannot_run(kwargs, says):
    from llama_train.scaling import ScalingError
    from llama_train.scaling.memory import model_memory, rank_peak_memory

    for fn in (model_memory, rank_peak_memory):
        with pytest.raises(ScalingError, match=says):
            fn("tiny", **kwargs)


def test_rank_peak_counts_hpz_where_deepspeed_holds_it():
    """hpZ's secondary partition, p Psi / H: from zero.Init's build through each step and in a
    resume's load (before the first step), not in a save (dropped after every step)."""
    from llama_train.config import DeepSpeedConfig, ZeroPPConfig
    from llama_train.scaling.memory import HPZ_TERM, rank_peak_memory

    kw = dict(zero_stage=3, world_size=64, dtype="bf16", micro_batch=1, seq_len=4096)
    plain = rank_peak_memory("llama3_8b", **kw)
    hpz = rank_peak_memory("llama3_8b", **kw, hpz_partition_size=8)
    extra = 2 * plain["n_params"] / 8
    for phase, total in plain["phases"].items():
        assert hpz["phases"][phase] == pytest.approx(total + extra), phase
        assert hpz["phase_terms"][phase][HPZ_TERM] == extra
    assert hpz["checkpoint_phases"]["save"] == plain["checkpoint_phases"]["save"]
    assert hpz["checkpoint_phases"]["load"] == pytest.approx(plain["checkpoint_phases"]["load"]
                                                             + extra)
    assert hpz["unpartitioned"] == pytest.approx(plain["unpartitioned"] + extra)
    # read from our deepspeed config when not given (what a simulated rank's report uses)
    ds = DeepSpeedConfig(zero_stage=3, zeropp=ZeroPPConfig(hpz_partition_size=8))
    assert rank_peak_memory("llama3_8b", **kw, ds=ds)["total"] == hpz["total"]
    # MiCS: the partitions of 8 ranks on a world of 64
    mics = rank_peak_memory("llama3_8b", **kw, mics_shard_size=8)
    assert mics["total"] == rank_peak_memory("llama3_8b", **dict(kw, world_size=8))["total"]
    assert mics["world_size"] == 64


def test_a_simulated_ranks_plan_counts_hpz():
    """simulation.planned (the 'planned' column of a comm.simulate_ranks report) asks the planner
    with the run's deepspeed config: hpZ is in it without a change there."""
    from llama_train.config import resolve_batch
    from llama_train.job.simulation import planned
    from llama_train.scaling.memory import HPZ_TERM

    cfg = cfg_of(ZERO3, f"{HPZ}=2", "comm.simulate_ranks=4")
    plan = resolve_batch(cfg.trainer, 4)
    p = planned(cfg, cfg.model, plan, "fp32", ParallelLayout(4, 0), "cpu")
    assert p["phase_terms"]["backward"][HPZ_TERM] == 4 * p["n_params"] / 2


def test_model_info_takes_them():
    from llama_train.scaling.memory import model_info

    a = model_info("llama3_8b", zero_stage=3, world_size=64)
    b = model_info("llama3_8b", zero_stage=3, world_size=64, hpz_partition_size=8)
    psi = a["params"]["total"]
    assert b["model_state"]["bf16"]["total"] == pytest.approx(a["model_state"]["bf16"]["total"]
                                                              + 2 * psi / 8)
    assert b["model_state_total_by_stage"] == a["model_state_total_by_stage"]


# -- two "nodes" of 2 CPU ranks each ---------------------------------------------------------------

# 4 ranks x micro 1 = the global batch of 4; 4 steps, a checkpoint every 2
STEPS = [*TINY, "trainer.micro_batch=1", "trainer.global_batch=4", "trainer.max_steps=4",
         "trainer.save_every=2", "trainer.keep_last=10", ZERO3]


def two_nodes(out: Path, overrides, log_name: str) -> None:
    """Two 'nodes' of 2 ranks each, the two launches ``launch/local_two_nodes.sh`` makes (its
    own runs: tests/system/test_launcher_runs.py, the docs' rows), forked from the warm parent
    (what each rank gets is the real launcher's: tests/system/test_warm_ranks.py's two-node
    test): 4 ranks, node k = ranks 2k, 2k+1."""
    cmds = node_cmds(out.parent / f"{out.name}-hostfile", 2, free_port(),
                     ["--module", "llama_train.train", *STEPS, f"trainer.output_dir={out}",
                      *overrides])
    logs = [out.parent / f"{out.name}-{log_name}-node{k}.log" for k in (0, 1)]
    assert run_nodes(cmds, logs, warm=True) == [0, 0], "\n".join(tail(log) for log in logs)


def hpz_traffic_equals_the_plan(out: Path, overrides) -> None:
    """Every rank's counted step 3 (steps 1-2 carry one-off collectives: see below) equals
    ``planned_traffic`` for this run, per (phase, kind, group size) and per kind.

    One-offs, counted and left out (measured): step 1 gathers every weight, the 9 persistent
    ones included (4608 B), within the node from the secondary partition zero.Init cut, in
    the forward and again in the backward; step 2's forward adds the broadcasts with which
    DeepSpeed checks that every rank traced the same modules; a resumed launch's first step
    gathers over all ranks in its forward, then every weight, persistent ones included, within
    the node in its backward."""
    import json

    from llama_train.comm import counting
    from llama_train.config import resolve_batch
    from llama_train.engine import resolve_precision
    from llama_train.job.simulation import planned_traffic
    from llama_train.scaling.traffic import by_key

    cfg = compose_cfg([*STEPS, f"trainer.output_dir={out}", *overrides])
    plan = planned_traffic(cfg, cfg.model, resolve_batch(cfg.trainer, 4),
                           resolve_precision(cfg.deepspeed, "cpu"), ParallelLayout(4, 0))
    assert "error" not in plan and plan["exact"] and plan["hpz_partition_size"] == 2, plan
    want = by_key(plan["collectives"])
    assert ("backward", "all_gather", 2) in want and ("forward", "all_gather", 4) in want, want
    files = sorted((out / counting.TRAFFIC_DIR).glob("rank_*.json"))
    assert len(files) == 4, files
    for f in files:
        summary = counting.step_summary(json.loads(f.read_text()))
        got = by_key(summary["rows"])
        assert summary["step"] == 3 and got == want and \
            summary["bytes_per_kind"] == plan["bytes_per_kind"], (
            f"{f.name}, step {summary['step']}: counted vs planned bytes per (phase, kind, "
            f"group size):\n" + "\n".join(
                f"  {k}: counted {got.get(k)} planned {want.get(k)}"
                + ("" if got.get(k) == want.get(k) else "  <- differs")
                for k in sorted(set(got) | set(want)))
            + f"\nper kind: counted {summary['bytes_per_kind']} planned {plan['bytes_per_kind']}")


@pytest.mark.slow
def test_hpz_two_nodes_equals_zero3_resumes_exactly_and_loads_under_plain_zero3(tmp_path):
    plain, hpz, resumed = tmp_path / "zero3", tmp_path / "hpz", tmp_path / "hpz_resumed"
    two_nodes(plain, [], "train")
    # hpZ, its traffic counted: stop after step 3 (a steady step to count: steps 1-2 carry
    # one-off collectives), then a second launch resumes its step-2 checkpoint to step 4
    counted = [f"{HPZ}=2", "trainer.steps_this_run=3", "comm.count_traffic=true"]
    two_nodes(hpz, counted, "train")
    assert sorted(losses(hpz)) == [1, 2, 3]
    hpz_traffic_equals_the_plan(hpz, counted)
    copy_at_step(hpz, resumed, 2)
    half = copy_at_step(hpz, tmp_path / "hpz_at_2", 2)  # kept for the plain ZeRO-3 load below
    two_nodes(resumed, [f"{HPZ}=2"], "resume")
    assert resumed_from(resumed) == [str(resumed / "checkpoints" / "step_00000002")]
    # hpZ gathers the same fp32 values from inside the node: bit-identical to plain ZeRO-3,
    # before and after the resume
    assert losses(hpz) == {k: v for k, v in losses(plain).items() if k <= 3}, (
        losses(hpz), losses(plain))
    assert losses(resumed) == losses(plain), (losses(resumed), losses(plain))
    assert list((hpz / "checkpoints" / "step_00000002" / "ds").glob("zero_pp_rank_3_*"))
    # its step-2 checkpoint under plain ZeRO-3 on 2 ranks of one node: a new world size, so
    # through the universal conversion; hpZ off is a logged change, not a refusal
    train(half, [*STEPS[len(TINY):], "trainer.micro_batch=2"], nprocs=2, log_name="plain.log")
    log = (tmp_path / "hpz_at_2-plain.log").read_text()
    assert "converting" in log and "universal" in log, tail(tmp_path / "hpz_at_2-plain.log")
    event = [r for r in metrics(half) if r.get("event") == "resume"][-1]
    assert "convert_s" in event, event
    assert event["config_changes"][HPZ] == [2, 1], event
    after = {k: v for k, v in losses(half).items() if k > 2}
    worst = max(abs(after[k] - losses(plain)[k]) for k in (3, 4))
    assert worst < 2e-4, (after, losses(plain))
