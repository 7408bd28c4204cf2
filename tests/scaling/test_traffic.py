"""Planned, simulated and real traffic: the bytes every collective of one optimizer step moves.

``scaling.traffic.planned_traffic`` writes down what DeepSpeed runs; a simulated rank
(``comm.simulate_ranks``, MirrorGroup counting what it is asked) and real gloo launches
(``comm.count_traffic=true``, our wrapper around torch.distributed) count it; the three agree
byte for byte per (phase, kind, group size) at ZeRO-1, 2 and 3, and with ZeRO++'s hpZ (a simulated
rank here; the real two-"node" launch in tests/engine/test_zeropp.py). Sequence parallelism cannot be
simulated (refused with comm.simulate_ranks), so there the plan meets the real launch alone.
"""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.distributed as dist

from helpers import cfg_for, train as launch, world_of_one
from llama_train.comm import counting, simulate
from llama_train.config import resolve_batch
from llama_train.job.simulation import format_table, planned_traffic as planned_for_run
from llama_train.layout import ParallelLayout
from llama_train.scaling import ScalingError
from llama_train.scaling.traffic import by_key, optimizer_groups, planned_traffic


# -- the planner ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "llama3_8b"])
def test_the_optimizer_groups_are_those_adamw_gets(preset):
    """ZeRO-1/2 pad each optimizer group: the planner's groups are optim.param_groups' sizes."""
    from llama_train.config import OptimConfig
    from llama_train.job.optim import param_groups
    from llama_train.model import Transformer
    from llama_train.model.args import load_preset

    args = load_preset(preset)
    with torch.device("meta"):
        model = Transformer(args)
    want = [sum(p.numel() for p in g["params"]) for g in param_groups(model, OptimConfig())]
    assert optimizer_groups(args) == want


def test_zero2_reduces_every_micro_batch_and_zero1_once():
    z1 = [planned_traffic("tiny", world_size=4, zero_stage=1, dtype="fp32", grad_accum=a)
          for a in (1, 3)]
    z2 = [planned_traffic("tiny", world_size=4, zero_stage=2, dtype="fp32", grad_accum=a)
          for a in (1, 3)]
    psi = z1[0]["n_params"]
    assert z1[0]["bytes_per_phase"]["backward"] == z1[1]["bytes_per_phase"]["backward"] == 4 * psi
    assert z2[1]["bytes_per_phase"]["backward"] == 3 * z2[0]["bytes_per_phase"]["backward"]


def test_zero3_pads_every_parameter_to_the_world_size():
    """tiny's k/v matrices hold 8192 elements: 3 ranks gather 8193 of each."""
    three = planned_traffic("tiny", world_size=3, zero_stage=3, dtype="fp32")
    four = planned_traffic("tiny", world_size=4, zero_stage=3, dtype="fp32")
    rs3 = by_key(three["collectives"])[("backward", "reduce_scatter", 3)]
    rs4 = by_key(four["collectives"])[("backward", "reduce_scatter", 4)]
    assert rs4 == 4 * four["n_params"]
    assert rs3 > rs4


def test_hpz_mics_and_quantization_move_bytes_off_the_world_group():
    base = planned_traffic("llama3_8b", world_size=64, zero_stage=3)
    hpz = planned_traffic("llama3_8b", world_size=64, zero_stage=3, hpz_partition_size=8)
    mics = planned_traffic("llama3_8b", world_size=64, zero_stage=3, mics_shard_size=8)
    q = planned_traffic("llama3_8b", world_size=64, zero_stage=3, hpz_partition_size=8,
                        quantized_weights=True, quantized_gradients=True, gpus_per_node=8)

    def world_bytes(r):
        return sum(b for (_, _, g), b in by_key(r["collectives"]).items() if g == 64)

    assert base["exact"] and hpz["exact"]  # hpZ is counted; MiCS and quantization are not
    assert not mics["exact"] and not q["exact"]
    assert world_bytes(hpz) < world_bytes(base)
    assert world_bytes(mics) < world_bytes(hpz)
    assert q["total_bytes"] < hpz["total_bytes"]
    with pytest.raises(ScalingError, match="zero_stage=3"):
        planned_traffic("tiny", world_size=4, zero_stage=2, hpz_partition_size=2)
    with pytest.raises(ScalingError, match="divide"):
        planned_traffic("tiny", world_size=6, zero_stage=3, mics_shard_size=4)


