"""comm.simulate_ranks: one rank of a 64- or 512-rank job, run in this process on the real path.

The partition a simulated rank holds is DeepSpeed's for the job's size (ZeRO-3: every parameter
split ceil(numel / N); ZeRO-1/2: the flat group split in N equal parts), its checkpoint holds
its own shard and resumes exactly, its report names every phase beside the planner, and what
only a real job may do (a launcher, a real job continuing its checkpoint) is refused. The
comparison with a real 2-rank launch is in test_zero3.py, beside that launch.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from helpers import REPO, cfg_for, rows, world_of_one
from llama_train.config import ConfigError
from llama_train.job.resume import ResumeRefused
from llama_train.model import Transformer
from llama_train.train import train

SIM = ["trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=1000",
       "sample.tokens=8"]


@pytest.fixture(autouse=True)
def own_group():
    """Each test starts without a process group and ends its own (helpers.world_of_one
    restores the launcher variables the simulation set)."""
    with world_of_one():
        yield


def fp32_partitions(ckpt, rank: int):
    """The fp32 master partition's elements per parameter group, from rank ``rank``'s optimizer
    file of a checkpoint."""
    (f,) = (ckpt / "ds").glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    state = torch.load(f, weights_only=False, map_location="cpu")["optimizer_state_dict"]
    groups = state.get("fp32_flat_groups") or state.get("single_partition_of_fp32_groups")
    return [t.numel() for t in groups]


def zero3_partitions(cfg, world: int):
    """What DeepSpeed's ZeRO-3 gives every rank of ``world``: ceil(numel / world) elements of
    each parameter, per optimizer group (decayed matrices, then the rest)."""
    from llama_train.job.optim import param_groups

    with torch.device("meta"):
        model = Transformer(cfg.model)
    return [sum(math.ceil(p.numel() / world) for p in g["params"])
            for g in param_groups(model, cfg.optim)]


@pytest.mark.parametrize("world,rank", [(64, 0), (512, 511)])
@pytest.mark.slow
def test_zero3_rank_holds_its_share_of_a_real_job(tmp_path, world, rank):
    cfg = cfg_for(tmp_path / "out", *SIM, "deepspeed.zero_stage=3",
                  f"comm.simulate_ranks={world}", f"comm.simulate_rank={rank}")
    assert train(cfg)["step"] == 4
    ckpt = tmp_path / "out" / "checkpoints" / "step_00000004"
    assert fp32_partitions(ckpt, rank) == zero3_partitions(cfg, world)
    # only this rank's shard was written
    assert {p.name for p in (ckpt / "ds").iterdir()} == {
        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
        f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"}
    assert [p.name for p in (ckpt / "ranks").iterdir()] == [f"rank_{rank:05d}.pt"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.slow
def test_the_last_rank_saves_though_its_padding_is_garbage(tmp_path, stage):
    """DeepSpeed pads each ZeRO-3 partition with uninitialised memory; on rank 511 of 512 a
    128-element norm weight's partition is all padding. With torch filling uninitialised memory
    with NaN, the save's finiteness check must look only at real weights (it refused the save,
    "weights at step 2 are not finite", before), and the run must train on."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        cfg = cfg_for(tmp_path / "out", *SIM, f"deepspeed.zero_stage={stage}",
                      "comm.simulate_ranks=512", "comm.simulate_rank=511")
        assert train(cfg)["step"] == 4
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    assert (tmp_path / "out" / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [64, 512])
@pytest.mark.slow
def test_zero12_rank_holds_one_nth_of_the_flat_group(tmp_path, stage, world):
    cfg = cfg_for(tmp_path / "out", *SIM, f"deepspeed.zero_stage={stage}",
                  f"comm.simulate_ranks={world}", "comm.simulate_rank=3")
    train(cfg)
    parts = fp32_partitions(tmp_path / "out" / "checkpoints" / "step_00000004", 3)
    with torch.device("meta"):
        from llama_train.job.optim import param_groups

        groups = param_groups(Transformer(cfg.model), cfg.optim)
    for part, g in zip(parts, groups):
        numel = sum(p.numel() for p in g["params"])
        # DeepSpeed pads the flat group to a multiple of N (and its alignment), then splits it
        assert part == math.ceil(numel / world) or 0 <= part * world - numel < world * 8, \
            (part, numel, world)


@pytest.mark.parametrize("overrides", [
    ["deepspeed.zero_stage=0"],
    ["deepspeed.zero_stage=3", "deepspeed.precision=bf16", "model.activation_checkpointing=true",
     "trainer.eval_every=2"],
], ids=["zero0-fp32", "zero3-bf16-checkpointing-eval"])
@pytest.mark.slow
def test_other_settings_run_as_a_simulated_rank(tmp_path, overrides):
    out = tmp_path / "out"
    result = train(cfg_for(out, *SIM, "comm.simulate_ranks=64", "comm.simulate_rank=63",
                           *overrides))
    assert result["step"] == 4 and len(result["losses"]) == 4
    assert all(math.isfinite(v) for v in result["losses"].values())
    recorded = rows(out)
    assert [r["step"] for r in recorded if "rank_loss" in r] == [1, 2, 3, 4]
    if "trainer.eval_every=2" in overrides:
        assert [r["step"] for r in recorded if "rank_val_loss" in r] == [2, 4]


