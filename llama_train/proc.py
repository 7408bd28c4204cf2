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


def limit_retained_heap(threshold: int = 65536) -> bool:
    """Have glibc serve allocations of ``threshold`` bytes and more with mmap, so a freed tensor's
    pages go back to the OS (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_=65536``,
    which ``llama-bench memory`` sets; either also stops glibc's dynamic threshold). By default
    glibc raises the threshold up to 32 MiB as large chunks are freed and keeps them in the heap:
    a rank's peak resident set then carries the allocator's history (291M params, 8 CPU ranks,
    ZeRO-3 bf16: 5.57 B/param above a tiny model's run with glibc's default, 2.74 with this;
    4 MiB: 3.84; docs/benchmarks-memory.md). The price is page faults: +28% CPU time per step
    of a 16M-param fp32 model in one process. A no-op (False) off glibc, or where the user set
    the threshold (the variable or its GLIBC_TUNABLES form, read by glibc at start)."""
    import ctypes

    user_set = ("MALLOC_MMAP_THRESHOLD_" in os.environ
                or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""))
    if user_set or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (musl's mallopt ignores the setting)
        M_MMAP_THRESHOLD = -3
        return libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
    except (OSError, AttributeError):
        return False


def free_port() -> int:
    """A TCP port free on this host right now, for a rendezvous on 127.0.0.1 that binds it a
    few seconds later (once the launcher and the ranks have started).

    Chosen below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999 by
    default): a port from that range (what binding port 0 gives) is also what the kernel hands
    to outgoing connections, and on a busy host one of them took it before the rendezvous bound
    it ("EADDRINUSE" from the TCPStore, seen in a test run with three jobs starting at once).
    Ports below the range go only to programs that ask for them by number."""
    import random
    import socket

    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (32768 if unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > 2048 else 32768


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
    _watch_runner(ppid)
    return ppid


_runner_pid: Optional[int] = None
_runner_lost = False


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])  # the field after the state


def _watch_runner(launcher: int, every_s: float = 1.0) -> None:
    """The ``deepspeed`` command (DeepSpeed's runner) starts the launcher and waits for it; on a
    single node it dies of a plain SIGTERM (``kill <pid>``, a scheduler stopping the command it
    started) without passing it on, and the launcher and its ranks would train on headless. A
    daemon thread sees the launcher re-parented (its parent gone) and sends this rank SIGTERM:
    the step ends, the ranks save and exit as on any SIGTERM."""
    import threading
    import time

    global _runner_pid, _runner_command
    _runner_pid = _parent_of(launcher)
    if _runner_pid is None or _runner_pid <= 1:
        return
    _runner_command = _deepspeed_command(_runner_pid)  # read now: Ctrl-C ends it first

    def watch() -> None:
        global _runner_lost
        while True:
            time.sleep(every_s)
            if _parent_of(launcher) in (None, _runner_pid):
                continue  # still there (None: the launcher itself is gone, PDEATHSIG's case)
            _runner_lost = True
            os.kill(os.getpid(), signal.SIGTERM)
            return

    threading.Thread(target=watch, name="runner-watch", daemon=True).start()


_runner_command: Optional[str] = None


def _deepspeed_command(pid: int) -> Optional[str]:
    """The ``deepspeed ...`` command line of DeepSpeed's runner ``pid`` as a user types it
    (``python .../bin/deepspeed --num_gpus 2 ...`` -> ``deepspeed --num_gpus 2 ...``); None
    where ``pid`` is no runner (under pdsh, a launcher's parent is pdsh's shell)."""
    import shlex

    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return None
    while argv and not argv[-1]:  # the terminating NUL; a rewritten title pads with more
        argv.pop()
    for i, a in enumerate(argv):
        if os.path.basename(a) in ("deepspeed", "ds"):
            return shlex.join(["deepspeed", *argv[i + 1:]])
        if a == "-m" and argv[i + 1:i + 2] == ["deepspeed.launcher.runner"]:
            return shlex.join(["deepspeed", *argv[i + 2:]])
    return None


def job_command() -> Optional[str]:
    """The command that started this job, to run it again (Ctrl-C's resume line): the
    ``deepspeed`` command above this rank's launcher (read as the rank started), or this
    process's own ``llama-train ...`` / ``python -m llama_train.train ...`` command line (a
    whole --multirun sweep: rerunning it resumes each job). None where it cannot be told: a
    multi-node rank (its launcher started by pdsh), a program that embeds the trainer."""
    import shlex

    if _launcher_pid is not None:
        return _runner_command
    argv = list(getattr(sys, "orig_argv", []))
    for i, a in enumerate(argv):
        if a == "-m" and argv[i + 1:i + 2] == ["llama_train.train"]:
            return shlex.join(["llama-train", *argv[i + 2:]])
        if os.path.basename(a) == "llama-train":
            return shlex.join(["llama-train", *argv[i + 1:]])
    return None


def launcher_gone() -> Optional[str]:
    """Which of the processes that started this rank has died: "launcher" (this rank was
    re-parented), "runner" (the ``deepspeed`` command above the launcher), or None. Looked at
    now, not only through the watcher (which looks once a second): the ranks that stop together
    because another rank's watcher saw the runner go say the same as that rank."""
    if _launcher_pid is not None and os.getppid() != _launcher_pid:
        return "launcher"
    if _runner_lost:
        return "runner"
    if _runner_pid is not None and _launcher_pid is not None \
            and _parent_of(_launcher_pid) not in (None, _runner_pid):
        return "runner"
    return None
