"""llama_train.comm, the all-reduce benchmark and the launch scripts.

Multi-process tests start the real `deepspeed` launcher over gloo (DS_ACCELERATOR=cpu), each in
its own session that is killed whole whatever happens; the all-reduce benchmark's relaunch of
itself runs forked from the warm parent (tests/warm_ranks.py), DeepSpeed's runner and launcher
deciding its ranks as the real command does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from llama_train.bench import allreduce as bench
from llama_train.comm import CommConfig, apply_env, configure_backend, normalize_nccl_algo, ring_all_reduce
import helpers
from helpers import BIN, REPO, WORKERS, free_port

WORKER = WORKERS / "comm_worker.py"
LAUNCH = REPO / "launch"
NCCL_VARS = ("NCCL_ALGO", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE")
LAUNCH_TIMEOUT_S = 240  # normally 10-25 s; a first DeepSpeed CPU comm-op JIT build adds ~60 s


@pytest.fixture
def clean_nccl_env(monkeypatch):
    """No NCCL variable set, and those the code under test sets gone again after it (a delenv of
    an absent variable records nothing to undo: NCCL_ALGO stayed in this process's environment,
    and the next launch needed a warm parent of its own, tests/helpers.py)."""
    for var in (*NCCL_VARS, "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return monkeypatch


# ---------------------------------------------------------------- backend / env configuration

def test_configure_backend_cuda_sets_nccl_algo(clean_nccl_env):
    assert configure_backend("cuda", "ring") == "nccl"
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert configure_backend("cuda:1", "Tree,RING") == "nccl"
    assert os.environ["NCCL_ALGO"] == "Tree,Ring"


def test_configure_backend_cpu_leaves_env(clean_nccl_env):
    assert configure_backend("cpu", "Ring") == "gloo"
    assert "NCCL_ALGO" not in os.environ


def test_configure_backend_none_keeps_users_choice(clean_nccl_env):
    clean_nccl_env.setenv("NCCL_ALGO", "Tree")
    assert configure_backend("cuda", None) == "nccl"
    assert os.environ["NCCL_ALGO"] == "Tree"


@pytest.mark.parametrize("algo", ["Rign", "", "Ring,Foo", "^"])
def test_invalid_nccl_algo_names_the_config_key(clean_nccl_env, algo):
    with pytest.raises(ValueError, match=r"comm\.nccl_algo"):
        configure_backend("cuda", algo)
    with pytest.raises(ValueError, match=r"comm\.nccl_algo"):
        configure_backend("cpu", algo)  # rejected even where it would be unused
    with pytest.raises(ValueError, match=r"comm\.nccl_algo"):
        CommConfig(nccl_algo=algo)
    assert "NCCL_ALGO" not in os.environ


def test_normalize_nccl_algo_forms():
    assert normalize_nccl_algo("nvls") == "NVLS"
    assert normalize_nccl_algo("^nvls,collnetdirect") == "^NVLS,CollnetDirect"
    assert normalize_nccl_algo(" ring , tree ") == "Ring,Tree"


def test_configure_backend_rejects_unknown_device():
    with pytest.raises(ValueError, match="'cuda'.*'cpu'"):
        configure_backend("mps", None)


def test_apply_env_cuda_sets_all_nccl_vars(clean_nccl_env):
    cfg = CommConfig(nccl_algo="Ring", nccl_socket_ifname="eth0", nccl_ib_disable=False)
    assert apply_env(cfg, "cuda") == "nccl"
    assert (os.environ["NCCL_ALGO"], os.environ["NCCL_SOCKET_IFNAME"], os.environ["NCCL_IB_DISABLE"]) == \
        ("Ring", "eth0", "0")
    assert apply_env(CommConfig(nccl_ib_disable=True), "cuda") == "nccl"
    assert os.environ["NCCL_IB_DISABLE"] == "1"


def test_apply_env_cpu_and_gloo_leave_env_untouched(clean_nccl_env):
    cfg = CommConfig(nccl_algo="Ring", nccl_socket_ifname="eth0", nccl_ib_disable=True)
    assert apply_env(cfg, "cpu") == "gloo"
    cfg.backend = "gloo"
    assert apply_env(cfg, "cuda") == "gloo"  # gloo on GPUs: NCCL settings do not apply
    assert not any(v in os.environ for v in NCCL_VARS)


def test_comm_config_validation_names_keys():
    with pytest.raises(ValueError, match=r"comm\.backend"):
        CommConfig(backend="mpi")
    with pytest.raises(ValueError, match=r"comm\.timeout_s"):
        CommConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"comm\.backend=nccl needs CUDA"):
        apply_env(CommConfig(backend="nccl"), "cpu")


def test_comm_config_is_a_hydra_structured_config():
    from omegaconf import OmegaConf

    base = OmegaConf.structured(CommConfig)
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(["nccl_algo=Ring", "timeout_s=30", "nccl_ib_disable=true"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, CommConfig) and (cfg.nccl_algo, cfg.timeout_s, cfg.nccl_ib_disable) == ("Ring", 30, True)
    with pytest.raises(Exception, match="timeout_s"):
        OmegaConf.merge(base, OmegaConf.from_dotlist(["timeout_s=soon"]))


@pytest.fixture
def world_of_one():
    """An in-process gloo group of one rank (no launcher needed)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_nccl_algo_cannot_change_after_the_group_started(world_of_one, clean_nccl_env):
    clean_nccl_env.setenv("NCCL_ALGO", "Ring")
    assert configure_backend("cuda", "ring") == "nccl"  # same value: fine
    with pytest.raises(RuntimeError, match="already started"):
        configure_backend("cuda", "Tree")
    assert os.environ["NCCL_ALGO"] == "Ring"


