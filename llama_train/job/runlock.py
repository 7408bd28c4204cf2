"""One job per output directory: ``<output_dir>/.lock``, held by rank 0 for the whole run.

Two jobs writing one output directory corrupt each other's saves and interleave their metrics,
so the second one is refused at start (``ConfigError``, exit 2) with the holder's host, pid,
start time and command.

How a holder is recognised, and when its lock counts as stale (docs/reliability.md):

* rank 0 takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the lock file and keeps it open. The kernel
  releases it when the process dies, ``kill -9`` included, so on one host a dead job never
  blocks a relaunch.
* The file also records the holder (host, pid and the pid's start time, job id, since, command)
  and a heartbeat that a daemon thread of the holder rewrites every ``HEARTBEAT_S``. Where flock
  says nothing (another host on a filesystem whose locks are node-local, or no flock support),
  the record decides: a holder on this host is alive while its pid runs with the recorded start
  time; a holder on another host while its heartbeat is younger than ``STALE_S``.
* Ranks other than 0 never lock; before the process group they read the record and refuse when
  a live holder of *another* job (``MASTER_ADDR:MASTER_PORT``) has it, so no rank of a refused
  job waits in a rendezvous that will not happen.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Optional

from llama_train.config import ConfigError

log = logging.getLogger("llama_train")

LOCK_NAME = ".lock"
HEARTBEAT_S = 30.0  # the holder rewrites its record this often
STALE_S = 300.0  # a record from another host with an older heartbeat is stale
_RECORD_BYTES = 4096  # written in place, padded: a reader never sees a half-empty file


def job_id() -> str:
    """The same on every rank of one job, different for two jobs running at the same time (two
    jobs cannot listen on one master address and port at once)."""
    return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


def _pid_start(pid: int) -> Optional[float]:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - gone, no permission, no psutil: unknown
        return None


def _exited(pid: int) -> bool:
    """Whether ``pid`` has ended and only its exit status remains (a zombie: state Z or X in
    /proc). A rank killed with its launcher waits to be reaped by init for a moment, and a
    relaunch right after the kill found its lock "held" by it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False  # no /proc (not Linux), or gone since: os.kill decides


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def read_record(path: Path) -> Optional[Dict[str, Any]]:
    """The holder's record, or None (no file, empty, or being rewritten)."""
    try:
        text = path.read_text(errors="replace").strip()
        return json.loads(text) if text else None
    except (OSError, json.JSONDecodeError):
        return None


def alive(record: Dict[str, Any], now: Optional[float] = None) -> bool:
    """Whether the record's holder still runs, judged from the record alone."""
    now = time.time() if now is None else now
    if record.get("host") == socket.gethostname():
        pid = int(record.get("pid", -1))
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, another user's
        if _exited(pid):  # killed, its exit status not yet collected by its parent (or init)
            return False
        start, want = _pid_start(pid), record.get("pid_start")
        return start is None or want is None or abs(start - float(want)) < 1.0  # pid reused?
    return now - float(record.get("heartbeat", 0.0)) < STALE_S


def describe(record: Optional[Dict[str, Any]]) -> str:
    if not record:
        return "an unknown holder (the lock file is being written)"
    age = time.time() - float(record.get("heartbeat", 0.0))
    return (f"host {record.get('host')} pid {record.get('pid')} since "
            f"{_iso(float(record.get('since', 0.0)))} (heartbeat {age:.0f}s ago; command: "
            f"{record.get('command', '?')})")


def _refuse(output_dir: str, path: Path, record: Optional[Dict[str, Any]]) -> ConfigError:
    return ConfigError(
        f"trainer.output_dir={output_dir!r} is in use by another job: {describe(record)}. Two "
        f"jobs in one output_dir would overwrite each other's checkpoints and metrics. Wait for "
        f"it to finish or stop it, or use another trainer.output_dir. A lock whose holder is "
        f"gone is taken over automatically (same host: at once; another host: "
        f"{STALE_S:.0f}s after its last heartbeat); remove {path} by hand only if you are sure "
        f"no job uses the directory."
    )


EXITING_S = 10.0  # how long a lock whose holder has ended may still be held by its exiting kin


def _flock_once_its_holder_has_ended(fd: int, path: Path) -> None:
    """flock ``path`` (EWOULDBLOCK while another process holds it). The lock is held by the open
    file, which the holder's forked DataLoader workers share: after a kill -9 of the job the
    holder may be gone while they are still exiting. Then it waits for them, up to
    :data:`EXITING_S`, instead of refusing a relaunch for a job that no longer runs."""
    deadline = time.monotonic() + EXITING_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            record = read_record(path)
            if (e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or record is None
                    or record.get("host") != socket.gethostname() or alive(record)
                    or time.monotonic() >= deadline):
                raise
            time.sleep(0.1)


class RunLock:
    """Rank 0's lock on an output directory; :meth:`release` (or process death) gives it up."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: Optional[int] = None
        self._record: Dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.took_over: Optional[Dict[str, Any]] = None  # the stale record replaced, if any

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted as .lock must not make us write its target
        # (preflight refuses it with a message first; this closes the race)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            flock_ok = True
            try:
                _flock_once_its_holder_has_ended(fd, self.path)
            except OSError as e:
                flock_ok = False
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise _refuse(self.output_dir, self.path, read_record(self.path)) from None
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                log.warning("%s: no flock on this filesystem (%s); relying on the holder "
                            "record and its heartbeat", self.path, e.strerror)
            previous = read_record(self.path)
            if previous and previous.get("job") != job_id():
                # flock is authoritative on this host; a holder on another host may not see it
                same_host = previous.get("host") == socket.gethostname()
                if (not same_host or not flock_ok) and alive(previous):
                    raise _refuse(self.output_dir, self.path, previous)
                self.took_over = previous
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        now = time.time()
        self._record = {"host": socket.gethostname(), "pid": os.getpid(),
                        "pid_start": _pid_start(os.getpid()), "job": job_id(), "since": now,
                        "heartbeat": now, "command": " ".join(sys.argv)[:1500]}
        self._write()
        if self.took_over:
            log.warning("took over the lock of %s: its holder %s is gone", self.path,
                        describe(self.took_over))
        self._thread = threading.Thread(target=self._beat, name="runlock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _write(self) -> None:
        data = json.dumps(self._record).encode()
        os.pwrite(self._fd, data.ljust(max(_RECORD_BYTES, len(data))), 0)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._record["heartbeat"] = time.time()
            try:
                self._write()
            except OSError as e:  # a full disk must not kill the run for a heartbeat
                log.warning("lock heartbeat of %s not written: %s", self.path, e)

    def release(self) -> None:
        """Clear the record (so readers without flock see the directory free) and unlock."""
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def check_not_held_by_another_job(output_dir: str) -> None:
    """Ranks other than 0: refuse now if a live job other than ours holds the directory (our
    own rank 0 may already hold it; a stale record is rank 0's to take over)."""
    path = Path(output_dir) / LOCK_NAME
    record = read_record(path)
    if record and record.get("job") != job_id() and alive(record):
        raise _refuse(output_dir, path, record)
