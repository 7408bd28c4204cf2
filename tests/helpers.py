"""Run llama-train for real: in-process config composition, or through the deepspeed launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

from llama_train.proc import free_port, kill_session  # free_port: re-exported for the tests

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# A run that takes seconds: the tiny model on a slice of the built-in corpus.
TINY = [
    "model=tiny",
    "data.max_documents=600",
    "data.num_proc=1",
    "trainer.seq_len=64",
    "trainer.micro_batch=2",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=1000",
    "trainer.eval_batches=2",
    "trainer.save_every=1000",
    "sample.tokens=8",
    "tracking.wandb.mode=disabled",
    "tracking.console=false",
    "deepspeed.precision=fp32",
]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    if extra:
        env.update(extra)
    return env


def launcher_cmd(overrides: List[str], nprocs: int = 2, port: Optional[int] = None,
                 extra_launcher: Optional[List[str]] = None) -> List[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port",
            str(port or free_port()), *(extra_launcher or []), "--module", "llama_train.train",
            *overrides]


@contextmanager
def spawn(cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None):
    """Start a process group; it is killed on exit whatever happens in the test."""
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(env), stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield proc
    finally:
        kill_session(proc)
        fh.close()


def run(cmd: List[str], log: Path, timeout: float = 300, env=None, check: bool = True) -> int:
    with spawn(cmd, log, env) as proc:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{tail(log)}")
    if check and rc != 0:
        raise AssertionError(f"exit {rc}: {' '.join(cmd)}\n{tail(log)}")
    return rc


def train(out: Path, overrides: List[str] = (), nprocs: int = 2, timeout: float = 300,
          check: bool = True, env=None, log_name: str = "train.log") -> int:
    """``deepspeed --num_gpus N --module llama_train.train`` with the tiny settings."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", *overrides], nprocs)
    return run(cmd, out.parent / f"{out.name}-{log_name}", timeout, env, check)


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def metrics(out: Path) -> List[dict]:
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rows.append(json.loads(line))
    return rows


def losses(out: Path) -> Dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(out) if "loss" in r}


def wait_for(pred, timeout: float, interval: float = 0.2) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(interval)
    return False
