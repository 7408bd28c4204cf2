"""Where this process runs, read from the launcher's environment before anything starts.

No DeepSpeed here: :func:`detect_runtime` runs in preflight, before DeepSpeed is imported, and
sets ``DS_ACCELERATOR`` so that DeepSpeed never guesses the accelerator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect_runtime(device: str = "auto") -> Runtime:
    """Reads the launcher's environment; a plain ``llama-train`` becomes a world of one.

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
    if "RANK" not in os.environ:  # not under a launcher
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


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, from its package metadata: reports (llama-bench) name
    it without importing DeepSpeed (an import of ~0.3 s that a bench's parent process never
    needs otherwise)."""
    from importlib import metadata

    return metadata.version("deepspeed")