def test_ring_world_of_one_is_identity_and_rejects_bool(world_of_one):
    x = torch.arange(5.0)
    assert ring_all_reduce(x) is x and torch.equal(x, torch.arange(5.0))
    with pytest.raises(TypeError, match="dtype torch.bool"):
        ring_all_reduce(torch.ones(3, dtype=torch.bool))


# ---------------------------------------------------------------- benchmark helpers

def test_bench_sizes_and_units():
    assert bench.parse_bytes("64K") == 65536 and bench.parse_bytes("1gb") == 1 << 30
    assert bench.parse_bytes("4100") == 4100
    with pytest.raises(Exception, match="bad size"):
        bench.parse_bytes("12Q")
    args = bench.parse_args([])
    cpu = bench.message_sizes(args, on_cuda=False)
    assert cpu[0] == 1024 and cpu[-1] == 64 << 20 and all(b == 4 * a for a, b in zip(cpu, cpu[1:]))
    assert bench.message_sizes(args, on_cuda=True)[-1] == 1 << 30
    assert bench.message_sizes(bench.parse_args(["--sizes", "4,1K"]), on_cuda=False) == [4, 1024]
    assert bench.parse_args(["--nccl-algo", "tree"]).nccl_algo == "Tree"
    with pytest.raises(SystemExit, match="--nccl-algo.*unknown NCCL algorithm"):
        bench.parse_args(["--nccl-algo", "Rign"])
    with pytest.raises(SystemExit, match="--backend nccl needs --device cuda"):
        bench.parse_args(["--device", "cpu", "--backend", "nccl"])


# ---------------------------------------------------------------- launch scripts (no ranks started)

