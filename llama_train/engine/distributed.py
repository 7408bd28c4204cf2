"""The process group: started and ended here only, with DeepSpeed's comm backend on top of it.

Also the two things DeepSpeed's start gets wrong for us, patched around its call: its CPU
shared-memory comm op (built and loaded on every start, needed by no training collective) and
the timeout of the groups it creates after the default one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
from typing import Iterator, Optional

import torch

from llama_train import watchdog
from llama_train.comm import CommConfig, apply_env
from llama_train.config import ConfigError
from llama_train.proc import ds_shm_buffer

STARTUP_TIMEOUT = datetime.timedelta(minutes=10)


class RendezvousError(ConfigError):
    """The process group could not start at MASTER_ADDR:MASTER_PORT (a port in use, a name
    that does not resolve, ranks that never met): exit 2 with one line naming the variable,
    the cause and the fix, before anything was trained or written."""


def load_deepspeed():
    """``import deepspeed`` (the module), the first thing :func:`init_distributed` does. A
    function of its own so that ``llama-bench startup`` can time the import, a phase of every
    start (docs/benchmarks-startup.md)."""
    import deepspeed

    return deepspeed


def init_distributed(comm: Optional[CommConfig] = None, device_type: str = "cpu") -> str:
    """Start the process group (the only place that does): NCCL on GPUs, its ``NCCL_*``
    variables set first from ``comm``; gloo on CPU. Expects the launcher's variables (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT); :func:`~llama_train.engine.runtime.detect_runtime`
    sets them for a plain process. With several ranks, also starts the hang watchdog
    (:mod:`llama_train.watchdog`): a rank that makes no progress for ``comm.timeout_s`` stops
    every rank with exit code 5. Returns the backend name."""
    import torch.distributed as dist

    load_deepspeed()
    comm = comm if comm is not None else CommConfig()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variables {missing} are not set; start the program "
            "through a launcher, e.g. `deepspeed --num_gpus 2 --module <module> ...`")
    if comm.simulate is not None:
        return _start_simulated(comm, device_type)
    backend = apply_env(comm, device_type)
    if comm.count_traffic:  # before DeepSpeed's comm backend keeps references to the functions
        from llama_train.comm import counting

        counting.install()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # the watchdog (started below) stops a job after comm.timeout_s without progress from a
    # rank; a collective gives up a few seconds later, as the backstop
    timeout = datetime.timedelta(seconds=int(comm.timeout_s) + watchdog.COLLECTIVE_MARGIN_S)
    check_rendezvous_address()
    try:
        _start_process_group(backend, timeout, device_type)
    except Exception as e:  # noqa: BLE001 - mapped where the cause can be told, else as it is
        explained = rendezvous_error(e)
        if explained is None:
            raise
        raise explained from None
    _default_group_timeout(timeout)
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        # Ranks reach this point seconds apart on a loaded host (imports, data checks): a skew
        # at start-up is not a hang. Past this barrier they run in step, watched.
        dist.monitored_barrier(timeout=max(timeout, STARTUP_TIMEOUT))
    if device_type == "cpu" and shm_comm_op_loaded():
        _unlink_shm_buffer(dist.get_rank())
    watchdog.start(comm.timeout_s, dist.get_rank(), dist.get_world_size())
    return backend


def check_rendezvous_address() -> None:
    """MASTER_PORT must be a TCP port and MASTER_ADDR a name this host resolves: torch's
    rendezvous retries an unresolvable name for the whole start-up timeout (comm.timeout_s, 10
    minutes by default), printing a warning every few seconds, before it fails."""
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    rank = os.environ.get("RANK", "?")
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise RendezvousError(
            f"MASTER_PORT={port!r} is not a TCP port number (1-65535): give the rendezvous a "
            f"free port (deepspeed --master_port N, launch/multinode.sh --master-port N, or "
            f"MASTER_PORT=N for a single process).")
    try:
        socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise RendezvousError(
            f"MASTER_ADDR={addr!r} does not resolve on {socket.gethostname()} ({why}): rank "
            f"{rank} cannot reach the job's rendezvous. Set MASTER_ADDR (deepspeed "
            f"--master_addr, launch/multinode.sh --master-addr) to the host name or IP address "
            f"of the node that runs rank 0, as every node resolves it (`getent hosts "
            f"<name>`).") from None


def rendezvous_error(e: BaseException) -> Optional[RendezvousError]:
    """torch's failure to start the process group, in words, where the cause can be told
    from it: the port taken, a privileged port, ranks that never met. None otherwise."""
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    rank = os.environ.get("RANK", "?")
    text = str(e)
    first = " ".join(text.strip().splitlines()[0].split())[:200] if text.strip() else ""
    host = socket.gethostname()
    free = ("Give a free port (deepspeed --master_port N, launch/multinode.sh --master-port N, "
            "or MASTER_PORT=N for a single process)")
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return RendezvousError(
            f"MASTER_PORT={port} is already in use on {host}: rank {rank} could not open the "
            f"job's rendezvous there (another job, or a process an earlier one left behind, "
            f"listens on it: `ss -ltnp 'sport = :{port}'` names it). {free}, or end the "
            f"process that holds it.")
    if "EACCES" in text or "permission denied" in text.lower():
        low = " (a port below 1024 needs root)" if port.isdigit() and int(port) < 1024 else ""
        return RendezvousError(
            f"MASTER_PORT={port} cannot be opened on {host}: permission denied{low}. {free} "
            f"above 1023.")
    joined = re.search(r"waiting for clients\. (\d+)/(\d+) clients joined", text)
    if joined:
        return RendezvousError(
            f"only {joined.group(1)} of the {joined.group(2)} ranks joined the rendezvous at "
            f"{addr}:{port} before its timeout (comm.timeout_s): the others did not start, or "
            f"cannot reach {addr}:{port} (MASTER_ADDR must be an address of rank 0's host that "
            f"every node reaches; a firewall may block the port). torch said: {first}")
    if "timed out" in text.lower() and "connect" in text.lower():
        return RendezvousError(
            f"rank {rank} could not reach the job's rendezvous at {addr}:{port} before its "
            f"timeout (comm.timeout_s): rank 0 is not listening there. MASTER_ADDR must be "
            f"rank 0's host and MASTER_PORT the same on every node; check that rank 0 started "
            f"and that no firewall blocks the port. torch said: {first}")
    return None


def _start_simulated(comm: CommConfig, device_type: str) -> str:
    """``comm.simulate_ranks``: the default group is :class:`~llama_train.comm.simulate.MirrorGroup`
    (this process as rank R of N, every peer its mirror), DeepSpeed's comm backend on top of it.
    No hang watchdog: there are no peers to wait for, and no NCCL or gloo to configure."""
    import torch.distributed as dist

    from llama_train.comm import simulate

    world, rank = comm.simulate
    if dist.is_initialized():  # a program (a test) that trains again in this process
        if not (simulated() and (dist.get_world_size(), dist.get_rank()) == (world, rank)):
            raise RuntimeError(
                f"comm.simulate_ranks={world}: this process already has a process group "
                f"({dist.get_backend()}, rank {dist.get_rank()} of {dist.get_world_size()}); "
                f"end it first (llama_train.engine.shutdown_distributed)")
    else:
        simulate.init(rank, world, datetime.timedelta(seconds=int(comm.timeout_s)))
    with _without_shm_comm_op(device_type == "cpu"):
        load_deepspeed().init_distributed(dist_backend=simulate.BACKEND,
                                          auto_mpi_discovery=False, verbose=False)
    _mirror_agreement_checks()
    return dist.get_backend()


def checkpoint_group(timeout_s: float):
    """A gloo group of every rank for background checkpoint writes: their agreement on a save
    runs while the loop's collectives use the default group (NCCL or gloo), and a group must not
    be used by two threads at once. A collective call on all ranks, like the group's start.
    None in a world of one and on a simulated rank (which saves synchronously)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or simulated():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=int(timeout_s)))