def test_hpz_gathers_the_first_forward_over_all_ranks_and_the_rest_within_its_group():
    """hpZ keeps a secondary partition of each released weight within h ranks until the
    optimizer step: one forward over N, the a - 1 later forwards and all a backwards within h
    (counted: a simulated rank below, a real two-"node" launch in test_zeropp.py)."""
    from llama_train.config import DeepSpeedConfig, ZeroPPConfig

    plain = by_key(planned_traffic("tiny", world_size=6, zero_stage=3, dtype="fp32",
                                   grad_accum=3)["collectives"])
    hpz = planned_traffic("tiny", world_size=6, zero_stage=3, dtype="fp32", grad_accum=3,
                          hpz_partition_size=3)
    w = plain[("forward", "all_gather", 6)] // 3  # one micro-batch's gathered weights
    assert by_key(hpz["collectives"]) == {
        ("forward", "all_gather", 6): w, ("forward", "all_gather", 3): 2 * w,
        ("backward", "all_gather", 3): 3 * w,
        **{k: b for k, b in plain.items() if k[1] != "all_gather" or k[0] == "step"}}
    assert hpz["exact"] and hpz["total_bytes"] == sum(plain.values())
    # read from our deepspeed config when not given (what a run's plan uses)
    ds = DeepSpeedConfig(zero_stage=3, zeropp=ZeroPPConfig(hpz_partition_size=3))
    assert planned_traffic("tiny", world_size=6, zero_stage=3, dtype="fp32", grad_accum=3,
                           ds=ds)["collectives"] == hpz["collectives"]


# -- the counters --------------------------------------------------------------------------------
def test_a_mirror_group_counts_what_it_is_asked():
    with world_of_one():
        simulate.init(1, 4, datetime.timedelta(seconds=30))
        c = counting.start()
        c.set_phase("backward")
        dist.all_reduce(torch.ones(10))
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(2))
        dist.reduce_scatter_tensor(torch.empty(3, dtype=torch.float64),
                                   torch.ones(12, dtype=torch.float64))
        c.step_done()
        rows = c.to_dict()["steps"]["1"]
        counting.stop()
    assert by_key(rows) == {("backward", "all_reduce", 4): 40, ("backward", "all_gather", 4): 32,
                            ("backward", "reduce_scatter", 4): 96}


def test_the_wrapper_counts_each_call_once_and_is_removed():
    with world_of_one():
        c = counting.install()
        try:
            dist.init_process_group("gloo", rank=0, world_size=1)
            c.set_phase("step")
            dist.all_reduce(torch.ones(5))
            dist.all_gather_into_tensor(torch.empty(4), torch.ones(4))
            dist._all_gather_base(torch.empty(4), torch.ones(4))  # calls the one above inside
            rows = c.to_dict()["steps"]["1"]
        finally:
            counting.uninstall()
        assert not getattr(dist.all_reduce, "__wrapped_by_llama_train__", False)
        assert counting.active() is None
    assert {(r["kind"], r["calls"], r["bytes"]) for r in rows} == {("all_reduce", 1, 20),
                                                                   ("all_gather", 2, 32)}


def test_the_simulation_table_shows_the_traffic_beside_the_plan():
    report = {"rank": 0, "ranks": 4, "device": "cpu", "measure": "VmHWM", "phases": [],
              "peak_bytes": 1, "peak_phase": "step", "planned_peak_bytes": None,
              "planner_error": None, "checkpoint": None, "command_to_first_step_s": None,
              "traffic": {"step": 3, "equal": False, "all_steps_equal": True,
                          "bytes_per_kind": {"all_gather": 2_000_000},
                          "planned_bytes_per_kind": {"all_gather": 1_000_000,
                                                     "all_reduce": 40}}}
    text = format_table(report)
    assert "all_gather" in text and "2.000000" in text and "1.000000" in text
    assert "(differs)" in text and "NOT equal to the plan" in text


# -- planned = simulated = real ------------------------------------------------------------------
def _steady(counted):
    return by_key(counting.step_summary(counted)["rows"])


