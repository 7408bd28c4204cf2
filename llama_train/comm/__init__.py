"""Communication setup: backend choice, NCCL environment, process-group start, a reference ring.

NCCL reads its ``NCCL_*`` variables once, when a communicator is created, so everything here
must run before the process group starts; :func:`llama_train.engine.init_distributed` (the one
place that starts it) applies them first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from llama_train.errors import ConfigError
from llama_train.policy import per_launch

__all__ = [
    "CommConfig",
    "apply_env",
    "check_backend",
    "configure_backend",
    "normalize_nccl_algo",
    "ring_all_reduce",
]



def __getattr__(name: str):
    """``ring_all_reduce`` from :mod:`llama_train.comm.ring` on first use: it needs torch, and
    the config (which imports CommConfig from here) must not wait for torch to import."""
    if name == "ring_all_reduce":
        from llama_train.comm.ring import ring_all_reduce

        return ring_all_reduce
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Algorithm names NCCL_ALGO understands (NCCL >= 2.12; NVLS/NVLSTree 2.17+, PAT 2.23+).
# NCCL matches them case-insensitively; we store the canonical spelling.
NCCL_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
_BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class CommConfig:
    """The ``comm`` config group. Only str/int/bool/Optional so Hydra can type-check it."""

    nccl_algo: Optional[str] = None
    """NCCL_ALGO, e.g. "Ring" or "Tree"; a comma list ("Ring,Tree") or "^NVLS" (exclude) also
    work. None leaves NCCL's own per-size choice (and any NCCL_ALGO already in the env)."""
    nccl_socket_ifname: Optional[str] = None
    """NCCL_SOCKET_IFNAME: interface(s) for bootstrap/socket traffic, e.g. "eth0" or "^lo,docker"."""
    nccl_ib_disable: Optional[bool] = None
    """NCCL_IB_DISABLE: True forces TCP sockets (clusters without InfiniBand/RoCE)."""
    timeout_s: int = 600
    """Collective timeout: a dead or stuck rank makes the others fail after this long instead
    of hanging the job forever."""
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU) | nccl | gloo."""
    simulate_ranks: int = per_launch(0)
    """N > 1: run rank ``simulate_rank`` of an N-rank data-parallel job in this one process
    (plain ``llama-train``, never under a launcher): the real build, ZeRO partitioning, steps
    and checkpoints of that rank, with collectives answered locally
    (:mod:`llama_train.comm.simulate`). 0: off."""
    simulate_rank: int = per_launch(0)
    """Which rank ``simulate_ranks`` runs (0 .. N-1)."""
    count_traffic: bool = per_launch(False)
    """Count every collective this rank runs (kind, group size, bytes, phase) and write them to
    ``<output_dir>/traffic/rank_NNNNN.json`` after each step (:mod:`llama_train.comm.counting`;
    ``llama-plan model-info --world-size N`` plans the same figures). A simulated rank
    (``simulate_ranks``) always counts, into its report."""

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ConfigError(
                f"comm.backend={self.backend!r} is not one of {'|'.join(_BACKENDS)}; "
                "use comm.backend=auto to pick nccl on CUDA and gloo on CPU")
        if int(self.timeout_s) <= 0:
            raise ConfigError(f"comm.timeout_s={self.timeout_s} must be a positive number of seconds")
        if self.nccl_algo is not None:
            normalize_nccl_algo(self.nccl_algo)
        n, r = int(self.simulate_ranks), int(self.simulate_rank)
        if n == 1 or n < 0:
            raise ConfigError(f"comm.simulate_ranks={n}: give the number of ranks of the job to "
                              f"simulate (2 or more), or 0 to run for real")
        if r and not n:
            raise ConfigError(f"comm.simulate_rank={r} needs comm.simulate_ranks=N (the job's "
                              f"size); comm.simulate_rank alone simulates nothing")
        if n and not 0 <= r < n:
            raise ConfigError(f"comm.simulate_rank={r} is not a rank of comm.simulate_ranks={n}: "
                              f"use 0 .. {n - 1}")

    @property
    def simulate(self) -> Optional[Tuple[int, int]]:
        """(N, rank) when this launch simulates one rank of an N-rank job, else None."""
        return (int(self.simulate_ranks), int(self.simulate_rank)) if self.simulate_ranks else None


def normalize_nccl_algo(algo: str) -> str:
    """Validate an NCCL_ALGO value and return it with canonical casing ("ring" -> "Ring")."""
    text = str(algo).strip()
    negate = text.startswith("^")
    names = [n.strip() for n in text.lstrip("^").split(",")]
    canon = {a.lower(): a for a in NCCL_ALGOS}
    bad = [n for n in names if n.lower() not in canon]
    if not text.lstrip("^") or bad:
        raise ConfigError(
            f"comm.nccl_algo={algo!r}: unknown NCCL algorithm {bad or [text]}; use one of "
            f"{', '.join(NCCL_ALGOS)}, a comma list of them, a '^' prefix to exclude, "
            "or comm.nccl_algo=null to let NCCL choose")
    return ("^" if negate else "") + ",".join(canon[n.lower()] for n in names)


def _device_type(device) -> str:
    dtype = str(device).split(":")[0]
    if dtype not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r}: llama_train communicates on 'cuda' (nccl) or 'cpu' (gloo) only")
    return dtype


def _process_group_started() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def configure_backend(device: str, nccl_algo: Optional[str] = None) -> str:
    """Return "nccl" for CUDA, "gloo" for CPU; on CUDA also set NCCL_ALGO.

    Must run before the process group starts: NCCL only reads NCCL_ALGO when it builds a
    communicator, so a later change would be silently ignored -- we raise instead.
    """
    dtype = _device_type(device)
    algo = normalize_nccl_algo(nccl_algo) if nccl_algo is not None else None
    if dtype == "cpu":
        return "gloo"
    if algo is not None:
        current = os.environ.get("NCCL_ALGO")
        if _process_group_started() and current != algo:
            raise RuntimeError(
                f"comm.nccl_algo={algo!r} requested but the process group already started with "
                f"NCCL_ALGO={current!r}; NCCL reads it only at communicator creation. Call "
                "configure_backend/apply_env before llama_train.engine.init_distributed.")
        os.environ["NCCL_ALGO"] = algo
    return "nccl"


def check_backend(cfg: CommConfig, device_type: str) -> str:
    """The backend ``cfg`` gives on ``device_type`` ("nccl" or "gloo"), or ConfigError naming the
    key: :func:`apply_env`'s checks without touching the environment, so that a preflight can
    refuse a mismatch (``comm.backend=nccl`` on CPU) before data preparation and the process
    group, instead of at the process group's start."""
    dtype = _device_type(device_type)
    if cfg.backend not in _BACKENDS:
        raise ConfigError(f"comm.backend={cfg.backend!r} is not one of {'|'.join(_BACKENDS)}")
    if cfg.backend == "nccl" and dtype != "cuda":
        raise ConfigError("comm.backend=nccl needs CUDA but the device is cpu; use comm.backend=auto or gloo")
    if cfg.nccl_algo is not None:
        normalize_nccl_algo(cfg.nccl_algo)
    return "gloo" if cfg.backend == "gloo" or dtype == "cpu" else "nccl"


def apply_env(cfg: CommConfig, device_type: str) -> str:
    """Set the NCCL_* variables from ``cfg`` (only when NCCL will be used) and return the backend."""
    dtype = _device_type(device_type)
    if check_backend(cfg, dtype) == "gloo":
        return "gloo"
    backend = configure_backend(dtype, cfg.nccl_algo)
    if backend == "nccl":
        if cfg.nccl_socket_ifname is not None:
            os.environ["NCCL_SOCKET_IFNAME"] = str(cfg.nccl_socket_ifname)
        if cfg.nccl_ib_disable is not None:
            os.environ["NCCL_IB_DISABLE"] = "1" if cfg.nccl_ib_disable else "0"
        # A collective that outlives the process-group timeout (comm.timeout_s): torch's NCCL
        # watchdog aborts the communicators and tears the process down instead of leaving the
        # rank stuck (1 = abort, then tear down; torch's default 3 tears down without the
        # abort). An explicit setting in the environment wins. Blocking wait is left off: it
        # would make every wait() hold the host until the collective ends.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return backend