def simulated() -> bool:
    """Whether the process group is a simulated rank's (``comm.simulate_ranks``)."""
    import torch.distributed as dist

    from llama_train.comm import simulate

    return dist.is_initialized() and dist.get_backend() == simulate.BACKEND


def leads() -> bool:
    """Whether this process does rank 0's part of a collective step (initialising a gathered
    parameter, writing the model-states file): rank 0, or a simulated rank, whose peers are its
    mirror and which must therefore do it itself."""
    import torch.distributed as dist

    return dist.get_rank() == 0 or simulated()


def _mirror_agreement_checks() -> None:
    """DeepSpeed's ZeRO-3 checks that every rank traced the same modules and parameters
    (``assert_ints_same_as_other_ranks``) by broadcasting rank 0's list over a placeholder of
    -1s on the others; a mirror group cannot know rank 0's list when it is not rank 0, and its
    peers trace what it traces by construction. The check is replaced by nothing where ZeRO
    looks it up, for this process (only a simulated rank gets here)."""
    import importlib

    def same_everywhere(_ints) -> None:
        return None

    for name in ("deepspeed.runtime.zero.partitioned_param_coordinator",
                 "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.partition_parameters"):
        mod = importlib.import_module(name)
        real = getattr(mod, "assert_ints_same_as_other_ranks", None)
        if real is not None and real is not same_everywhere:
            _REPLACED.setdefault(name, real)
            mod.assert_ints_same_as_other_ranks = same_everywhere


