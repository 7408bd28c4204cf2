"""Child jobs started in their own session (``start_new_session=True``), so one signal reaches
the launcher and every rank it started; and a rank's tie to the launcher that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process's whole group (ranks that outlived the launcher too), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def exit_skipping_teardown(code: int = 0) -> None:
    """Flush stdio and exit without interpreter teardown.

    For processes that built DeepSpeed ZeRO-3 engines by hand (the memory bench's and the tests'
    workers): ZeRO-3 can leave C++ threads that abort the process during teardown ("terminate
    called without an active exception", exit -6) after every result is written, and the
    launcher then fails the whole job. Seen on CI and in the bench, not reproduced on demand."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    """A TCP port free on this host right now (for a rendezvous on 127.0.0.1)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_shm_buffer(addr: str, port, rank: int) -> str:
    """Path of the ~66 MB /dev/shm buffer DeepSpeed's CPU all-reduce op creates per rank (and
    never removes)."""
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def remove_ds_shm(addr: str, port, ranks: int) -> None:
    """Remove DeepSpeed's CPU all-reduce buffers of a job of ``ranks`` ranks."""
    for rank in range(ranks):
        try:
            os.unlink(ds_shm_buffer(addr, port, rank))
        except OSError:
            pass


_launcher_pid: Optional[int] = None


def stop_with_launcher() -> Optional[int]:
    """Under the ``deepspeed`` launcher: ask the kernel for SIGTERM when the launcher dies
    (``prctl(PR_SET_PDEATHSIG)``), so a rank whose launcher was killed (``kill -9``, an OOM
    kill) stops with a checkpoint like any SIGTERM'd rank instead of training on unsupervised.
    Returns the launcher's pid (None: not under the launcher, or not on Linux)."""
    import ctypes

    global _launcher_pid
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            parent = f.read().replace(b"\0", b" ")
    except OSError:
        return None
    if b"deepspeed.launcher.launch" not in parent:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return None
    except (OSError, AttributeError):
        return None
    _launcher_pid = ppid
    if os.getppid() != ppid:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    return ppid


def launcher_gone() -> bool:
    """Whether the launcher :func:`stop_with_launcher` found has died (this rank was
    re-parented)."""
    return _launcher_pid is not None and os.getppid() != _launcher_pid
