"""The step-time model (scaling.steptime) and what ``llama-plan model-info`` prints from it.

Checked here: the ring formulas and their hierarchical form, the JSON keys, --recommend's
choice. On CPU, gloo's collective times on 2 and 4 ranks against the formulas with the
bandwidth ``llama-bench allreduce`` measures are a benchmark (:func:`gloo_check`, run as a
script), not a test: too unstable on a loaded 2-core host to assert. Not checkable here at all:
NVLink and InfiniBand, NCCL, and how much traffic overlaps compute (docs/scale-out.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script (gloo_check): helpers is in tests/, a level up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import BIN, REPO  # noqa: E402
from llama_train.scaling.cli import main
from llama_train.scaling.steptime import (DATASHEET_PEAK, recommend, ring_time, step_time)
from llama_train.scaling.traffic import planned_traffic


def test_ring_formulas_within_a_node_and_across_nodes():
    s, b = 8e9, 100e9
    assert ring_time("all_reduce", s, 8, 8, b, 1.0) == pytest.approx(2 * 7 / 8 * s / b)
    assert ring_time("all_gather", s, 8, 8, b, 1.0) == pytest.approx(7 / 8 * s / b)
    # 4 nodes of 8: NVLink first, then each GPU's 1/8 of the buffer on its own NIC
    t = ring_time("reduce_scatter", s, 32, 8, 900e9, 50e9)
    assert t == pytest.approx(7 / 8 * s / 900e9 + 3 / 4 * s / (8 * 50e9))
    assert ring_time("all_reduce", s, 1, 1, b, b) == 0.0


def test_the_datasheet_peaks_are_flops_table(monkeypatch):
    import torch

    from llama_train.engine import flops

    for name, peak in DATASHEET_PEAK.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: f"NVIDIA {n} X")
        assert flops._datasheet_flops(torch.device("cuda", 0)) == peak, name


def test_step_time_adds_or_overlaps_compute_and_traffic():
    t = step_time("llama3_8b", world_size=64, zero_stage=3, seq_len=4096, micro_batch=2)
    comm = sum(r["seconds"] for r in t["collectives"])
    assert t["step_time_s"]["no_overlap"] == pytest.approx(t["compute_s"] + comm)
    assert t["step_time_s"]["overlap"] == pytest.approx(max(t["compute_s"], comm))
    assert t["mfu"]["overlap"] == pytest.approx(0.407)  # compute-bound at 64 H100s
    slow = step_time("llama3_8b", world_size=64, zero_stage=3, seq_len=4096, micro_batch=2,
                     inter_node_gbits=25)
    assert slow["step_time_s"]["no_overlap"] > t["step_time_s"]["no_overlap"]
    ckpt = step_time("llama3_8b", world_size=64, zero_stage=3, seq_len=4096, micro_batch=2,
                     checkpointing=True)
    assert ckpt["compute_s"] == pytest.approx(t["compute_s"] * 4 / 3)


def test_model_info_json_has_traffic_and_step_time(capsys):
    assert main(["model-info", "--model", "llama3_8b", "--zero-stage", "3", "--world-size",
                 "512", "--seq-len", "8192", "--inter-node-gbps", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = planned_traffic("llama3_8b", world_size=512, zero_stage=3, seq_len=8192)
    assert out["traffic_bytes_per_step"] == plan["bytes_per_kind"]
    assert set(out["step_time_s"]) == {"overlap", "no_overlap"}
    assert out["step_time"]["settings"]["inter_node_GBps"] == 25.0  # 200 Gb/s


def test_recommend_prefers_what_fits_and_is_fastest(capsys):
    r = recommend("llama3_70b", world_size=512, gpu_mem_bytes=80 * 2**30, seq_len=8192)
    fitting = [x for x in r["rows"] if x["fits"]]
    assert r["best"] in fitting
    assert r["best"]["step_time_s"]["no_overlap"] == min(x["step_time_s"]["no_overlap"]
                                                         for x in fitting)
    assert not any(x["fits"] for x in r["rows"] if x["choice"] == "ZeRO-2")  # 70B: 16 B/param
    tiny = recommend("llama3_70b", world_size=512, gpu_mem_bytes=2**30, seq_len=8192)
    assert tiny["best"] is None and "nothing fits" in tiny["why"]
    assert main(["model-info", "--model", "llama3_8b", "--zero-stage", "3", "--world-size", "64",
                 "--seq-len", "8192", "--recommend"]) == 0
    out = capsys.readouterr().out
    assert "recommend: " in out and "hpZ+qwZ+qgZ" in out and "Gb/s = 50 GB/s" in out


# -- on CPU: gloo's collectives against the formulas ---------------------------------------------
SIZE = 16 * 2**20  # bytes: large enough that latency is small beside bandwidth


def _busbw(nprocs: int, tmp_path) -> float:
    """``llama-bench allreduce``'s busbw (GB/s) for SIZE on ``nprocs`` gloo ranks."""
    out = tmp_path / f"ar{nprocs}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    subprocess.run([str(BIN / "llama-bench"), "allreduce", "--nprocs", str(nprocs), "--sizes",
                    f"{SIZE // 2**20}M", "--no-ring", "--iters", "8", "--warmup", "2", "--json",
                    str(out)], cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["results"]
    return rows[0]["busbw_GBps"]


def _timed_collectives(nprocs: int, tmp_path) -> dict:
    out = tmp_path / f"times{nprocs}.json"
    script = tmp_path / "times.py"
    script.write_text(f"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def rank(r, n, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=n)
    count = {SIZE} // 4
    big, part = torch.ones(count), torch.ones(count // n)
    ops = {{"all_reduce": lambda: dist.all_reduce(big),
           "all_gather": lambda: dist.all_gather_into_tensor(big, part),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, big)}}
    times = {{}}
    for name, op in ops.items():
        ts = []
        for i in range(10):
            dist.barrier(); t0 = time.perf_counter(); op(); ts.append(time.perf_counter() - t0)
        t = torch.tensor(ts[2:], dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = statistics.median(t.tolist())
    if r == 0:
        open(out, "w").write(json.dumps(times))
    dist.destroy_process_group()

if __name__ == "__main__":
    n, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(rank, args=(n, port, out), nprocs=n)
""")
    from helpers import free_port

    subprocess.run([sys.executable, str(script), str(nprocs), str(free_port()), str(out)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    return json.loads(out.read_text())


def gloo_check(nprocs: int, tmp_path) -> dict:
    """The bandwidth B from llama-bench allreduce (busbw: all-reduce time = 2(n-1)/n S / B),
    then all-reduce, all-gather and reduce-scatter of the same S timed on ``nprocs`` gloo
    ranks: measured / modelled for each. A benchmark, not a test: on this 2-core host under
    load 10-18 two runs of the same check differed 3x in B and 10x in the ratios (see
    docs/scale-out.md), so no tolerance would be both honest and stable here.

        .venv/bin/python tests/scaling/test_steptime.py 2 4
    """
    b = _busbw(nprocs, tmp_path) * 1e9
    measured = _timed_collectives(nprocs, tmp_path)
    return {"nprocs": nprocs, "busbw_GBps": b / 1e9, "seconds": measured,
            "measured_over_model": {kind: t / ring_time(kind, SIZE, nprocs, nprocs, b, b)
                                    for kind, t in measured.items()},
            "loadavg_1m": os.getloadavg()[0]}


if __name__ == "__main__":
    import tempfile

    for n in [int(a) for a in sys.argv[1:]] or [2, 4]:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(gloo_check(n, Path(d))))