def _plan_of(cfg, world):
    from llama_train.engine import resolve_precision

    precision = resolve_precision(cfg.deepspeed, "cpu")
    batch = resolve_batch(cfg.trainer, world // cfg.parallel.sequence)  # data-parallel ranks
    layout = ParallelLayout(world, 0, cfg.parallel.sequence)
    return by_key(planned_for_run(cfg, cfg.model, batch, precision, layout)["collectives"])


def _simulated(tmp_path, world, overrides):
    from llama_train.train import train

    out = tmp_path / f"sim{world}"
    with world_of_one():
        cfg = cfg_for(out, "trainer.max_steps=3", "sample.tokens=0", "trainer.micro_batch=2",
                      f"comm.simulate_ranks={world}", *overrides)
        train(cfg)
    return json.loads((out / "run_info.json").read_text())["simulation"]["traffic"], cfg


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides", [
    (3, ["deepspeed.zero_stage=1"]),
    (3, ["deepspeed.zero_stage=2", "trainer.global_batch=12"]),  # 2 micro-batches
    (3, ["deepspeed.zero_stage=3", "trainer.global_batch=12"]),
    (3, ["deepspeed.zero_stage=2", "deepspeed.precision=bf16"]),
    (3, ["deepspeed.zero_stage=3", "deepspeed.precision=bf16"]),
    # hpZ within 3 of 6 ranks, 2 micro-batches: the second forward gathers within the 3
    (6, ["deepspeed.zero_stage=3", "deepspeed.zeropp.hpz_partition_size=3",
         "trainer.global_batch=24"]),
])
def test_a_simulated_rank_counts_what_the_planner_plans(tmp_path, world, overrides):
    """3 (and 6) ranks: every padding shows (tiny's matrices do not divide by 3)."""
    traffic, cfg = _simulated(tmp_path, world, overrides)
    assert traffic["all_steps_equal"] and traffic["equal"], traffic
    assert by_key(traffic["rows"]) == _plan_of(cfg, world)
    assert traffic["bytes_per_kind"] == traffic["planned_bytes_per_kind"]


def _real(tmp_path, nprocs, overrides):
    out = tmp_path / f"real{nprocs}"
    launch(out, ["trainer.max_steps=3", "sample.tokens=0", "comm.count_traffic=true",
                 *overrides], nprocs=nprocs, timeout=600)
    files = sorted((out / counting.TRAFFIC_DIR).glob("rank_*.json"))
    assert len(files) == nprocs
    counted = [json.loads(f.read_text()) for f in files]
    assert all(c["steps_done"] == 3 for c in counted)
    assert all(counting.step_summary(c)["all_steps_equal"] for c in counted)
    return [_steady(c) for c in counted]


@pytest.mark.slow
@pytest.mark.parametrize("nprocs,overrides", [
    (2, ["deepspeed.zero_stage=1"]),
    (2, ["deepspeed.zero_stage=2", "trainer.global_batch=8"]),  # 2 micro-batches per step
    (4, ["deepspeed.zero_stage=3"]),
])
def test_planned_simulated_and_real_traffic_agree(tmp_path, nprocs, overrides):
    ranks = _real(tmp_path, nprocs, overrides)
    traffic, cfg = _simulated(tmp_path, nprocs, overrides)
    plan = _plan_of(cfg, nprocs)
    assert all(r == plan for r in ranks), (ranks[0], plan)
    assert by_key(traffic["rows"]) == plan


@pytest.mark.slow
def test_sequence_parallel_all_to_alls_are_planned(tmp_path):
    """parallel.sequence=2 on 2 ranks, ZeRO-3: Ulysses' all-to-alls beside ZeRO's collectives
    (a simulated rank refuses sequence parallelism: plan and real launch only)."""
    overrides = ["deepspeed.zero_stage=3", "parallel.sequence=2"]
    ranks = _real(tmp_path, 2, overrides)
    cfg = cfg_for(tmp_path / "cfg", "trainer.micro_batch=2", *overrides)
    plan = _plan_of(cfg, 2)
    assert ("forward", "all_to_all", 2) in plan
    assert all(r == plan for r in ranks), (ranks[0], plan)
