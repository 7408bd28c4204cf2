"""launch/gpu_check.sh: skips cleanly without a GPU; its commands compose; on a GPU it runs."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

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
    """--print-commands (any machine): every stage's commands, and each llama-train command
    composes to a valid config: the tiny launches, the simulated 64-rank llama3_8b, the benches."""
    proc = subprocess.run([sys.executable, "-m", "llama_train.bench.gpu_check",
                           "--print-commands"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    stages = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("== stage")]
    assert stages == ["data", "tiny", "sdpa", "sim8b", "bench_vocab_8192_eager",
                      "bench_vocab_128256_eager", "bench_vocab_8192_compiled",
                      "bench_vocab_128256_compiled", "comm", *LEVER_STAGES]
    runs = [shlex.split(line) for line in proc.stdout.splitlines()
            if "llama_train.train" in line]
    # 4 tiny launches, the simulated rank, 2 for the 2-GPU comparison, FP8's bf16 and FP8 runs
    assert len(runs) == 9
    for cmd in runs:
        overrides = cmd[cmd.index("llama_train.train") + 1:]
        overrides = [o for o in overrides if not o.startswith("data.tokenizer=")]  # made later
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            cfg = load_config(compose("config", overrides=overrides))
        if cfg.comm.simulate_ranks:
            assert (cfg.comm.simulate_ranks, cfg.model.vocab_size) == (64, 128256)
        elif cfg.model.n_layers == 4 and cfg.model.dim == 4096:  # fp8_loss_8b_layers
            assert cfg.trainer.max_steps == 200 and cfg.deepspeed.precision == "bf16"
        else:
            assert cfg.model.dim == 128 and cfg.trainer.seq_len == 64
            assert cfg.trainer.max_steps == 12 and cfg.trainer.save_every == 6
        if not cfg.trainer.max_steps == 200:  # the stages before issue 55's run eager
            assert cfg.trainer.compile == "false"
    benches = [line for line in proc.stdout.splitlines() if "llama_train.bench.train" in line]
    assert len(benches) == 9 and all("--seq-len 2048" in b for b in benches)
    assert sum("--compile" in b for b in benches) == 4
    assert sum("--float8" in b for b in benches) == 3
    assert sum("--preset llama3_2_1b" in b for b in benches) == 2
    assert sum("--preset llama3_8b --override model.n_layers=4" in b for b in benches) == 4


# issue 55's FP8 and compile stages, after every other stage
LEVER_STAGES = ["bench_vocab_8192_fp8_eager", "bench_8b_layers_eager",
                "bench_8b_layers_fp8_eager", "bench_8b_layers_compiled",
                "bench_8b_layers_fp8_compiled", "fp8_loss_8b_layers"]


def test_fp8_and_compile_stages_are_listed_and_skip_cleanly_without_a_gpu(capsys, monkeypatch):
    """The new stages come last and are not --quick; --print-commands lists each with its limit
    and command on any machine; asked for on a machine without CUDA, the check says why it
    skipped and runs nothing."""
    from llama_train.bench import gpu_check

    names = [st.name for st in gpu_check.STAGES]
    assert names[-len(LEVER_STAGES):] == LEVER_STAGES
    assert not any(st.quick for st in gpu_check.STAGES if st.name in LEVER_STAGES)
    gpu_check.main(["--print-commands", "--only", ",".join(LEVER_STAGES)])
    out = capsys.readouterr().out
    assert [line.split()[2] for line in out.splitlines() if line.startswith("== stage")] \
        == LEVER_STAGES
    assert out.count("--float8") == 3 and out.count("float8.enabled=true") == 1
    assert out.count("--only ours") == 4 and out.count("--compile") == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_check.main(["--only", ",".join(LEVER_STAGES)])
    assert capsys.readouterr().out.strip() == "gpu-check: skipped: torch sees no CUDA device."


def _check(tmp_path, budget_s: float):
    from llama_train.bench.gpu_check import Check

    return Check(tmp_path, budget_s, dry=False)


@pytest.mark.slow  # waits on the check's timers: not in make test-fast's in-process tier
def test_a_command_past_its_limit_is_killed_with_what_it_started(tmp_path):
    """A launcher's ranks and a bench's runs start their own sessions: the kill reaches them."""
    c = _check(tmp_path, 60)
    pidfile = tmp_path / "grandchild.pid"
    t = time.monotonic()
    rc = c.run(["bash", "-c", f"setsid sleep 300 & echo $! > {pidfile}; wait"],
               tmp_path / "log", limit=6)
    assert rc == 124 and time.monotonic() - t < 30
    pid = int(pidfile.read_text())
    time.sleep(0.2)
    assert not _alive(pid), "the grandchild in its own session outlived the kill"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # waits on the check's timers: not in make test-fast's in-process tier
def test_stages_share_one_budget_and_each_is_written_as_it_ends(tmp_path):
    """A stage cut at its limit keeps what the stages before it wrote; a stage with less of the
    budget left than it needs is skipped, said so; every stage's seconds and limit are recorded."""
    from llama_train.bench.gpu_check import Stage, run_stages

    def quick(c):
        assert c.run(["true"], tmp_path / "q.log") == 0
        return {"figure": 1}

    def too_long(c):
        seen = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
        assert seen["first"]["figure"] == 1  # written before this stage started
        return {"exit": c.run(["sleep", "60"], tmp_path / "s.log")}

    c = _check(tmp_path, 25)
    run_stages(c, [Stage("first", 10, quick, min_s=5), Stage("second", 7, too_long, min_s=5),
                   Stage("third", 60, quick)])
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stages["first"]["figure"] == 1 and stages["first"]["limit_s"] == 10
    assert stages["second"]["exit"] == 124 and 6 <= stages["second"]["seconds"] < 20
    assert stages["third"]["skipped"].startswith("budget:")  # 25 - 7 s: under its 20


