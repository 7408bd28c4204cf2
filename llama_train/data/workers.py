"""A rank's DataLoader workers: how each starts (signals, dying with its rank) and how the rank
tells what happened when one dies (which worker, its exit status or signal, what it was doing),
for :class:`llama_train.data.loader.TrainLoader`'s :class:`DataWorkerDied`."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import List, Tuple

from .errors import DataError

def _unwrap_worker_error(e: DataError) -> DataError:
    """torch re-raises a DataLoader worker's exception as the same type whose message is the
    worker's whole traceback; give back the worker's own one-line message (the trainer prints
    it as the error: exit 2, DataChanged 3), of the same type, saying which worker raised it."""
    cls = type(e)
    msg = str(e)
    head, _, rest = msg.partition("\n")
    tag = f"{cls.__module__}.{cls.__qualname__}: "
    at = rest.rfind(tag)
    caught = f"Caught {cls.__name__} "
    if not head.startswith(caught) or at < 0:
        return e
    where = head[len(caught):].rstrip(".")
    return cls(f"{rest[at + len(tag):].strip()} (raised {where})")


_STATES = {
    "T": "is stopped (state T: SIGSTOP, or a job-control stop)",
    "t": "is stopped by a debugger (state t)",
    "D": "is in uninterruptible I/O (state D: a hung file system or disk)",
    "R": "is running (state R: busy, or starved of CPU)",
    "S": "is sleeping (state S: waiting on something)",
    "Z": "has exited (state Z)",
}


def _dead_workers(it, wait_s: float) -> List[Tuple[int, int, int]]:
    """(worker index, pid, exit code: -N for signal N) of the iterator's workers that have
    exited, waiting up to ``wait_s`` for one: a read can fail on a dying worker's socket a moment
    before the process is gone."""
    workers = list(getattr(it, "_workers", None) or [])
    end = time.monotonic() + wait_s
    while True:
        dead = [(i, w.pid, w.exitcode) for i, w in enumerate(workers) if w.exitcode is not None]
        if dead or time.monotonic() >= end:
            return dead
        time.sleep(0.05)


# What a worker's signal says about the cause, and the fix beyond the memory settings.
_SIGNAL_CAUSES = {
    "SIGKILL": "SIGKILL is what the kernel's out-of-memory killer sends when the host runs out "
               "of memory (`dmesg | grep -i oom` or `journalctl -k` names it; else someone ran "
               "kill -9)",
    "SIGSEGV": "a crash in native code (a segmentation fault in torch, numpy or another C "
               "extension; memory exhaustion can end that way too)",
    "SIGBUS": "a bus error: a memory-mapped file vanished under it (a shard truncated, a "
              "network file system gone) or /dev/shm is full (workers hand batches over in "
              "shared memory: `df -h /dev/shm`; give a container more with --shm-size)",
    "SIGABRT": "an abort in native code (a failed assertion, or an allocation that failed)",
}


def _death_of(code: int) -> Tuple[str, str]:
    """(how a worker ended, its likely cause) for its exit code (-N: signal N)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (f"was killed by {name} (signal {-code})",
                _SIGNAL_CAUSES.get(name, f"something sent it {name}"))
    return (f"exited with code {code}",
            "it stopped without a Python error (a native library's exit, or os._exit; the lines "
            "above may say why)")


def _defer_worker_signal_errors() -> None:
    """torch's DataLoader installs a SIGCHLD handler that raises ``RuntimeError("DataLoader
    worker (pid N) is killed by signal")`` wherever the main thread is when a worker dies: in
    the optimizer, in a checkpoint save (reported as a failed save), in a W&B call. Wrapped here
    so that it raises nothing: the loader finds the dead worker at its next read instead (torch
    checks its workers at least every 5 s while it waits for a batch) and says which one died
    and why (:class:`DataWorkerDied`). Main thread only; installed once per process."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGCHLD)
    if not callable(current) or getattr(current, "llama_train_deferred", False):
        return

    def handler(signum, frame) -> None:
        try:
            current(signum, frame)
        except RuntimeError as e:
            if not str(e).startswith("DataLoader worker"):
                raise

    handler.llama_train_deferred = True
    signal.signal(signal.SIGCHLD, handler)


def _describe_state(pid: int) -> str:
    """A process's scheduler state in words (/proc/PID/stat field 3)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        state = s[s.rindex(")") + 2:].split()[0]
    except (OSError, ValueError, IndexError):
        return "(its state unknown: gone?)"
    return _STATES.get(state, f"(state {state})")


def _init_worker(worker_id: int) -> None:
    """A DataLoader worker: stop signals left to the trainer, no life without its rank, and a
    crash left to the rank to report (:class:`DataWorkerDied`): torch's own handlers of SIGSEGV
    and SIGBUS in a worker print a line of their own first ("ERROR: Unexpected bus error
    encountered in worker"), so a crash said two things in two places."""
    _ignore_stop_signals(worker_id)
    _die_with_parent()
    for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE):
        signal.signal(s, signal.SIG_DFL)


def _die_with_parent() -> None:
    """SIGKILL this worker when the rank that forked it dies, however it dies (kill -9,
    os._exit): a worker that is stopped, or ignores SIGTERM, would otherwise outlive it
    (Linux PR_SET_PDEATHSIG; elsewhere nothing)."""
    import multiprocessing

    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(0)


def _ignore_stop_signals(_worker_id: int) -> None:
    """Loader workers leave SIGTERM/SIGINT to the trainer.

    The deepspeed launcher forwards a stop signal to the whole process tree; if the workers died
    of it, the trainer's next batch would raise before it could finish the step and save. The
    trainer shuts its workers down itself, and they exit with their parent in any case.
    """
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _close_if_alive(ref) -> None:
    """At exit, before multiprocessing terminates (SIGTERM) and joins its daemon children."""
    loader = ref()
    if loader is not None:
        loader.close()