_REPLACED: dict = {}  # module -> DeepSpeed's own check, put back by shutdown_distributed


def _start_process_group(backend: str, timeout: datetime.timedelta, device_type: str) -> None:
    """``deepspeed.init_distributed``: torch's default group and DeepSpeed's comm backend on it,
    on CPU without the shared-memory comm op (:func:`_without_shm_comm_op`). A function of its
    own so that ``llama-bench startup`` can time it."""
    deepspeed = load_deepspeed()
    with _without_shm_comm_op(device_type == "cpu"):
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=timeout)


def shutdown_distributed() -> None:
    """End the process group and make DeepSpeed forget the groups it cached from it, so a later
    :func:`init_distributed` in this process (a program that embeds the trainer, the tests)
    starts clean."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    import importlib

    from llama_train.comm import counting

    counting.uninstall()  # comm.count_traffic's wrapper, a simulated rank's counter

    from deepspeed.utils import groups

    for name, real in _REPLACED.items():  # a simulated rank's: the next group may be real
        importlib.import_module(name).assert_ints_same_as_other_ranks = real
    _REPLACED.clear()
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                 "_TENSOR_MODEL_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)


def _default_group_timeout(timeout: datetime.timedelta) -> None:
    """Every process group created from now on has the default group's timeout.

    ``init_process_group`` takes the timeout for the default group only; a group made later with
    ``new_group`` and no timeout (DeepSpeed's ZeRO data-parallel groups) gets torch's default:
    30 min on gloo, 10 min on NCCL. A collective stuck on such a group waited 30 min on CPU
    whatever ``comm.timeout_s`` said (issue 12). torch reads these module defaults at each
    ``new_group``."""
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = timeout


@contextlib.contextmanager
def _without_shm_comm_op(skip: bool) -> Iterator[None]:
    """Inside (when ``skip``): DeepSpeed starts its torch comm backend without its CPU
    shared-memory comm op (``deepspeed_shm_comm_op``).

    DeepSpeed 0.19.8's ``TorchBackend.__init__`` calls ``deepspeed.comm.torch.build_shm_op()`` on
    every start: it probes every op builder for compatibility (compiler subprocesses), JIT-loads
    the op through torch's cpp_extension (ninja; a C++ build of 30-70 s on 2 cores whenever
    ``TORCH_EXTENSIONS_DIR`` holds no build yet, e.g. a fresh container or the default
    ``~/.cache/torch_extensions``), prints "... built successfully" on every rank, and maps a
    ~66 MB /dev/shm buffer per rank. The op serves one call, ``inference_all_reduce`` (DeepSpeed
    inference's tensor-parallel layers), which without it uses ``torch.distributed.all_reduce``;
    training's collectives (gradient all-reduce, ZeRO's reduce-scatter/all-gather, barriers) all
    go through ``torch.distributed`` either way (docs/benchmarks-startup.md). ``build_shm_op`` is
    looked up at call time, so it is replaced for the duration of the call only. On GPUs
    DeepSpeed has no such op and nothing changes; a DeepSpeed without ``build_shm_op`` is left
    alone (and :func:`shm_comm_op_loaded` then says whether its buffer must be unlinked)."""
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    real = getattr(ds_torch, "build_shm_op", None)
    if not skip or real is None:
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = real


def shm_comm_op_loaded() -> bool:
    """Whether DeepSpeed's comm backend of this process holds the CPU shared-memory comm op."""
    import importlib

    cdb = getattr(importlib.import_module("deepspeed.comm.comm"), "cdb", None)
    return getattr(cdb, "shm_comm_op", None) is not None


def _unlink_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU shared-memory all-reduce (when loaded: see :func:`_without_shm_comm_op`)
    creates a ~66 MB /dev/shm file per rank and never removes it, so every run leaks RAM until
    /dev/shm fills up. Once every rank has mapped its peers' buffers (after the barrier) the names
    are no longer needed: unlink ours, the mappings stay valid and the memory is freed when the
    job ends."""
    import torch.distributed as dist

    dist.barrier()
    try:
        os.unlink(ds_shm_buffer(os.environ.get("MASTER_ADDR", ""),
                                os.environ.get("MASTER_PORT", ""), rank))
    except FileNotFoundError:
        pass
