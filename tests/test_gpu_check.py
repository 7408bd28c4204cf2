"""launch/gpu_check.sh: skips cleanly without a GPU; its commands compose; on a GPU it runs."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from helpers import REPO
from llama_train.config import load_config
from llama_train.paths import CONFIG_DIR


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_skips_cleanly_without_a_gpu(tmp_path):
    """No nvidia-smi on PATH: a message saying why, exit 0, nothing set up or written."""
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    before = set(REPO.iterdir())
    proc = subprocess.run(["bash", str(REPO / "launch" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "gpu-check: skipped: no CUDA GPU" in proc.stdout
    assert set(REPO.iterdir()) == before


@pytest.mark.slow
def test_listed_commands_are_valid_llama_train_runs():
    """--print-commands (any machine): every llama-train command composes to a valid config."""
    proc = subprocess.run([sys.executable, "-m", "llama_train.bench.gpu_check",
                           "--print-commands"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    runs = [shlex.split(line) for line in proc.stdout.splitlines()
            if "llama_train.train" in line]
    assert len(runs) >= 14  # CPU reference, 4 stages x 3, 2 for the 2-rank comparison
    for cmd in runs:
        overrides = cmd[cmd.index("llama_train.train") + 1:]
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            cfg = load_config(compose("config", overrides=overrides))
        assert cfg.model.dim == 128 and cfg.trainer.seq_len == 64
    benches = [line for line in proc.stdout.splitlines() if "llama_train.bench.train" in line]
    assert len(benches) == 4 and all("--seq-len 2048" in b for b in benches)
    assert any("--compile" in b for b in benches)


GPU_CHECK_WAIT_S = 1800  # --quick: gpu_check steps 1, 2 and 5 (no 1B bench)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# pytest-timeout's limit (600 s in pyproject.toml) must not cut the wait below short
@pytest.mark.timeout(GPU_CHECK_WAIT_S + 120)
def test_gpu_check_quick_on_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llama_train.bench.gpu_check", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=GPU_CHECK_WAIT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "gpu_check.json").is_file()
