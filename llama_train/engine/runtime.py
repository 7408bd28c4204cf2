"""Where this process runs, read from the launcher's environment before anything starts.

No DeepSpeed here: :func:`detect_runtime` runs in preflight, before DeepSpeed is imported, and
sets ``DS_ACCELERATOR`` so that DeepSpeed never guesses the accelerator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from llama_train.config import ConfigError
from llama_train.proc import free_port


@dataclass
class Runtime:
    """Where this process runs, known before the process group starts (from launcher env)."""

    device_type: str  # "cpu" | "cuda"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    simulated: bool = False  # comm.simulate_ranks: rank `rank` of `world_size`, alone here

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Whether this process does rank 0's duties (logs, run files, checkpoint bookkeeping):
        rank 0, or a simulated rank, which is the only process of its job."""
        return self.rank == 0 or self.simulated


# Variables that only a multi-process launcher sets: deepspeed (launch.py), torchrun, mpirun.
LAUNCHER_ENV = ("CROSS_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE")


# What a simulated rank set in this process's environment. Kept here, not in the environment:
# a marker variable there was inherited by every process started later (a test runner's
# launcher jobs), whose ranks then all took themselves for rank 0 of a world of one.
_SIMULATION_ENV: dict = {}


def _left_by_a_simulation() -> bool:
    """Whether RANK and WORLD_SIZE are still what a simulated rank of this process set."""
    left = bool(_SIMULATION_ENV) and all(os.environ.get(k) == v
                                          for k, v in _SIMULATION_ENV.items())
    _SIMULATION_ENV.clear()
    return left


def launcher_env() -> Optional[str]:
    """The variable that shows this process was started by a launcher, or None."""
    return next((v for v in LAUNCHER_ENV if v in os.environ), None)


def detect_runtime(device: str = "auto", simulate: Optional[Tuple[int, int]] = None) -> Runtime:
    """Reads the launcher's environment; a plain ``llama-train`` becomes a world of one, or with
    ``simulate=(N, R)`` (``comm.simulate_ranks``) rank R of N, which a launcher may not start.

    Sets ``DS_ACCELERATOR`` before DeepSpeed is imported so it never guesses the accelerator.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "torch finds no usable CUDA device")
        raise ConfigError(f"trainer.device=cuda but {why}: run on a GPU machine, or set "
                          f"trainer.device=auto (picks the GPU when there is one) or cpu.")
    os.environ.setdefault("DS_ACCELERATOR", device)
    if simulate is not None:
        return _simulated_runtime(device, *simulate)
    if "RANK" not in os.environ or _left_by_a_simulation():  # not under a launcher
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world)))
    rt = Runtime(device, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), world,
                 local_world)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one host share its cores; oversubscribing them costs more than it gains.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if device == "cuda":
        torch.cuda.set_device(rt.local_rank)
    return rt


def _simulated_runtime(device: str, world: int, rank: int) -> Runtime:
    """Rank ``rank`` of ``world`` in this process. DeepSpeed reads RANK, WORLD_SIZE and
    LOCAL_RANK from the environment in places (zero.Init's device, its rank checks), so they
    say the same as the process group will."""
    found = launcher_env()
    if found is not None:
        raise ConfigError(
            f"comm.simulate_ranks={world} runs one rank of a {world}-rank job in this single "
            f"process, but this process was started by a launcher ({found} is set): start it "
            f"as a plain command (`llama-train comm.simulate_ranks={world} ...` or `python -m "
            f"llama_train.train ...`), or drop comm.simulate_ranks for a real run.")
    env = dict(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_SIZE="1")
    os.environ.update(env)
    _SIMULATION_ENV.clear()
    _SIMULATION_ENV.update(env)  # a later plain run in this process is a world of one again
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device == "cuda":
        torch.cuda.set_device(0)
    return Runtime(device, rank, 0, world, 1, simulated=True)


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, from its package metadata: reports (llama-bench) name
    it without importing DeepSpeed (an import of ~0.3 s that a bench's parent process never
    needs otherwise)."""
    from importlib import metadata

    return metadata.version("deepspeed")