@pytest.mark.slow
def test_a_simulated_rank_resumes_exactly_and_reports_every_phase(tmp_path):
    """A 64-rank ZeRO-3 job's rank 3: 4 steps, then 2 more from its step-4 checkpoint, give the
    losses of 6 uninterrupted steps bit for bit; the report names every phase with the
    planner's figure beside the measured ones, and the checkpoint's bytes."""
    sim = ["deepspeed.zero_stage=3", "comm.simulate_ranks=64", "comm.simulate_rank=3",
           "trainer.save_every=2", "trainer.eval_every=1000"]
    whole = train(cfg_for(tmp_path / "whole", *sim, "trainer.max_steps=6"))
    train(cfg_for(tmp_path / "split", *sim, "trainer.max_steps=4"))
    resumed = train(cfg_for(tmp_path / "split", *sim, "trainer.max_steps=6"))
    assert resumed["losses"] == {k: v for k, v in whole["losses"].items() if k > 4}
    assert whole["sample"] is None  # no sample: mirrored weights write nothing true

    recorded = [r for r in rows(tmp_path / "whole") if "rank_loss" in r]
    assert [r["step"] for r in recorded] == list(range(1, 7))
    assert not any("loss" in r or "val_loss" in r for r in rows(tmp_path / "whole"))

    info = json.loads((tmp_path / "whole" / "run_info.json").read_text())
    sim_report = info["simulation"]
    assert (sim_report["ranks"], sim_report["rank"]) == (64, 3)
    phases = {p["phase"]: p for p in sim_report["phases"]}
    assert {"build", "initialize", "save", "load", "step1 forward", "step1 backward",
            "step1 step", "step3 step"} <= set(phases)
    assert "step4 forward" not in phases  # the first three steps only
    for name in ("build", "initialize", "step1 backward", "step1 step"):
        p = phases[name]
        assert p["planned_bytes"] > 0 and p["ratio"] == p["peak_bytes"] / p["planned_bytes"]
    assert all(p["seconds"] > 0 for p in phases.values())
    ckpt = tmp_path / "whole" / "checkpoints" / "step_00000002"
    own = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()
              and ("zero_pp_rank_3_" in f.name or f.name == "rank_00003.pt"))
    assert sim_report["checkpoint"]["rank_bytes"] == own
    assert sim_report["checkpoint"]["job_bytes"] == 64 * own + sim_report["checkpoint"]["rank0_bytes"]
    assert sim_report["command_to_first_step_s"] > 0
    assert info["final_val_loss"] is None

    resumed_info = json.loads((tmp_path / "split" / "run_info.json").read_text())
    names = [p["phase"] for p in resumed_info["simulation"]["phases"]]
    assert "load" in names and "step5 forward" in names and "step1 forward" not in names