def test_the_padded_tokenizer_encodes_as_its_source(tmp_path):
    """The large-vocabulary stages' tokenizer: 128256 ids, the source's encoding, same bytes
    every time (its sha256 keys the prepared data the bundle carries)."""
    import pydoc_data.topics

    from llama_train.data import Tokenizer, train_tokenizer
    from llama_train.data.tokenizer import pad_vocabulary

    topics = pydoc_data.topics.topics
    docs = [topics[k] for k in sorted(topics)[:25]]
    src = train_tokenizer(docs, 512, tmp_path / "tok")
    a = pad_vocabulary(src, tmp_path / "a.model", 128256)
    b = pad_vocabulary(src, tmp_path / "b.model", 128256)
    assert a.read_bytes() == b.read_bytes()
    small, big = Tokenizer(src), Tokenizer(a)
    assert big.vocab_size == 128256
    text = docs[3] + " <unused_600> 12345"
    assert big.encode(text) == small.encode(text) and max(big.encode(text)) < 512
    assert big.decode(big.encode(text)) == text


@pytest.mark.slow
def test_setup_sees_the_torch_of_a_python_that_is_itself_a_venv(tmp_path):
    """On the H200 image python3 is a venv holding torch; a venv made from it with
    --system-site-packages saw the base interpreter's packages instead, and nothing imported
    torch. This test's python is such a venv (.venv): the set-up's venv must import its torch."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("this test's python is not a virtualenv")
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_VENV": str(venv)}
    proc = subprocess.run(["bash", str(REPO / "launch" / "gpu_check.sh"), "--setup-only"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    py = str(venv / "bin" / "python")
    where = subprocess.run([py, "-c", "import torch, deepspeed, hydra, llama_train; "
                                      "print(torch.__file__)"],
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip() == torch.__file__  # this venv's torch, not another install
    (pth,) = venv.glob("lib/python*/site-packages/_gpu_check_parent_venv.pth")
    pth.unlink()  # what the venv sees without it: the defect
    bare = subprocess.run([py, "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "No module named 'torch'" in bare.stderr


GPU_CHECK_WAIT_S = 600  # --quick --budget-s 480: no ~1B bench stages


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# pytest-timeout's limit (600 s in pyproject.toml) must not cut the wait below short
@pytest.mark.timeout(GPU_CHECK_WAIT_S + 120)
def test_gpu_check_quick_on_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llama_train.bench.gpu_check", "--quick",
                           "--budget-s", "480", "--out", str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, timeout=GPU_CHECK_WAIT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    tiny = stages["tiny"]
    assert tiny["loss_falls"] and tiny["resume_max_abs_diff"] == 0.0, tiny
    assert stages["sim8b"]["report"]["device"] == "cuda", stages["sim8b"]
