"""Several processes at once: concurrent prepare (file lock) and ranks under the DeepSpeed launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from llama_train.data import TrainLoader

from llama_train.proc import kill_session

from helpers import BIN, free_port

def write_corpus(path: Path) -> None:
    import pydoc_data.topics as t

    docs = [t.topics[k] for k in sorted(t.topics)[:30]]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


PREPARE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    go = Path(sys.argv[2])
    from llama_train.data import DataConfig, prepare_data
    Path(sys.argv[3]).touch()                      # ready
    while not go.exists():
        time.sleep(0.01)
    p = prepare_data(DataConfig(name="conc", source=sys.argv[1], val_fraction=0.1, num_proc=1), 512)
    print(json.dumps({"dir": p.dir, "created": p.created, "sha": p.meta["tokenizer"]["sha256"]}))
""")

RANK = textwrap.dedent("""
    import argparse, json, os, torch, torch.distributed as dist
    from llama_train.data import DataConfig, TrainLoader, prepare_data
    from llama_train.engine import init_distributed
    ap = argparse.ArgumentParser(); ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("src"); ap.add_argument("out"); a = ap.parse_args()
    # every rank prepares before the process group exists; the lock makes one of them do it
    prep = prepare_data(DataConfig(name="ds", source=a.src, val_fraction=0.1, num_proc=1), 512)
    init_distributed(device_type="cpu")
    r, w = dist.get_rank(), dist.get_world_size()
    L = TrainLoader(prep.dir, 16, 8, 2, r, w, seed=3, num_workers=1)
    it = iter(L)
    xs = [next(it)[0] for _ in range(3 * 8 // (2 * w))]
    torch.save({"x": torch.stack(xs), "state": L.state_dict(), "dir": prep.dir, "created": prep.created},
               os.path.join(a.out, f"rank{r}.pt"))
    dist.barrier()
""")


@contextmanager
def _group(cmds, env):
    """Start processes in their own sessions; always kill the whole groups."""
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c in cmds]
    try:
        yield procs
    finally:
        for p in procs:
            kill_session(p)


def _communicate(cmd, env, timeout):
    """Run one command to its end (killed with its group whatever happens): (rc, stdout, stderr)."""
    with _group([cmd], env) as (proc,):
        out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.slow
def test_two_processes_prepare_once(tmp_path):
    src = tmp_path / "docs.jsonl"
    write_corpus(src)
    env = {**os.environ, "LLAMA_TRAIN_CACHE": str(tmp_path / "cache"), "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    go = tmp_path / "go"
    cmds = [[sys.executable, "-c", PREPARE, str(src), str(go), str(tmp_path / f"ready{i}")] for i in range(2)]
    with _group(cmds, env) as procs:
        deadline = time.time() + 60
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert time.time() < deadline and all(p.poll() is None for p in procs), "workers did not start"
            time.sleep(0.05)
        go.touch()  # both start preparing at the same moment
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["dir"] == outs[1]["dir"] and outs[0]["sha"] == outs[1]["sha"]
    assert sorted(o["created"] for o in outs) == [False, True], outs
    cache = tmp_path / "cache"
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [Path(outs[0]["dir"]).name]


@pytest.mark.slow
def test_deepspeed_ranks_prepare_and_split_the_stream(tmp_path):
    src = tmp_path / "docs.jsonl"
    write_corpus(src)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LLAMA_TRAIN_CACHE": str(tmp_path / "cache"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(script), str(src), str(out)]
    rc, stdout, stderr = _communicate(cmd, env, timeout=300)
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["dir"] == ranks[1]["dir"]
    assert sorted(r["created"] for r in ranks) == [False, True]
    assert all(r["state"]["consumed_samples"] == 24 for r in ranks)
    # the union of the ranks' rows, batch by batch, is the single-process global stream
    ref = TrainLoader(ranks[0]["dir"], 16, 8, 8, 0, 1, seed=3, num_workers=0)
    it = iter(ref)
    for step in range(3):
        want = next(it)[0]
        got = torch.cat([r["x"][step * 2 : step * 2 + 2].reshape(-1, 16) for r in ranks])
        assert torch.equal(got, want), step


UNGUARDED = textwrap.dedent("""
    import sys
    from llama_train.data import DataConfig, DataError, prepare_data
    # no `if __name__ == "__main__":` guard: spawned workers re-import this file
    try:
        prepare_data(DataConfig(source=sys.argv[1], val_fraction=0.1, num_proc=2,
                                prepared_dir=sys.argv[2]), 512)
    except DataError as e:
        print("DataError:", e)
        sys.exit(3)
""")


@pytest.mark.slow
def test_unguarded_script_with_workers_fails_clearly_not_deadlocks(tmp_path):
    src = tmp_path / "docs.jsonl"
    write_corpus(src)
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    rc, out, err = _communicate([sys.executable, str(script), str(src), str(tmp_path / "prep")], env,
                                timeout=120)
    assert rc == 3, out + err
    assert "__main__" in out and "num_proc=1" in out
    assert not (tmp_path / "prep").exists()