@pytest.mark.slow
def test_a_simulated_rank_states_its_own_mfu_and_no_sample(tmp_path):
    """A simulated rank is one process on one device: MFU against that device's peak (never N
    devices'), of its own 1/N of each step's tokens, said at start; and the sample it switches
    off leaves no "sample:" line and no sample.txt."""
    import logging

    from llama_train.model import flops_per_token

    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("llama_train")
    logger.addHandler(handler)
    out = tmp_path / "out"
    cfg = cfg_for(out, "trainer.max_steps=2", "trainer.save_every=1000",
                  "trainer.eval_every=1000", "trainer.log_every=1", "trainer.peak_flops=1e12",
                  "comm.simulate_ranks=64", "comm.simulate_rank=5")
    try:
        train(cfg)
    finally:
        logger.removeHandler(handler)
    info = json.loads((out / "run_info.json").read_text())
    assert info["peak_flops"]["value"] == 1e12  # one device's, as given: not 64 x
    fpt = flops_per_token(cfg.model, cfg.trainer.seq_len)
    steps = [r for r in rows(out) if "rank_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # tokens_per_s is the job's (64 ranks at this one's pace): 1/64 is its own
        assert math.isclose(r["mfu"], fpt * r["tokens_per_s"] / 64 / 1e12, rel_tol=1e-9)
    start = next(m for m in said if m.startswith("model: "))
    assert "MFU of this simulated rank (its 1/64 of each step's tokens" in start, start
    assert "on one device against 1e+12 FLOP/s (trainer.peak_flops)" in start, start
    assert not any(m.startswith("sample:") for m in said), [m for m in said if "sample" in m]
    assert not (out / "sample.txt").exists()


@pytest.mark.slow
def test_a_real_job_never_continues_a_simulated_rank(tmp_path):
    sim = ["comm.simulate_ranks=64", "comm.simulate_rank=3", "trainer.max_steps=2",
           "trainer.save_every=2", "trainer.eval_every=1000"]
    train(cfg_for(tmp_path / "out", *sim))
    for other in ([], ["comm.simulate_ranks=64", "comm.simulate_rank=4"]):
        with pytest.raises(ResumeRefused, match="simulated rank 3 of 64"):
            train(cfg_for(tmp_path / "out", "trainer.max_steps=4", *other))


@pytest.mark.slow
def test_a_simulation_leaves_later_launched_ranks_alone(tmp_path):
    """After a simulated rank ran in this process (a test runner), a rank that this process
    launches later is the rank its launcher says: a marker the simulation once left in the
    environment made every such rank rank 0 of a world of one (EADDRINUSE, a held lock)."""
    import os
    import sys

    train(cfg_for(tmp_path / "out", *SIM, "trainer.max_steps=2", "comm.simulate_ranks=64"))
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
           "CROSS_RANK": "0"}
    code = ("from llama_train.engine import detect_runtime; "
            "rt = detect_runtime('cpu'); print(rt.rank, rt.world_size)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[-2:] == ["1", "2"]


@pytest.mark.parametrize("overrides,key", [
    (["comm.simulate_ranks=1"], "comm.simulate_ranks=1"),
    (["comm.simulate_ranks=-4"], "comm.simulate_ranks=-4"),
    (["comm.simulate_rank=3"], "comm.simulate_rank=3 needs comm.simulate_ranks"),
    (["comm.simulate_ranks=64", "comm.simulate_rank=64"], "use 0 .. 63"),
])
def test_bad_simulation_settings_name_the_key(tmp_path, overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        cfg_for(tmp_path, *overrides)


def test_a_launched_process_refuses_to_simulate(tmp_path, monkeypatch):
    """Under a launcher (deepspeed sets CROSS_RANK) the option is refused before anything
    starts: a launched job that simulated would have each of its ranks pretend to be the
    whole job."""
    monkeypatch.setenv("CROSS_RANK", "0")
    with pytest.raises(ConfigError, match="started by a launcher .CROSS_RANK"):
        train(cfg_for(tmp_path / "out", "comm.simulate_ranks=64"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_deepspeed_launcher_refuses_the_option(tmp_path):
    """Through the real launcher: exit 2 and the one line, nothing written."""
    from helpers import TINY, _env, launcher_cmd

    out = tmp_path / "out"
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", "comm.simulate_ranks=64"], 1)
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert "runs one rank of a 64-rank job in this single process" in text, text[-3000:]
    assert "exits with return code = 2" in text or "exit code 2" in text or proc.returncode == 2, \
        text[-3000:]
    assert not out.exists()


def test_a_cuda_ranks_table_shows_the_allocators_reserve():
    """On CUDA the peak is max_memory_allocated above idle and the reserve (what the device must
    hold, max_memory_reserved above idle) is printed beside it; a CPU report has no such column."""
    from llama_train.job.simulation import format_table

    gib = 2 ** 30
    row = {"phase": "step1 backward", "peak_bytes": 3 * gib, "planned_bytes": 3 * gib,
           "ratio": 1.0, "seconds": 0.5}
    cuda = {"rank": 0, "ranks": 64, "device": "cuda", "measure": "torch.cuda.max_memory_allocated",
            "phases": [{**row, "reserved_bytes": 4 * gib}], "peak_bytes": 3 * gib,
            "peak_phase": "step1 backward", "planned_peak_bytes": 3 * gib,
            "peak_reserved_bytes": 4 * gib, "planner_error": None, "checkpoint": None,
            "command_to_first_step_s": None}
    table = format_table(cuda).splitlines()
    assert "max_memory_reserved" in table[0] and table[1].split()[-1] == "reserved"
    assert table[2].split()[-1] == "4.000" and table[3].split()[-1] == "4.000"
    cpu = {**cuda, "device": "cpu", "measure": "VmHWM - idle VmRSS", "phases": [row]}
    del cpu["peak_reserved_bytes"]
    assert "reserved" not in format_table(cpu)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_simulated_rank_runs_on_a_gpu(tmp_path):
    """The first GPU run died in zero.Init's first all-gather on CUDA; a 64-rank ZeRO-3 bf16
    rank trains there and reports CUDA's allocator figures."""
    out = tmp_path / "out"
    result = train(cfg_for(out, *SIM, "deepspeed.zero_stage=3", "deepspeed.precision=bf16",
                           "trainer.device=cuda", "comm.simulate_ranks=64"))
    assert result["step"] == 4
    report = json.loads((out / "run_info.json").read_text())["simulation"]
    assert report["device"] == "cuda" and report["measure"] == "torch.cuda.max_memory_allocated"
    assert report["peak_reserved_bytes"] >= report["peak_bytes"] > 0