def _bash(script: Path, args=(), env_extra=None, timeout=30):
    # a clean shell: the scripts honour MASTER_PORT and friends, which an in-process run earlier
    # in this pytest worker may have left in os.environ
    env = {k: v for k, v in os.environ.items()
           if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "HOSTFILE", "NO_SSH")}
    env.update(PYTHON=sys.executable, **(env_extra or {}))
    return subprocess.run(["bash", str(script), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_multinode_dry_run_modes(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnodeA slots=4\nnodeB slots=4\n")
    ssh = _bash(LAUNCH / "multinode.sh", ["trainer.max_steps=3"], {"HOSTFILE": str(hostfile), "DRY_RUN": "1"})
    assert ssh.returncode == 0, ssh.stderr
    assert f"--hostfile {hostfile} --master_port 29500 --module llama_train.train trainer.max_steps=3" in ssh.stderr
    assert "--no_ssh" not in ssh.stderr

    nossh = _bash(LAUNCH / "multinode.sh", ["--master-port", "1234", "x=1"],
                  {"HOSTFILE": str(hostfile), "DRY_RUN": "1", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"})
    assert nossh.returncode == 0, nossh.stderr
    assert "--master_port 1234 --no_ssh --node_rank 1 --master_addr 10.0.0.1 --module llama_train.train x=1" \
        in nossh.stderr


@pytest.mark.parametrize("env, message", [
    ({"NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2 is not in 0..1"),
    ({"NODE_RANK": "0"}, "needs MASTER_ADDR"),
    ({"NO_SSH": "1"}, "needs NODE_RANK"),
    ({"HOSTFILE": "/nonexistent/hosts"}, "hostfile '/nonexistent/hosts' not found"),
])
def test_multinode_rejects_bad_settings(tmp_path, env, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    res = _bash(LAUNCH / "multinode.sh", [], {"HOSTFILE": str(hostfile), "DRY_RUN": "1", **env})
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_slurm_sbatch_runs_one_no_ssh_launcher_per_node(tmp_path):
    """scontrol/srun stand-ins (SLURM is absent here): srun runs the task once per node id."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[1-2]" ] && printf "gpu1\\ngpu2\\n"\n')
    (bindir / "srun").write_text(
        '#!/usr/bin/env bash\n'
        'while [[ "$1" == --* ]]; do shift; done\n'
        'for id in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do SLURM_NODEID=$id "$@" || exit $?; done\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(REPO), "GPUS_PER_NODE": "4", "DRY_RUN": "1"}
    res = _bash(LAUNCH / "slurm.sbatch", ["trainer.output_dir=/shared/x"], env)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("+ ")]
    assert len(lines) == 2, res.stderr
    for rank, line in enumerate(lines):
        assert (f"--master_port 24242 --no_ssh --node_rank {rank} --master_addr gpu1 "
                "--module llama_train.train trainer.output_dir=/shared/x") in line


# ---------------------------------------------------------------- through the real launcher

def _kill_session(sid: int) -> None:
    """SIGKILL every process of the session we created (launchers, ranks, node groups)."""
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                p.kill()
        except (ProcessLookupError, psutil.Error, PermissionError):
            pass


def run_launched(cmd: list[str], env_extra: dict | None = None, timeout: int = LAUNCH_TIMEOUT_S) -> str:
    """Run ``cmd`` in a new session; fail with its output unless it exits 0 within ``timeout``."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"):  # an in-process run's, if any
        env.pop(var, None)  # (a rank identity would make the bench skip its relaunch)
    env.update(env_extra or {})
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # let the launchers stop their ranks first
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        _kill_session(proc.pid)
        out = proc.communicate()[0]
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-6000:]}")
    finally:
        _kill_session(proc.pid)  # stray ranks if a launcher died early
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}"
    return out


def _deepspeed() -> str:
    exe = BIN / "deepspeed"
    assert exe.exists(), f"no deepspeed launcher next to {sys.executable}; install the project (make setup)"
    return str(exe)


@pytest.mark.slow
def test_ring_matches_all_reduce_three_ranks():
    """World size 3 (not a power of two), sizes not divisible by 2 or 3, a sub-group without rank 0."""
    out = run_launched([_deepspeed(), "--num_gpus", "3", "--master_port", str(free_port()), str(WORKER),
                        "--expect-world", "3"])
    assert "COMM_WORKER OK world=3" in out
    assert {f"RANK {r}/3" for r in range(3)} <= {ln.split(" node=")[0] for ln in out.splitlines()}



# launch/local_two_nodes.sh with the ring check (ENTRY=tests/workers/comm_worker.py) runs as
# docs/launch.md writes it: tests/system/test_docs_commands.py.


@pytest.mark.slow
def test_bench_relaunches_itself_and_reports_busbw(tmp_path):
    """`python -m llama_train.bench.allreduce --nprocs 3` goes through the deepspeed launcher.
    The bench runs forked from the warm parent, and so does the launch of itself it makes
    (DeepSpeed's runner and launcher deciding the ranks: tests/warm_ranks.py)."""
    out_json, log = tmp_path / "bench.json", tmp_path / "bench.log"
    sizes = [4, 12, 20, 4100]  # 1, 3, 5, 1025 floats: numel < world and not divisible by 3
    helpers.run([sys.executable, "-m", "llama_train.bench.allreduce", "--nprocs", "3",
                 "--sizes", ",".join(map(str, sizes)), "--warmup", "1", "--iters", "3",
                 "--json", str(out_json)], log, LAUNCH_TIMEOUT_S, warm=True)
    out = log.read_text()
    report = json.loads(out_json.read_text())
    meta, rows = report["meta"], report["results"]
    n = 3
    assert (meta["world_size"], meta["backend"], meta["device"]) == (n, "gloo", "cpu")
    assert meta["bus_factor"] == pytest.approx(2 * (n - 1) / n)
    assert sorted((r["impl"], r["bytes"]) for r in rows) == sorted((i, b) for i in ("gloo", "ring") for b in sizes)
    for r in rows:
        assert r["time_us"] > 0 and r["count"] == r["bytes"] // 4
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (n - 1) / n)
    assert "--module llama_train.bench.allreduce" in meta["command"] and "--num_gpus 3" in meta["command"]
    assert "reproduce: DS_ACCELERATOR=cpu deepspeed --num_gpus 3" in out
