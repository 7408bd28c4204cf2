"""A rank that stops making progress stops the whole job (exit 5) instead of hanging it forever.

Every rank of a multi-rank job runs it, started by :func:`llama_train.engine.init_distributed`
as soon as the process group is up, so every entry point has it: two daemon threads. About once
a second (and soon after the loop reports a new step or phase) the I/O thread

* publishes this rank's heartbeat (a counter, and the step and phase the loop last reported
  through :func:`note`) to the rendezvous store (rank 0's TCPStore, on a connection of its own
  with short timeouts);
* reads the heartbeat of the rank it watches (the next one on a ring, so the store's load grows
  with the world size, not with its square) and the job's ``abort`` key.

The other thread judges, from the times at which the I/O thread last got through and last saw
the watched rank's counter move; it never calls the store itself (a TCPStore call to a stopped
rank 0 can block far past its timeout).

The heartbeat comes from a thread, not from the loop, so a long but live step, eval or save
never looks like a hang: only a process that cannot run at all (stopped, frozen in the kernel, a
C call that holds the GIL) or that is gone stops beating. When the watched rank's counter has
not moved for ``comm.timeout_s`` seconds, or rank 0 (which hosts the store) has not answered for
that long, this rank prints one line naming the rank and the step it last reported, writes it to
the ``abort`` key (every other rank exits as soon as it reads it) and exits with code 5 through
``os._exit``: a collective may be stuck in C++, where a normal shutdown would hang too.

A frozen process cannot run its own exit, and the DeepSpeed launcher gives a process 30 s after
SIGTERM before it sends SIGKILL. So when the frozen rank runs on this host (same host, boot and
PID namespace, and the same process start time as it published), this rank leaves behind a
3-line reaper that SIGKILLs it a few seconds later, after the launcher has recorded this rank's
exit code 5. Ranks on other hosts are left to their own launcher.

A rank whose loop is stuck while its threads run keeps beating: the collective timeout fails the
others, which name it and post the ``abort`` key (:func:`abort_job`). Every rank that stops
through the watchdog prints its threads' stacks first, so a stuck loop shows where it is.

Never a false alarm from this process's own pauses: if the judging thread itself did not run
for a while (the whole process stopped, or starved), it gives every peer a fresh ``comm.timeout_s``
instead of blaming them. The threads stop by themselves when the process group it was started for is
destroyed, and at interpreter exit; a rank that stops cleanly says so, and is no longer watched.

A rank waiting for its own data is not seen by any of this: its heartbeat runs, and a rank
that waits in no collective (every rank stuck on a hung file system) is timed out by nothing.
So the loop's waits for data are a :class:`Deadline` (the data loader enters one around each
batch, ``comm.timeout_s`` long): one more daemon thread, in every process that uses one (a world
of one included), exits the rank with code 5 when a wait outlives its deadline, with one line
naming the rank, the step and what it waited for, after the deadline's own ``on_expiry`` has said
why and cleaned up (the loader SIGKILLs its workers: a stopped one ignores SIGTERM), telling the
other ranks through the ``abort`` key as above. The same freeze rule holds: a process that did not
run for a while gives its waits a fresh deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from llama_train.util import say_error

log = logging.getLogger("llama_train")

EXIT_LOST_RANK = 5  # the exit code of llama_train.train for a lost rank (docs/reliability.md)
PREFIX = "llama_train/watchdog/"
EXITED = "exited"
MIN_GAP_S = 0.1  # between two heartbeats
REAP_DELAY_S = 3.0  # > the launcher's 1 s poll: it records this rank's exit code first
# Collectives time out this much later than the watchdog's verdict: the watchdog, which names the
# rank and step and clears a frozen local rank away, speaks first; the collective timeout stays
# the backstop for a rank whose heartbeat thread runs while its loop is stuck.
COLLECTIVE_MARGIN_S = 5

_position: Dict[str, Any] = {"step": None, "phase": "start"}
_changed = threading.Event()  # the position changed: publish it soon
_current: Optional["Watchdog"] = None
_lock = threading.Lock()


def note(step: Optional[int] = None, phase: Optional[str] = None) -> None:
    """Where this rank's loop is: the step it works on and the phase (train, eval, save, load).
    Two dict writes, no I/O: call it as often as you like. The watchdog publishes it with the
    next heartbeat and names it when this rank, or the rank it waits for, stops."""
    if step is not None:
        _position["step"] = int(step)
    if phase is not None:
        _position["phase"] = phase
    _changed.set()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """``note(phase=name)`` for the duration of a block, then the phase before it again."""
    before = _position["phase"]
    note(phase=name)
    try:
        yield
    finally:
        note(phase=before)


def position() -> Tuple[Optional[int], str]:
    return _position["step"], _position["phase"]


def describe(step: Optional[int], phase: str) -> str:
    return f"step {step} ({phase})" if step is not None else f"start-up ({phase})"


def start(timeout_s: float, rank: int, world_size: int) -> Optional["Watchdog"]:
    """The watchdog of the current default process group (started once; a later call for the
    same group returns the running one). None for a world of one: nobody to wait for."""
    import torch.distributed as dist

    global _current
    if world_size < 2:
        return None
    group = dist.group.WORLD
    with _lock:
        if _current is not None and _current.is_alive() and _current.group is group:
            return _current
        if _current is not None:
            _current.stop()
        _current = Watchdog(group, rank, world_size, float(timeout_s),
                            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        _current.start()
        # atexit runs last-registered first: registered now, after the process group exists,
        # our threads are joined and the store client closed before torch tears its group down
        atexit.register(stop)
        return _current


def abort_job(msg: str) -> None:
    """Tell every other rank to stop, with ``msg`` (the ``abort`` key its watchdog reads about
    once a second): for a rank that leaves because a collective failed, so a peer whose loop is
    stuck while its heartbeat runs (which the collective timeout cannot reach) shows where it
    was and exits too, instead of waiting for the launcher's SIGKILL. Best effort, 1 s at most."""
    dog = _current
    if dog is not None and dog.is_alive():
        dog._posted_abort = True  # its own rank leaves by its own way (exit code, timing)
        dog._post_abort(msg)


def stop() -> None:
    """Stop the running watchdog (if any), telling the rank that watches this one."""
    with _lock:
        if _current is not None:
            _current.stop()


atexit.register(stop)


class Deadline:
    """A wait of this rank's loop that must end within ``timeout_s`` (``with deadline: ...``),
    e.g. for the next batch of the data loader. Entering and leaving cost ~1 µs (0.8 measured),
    so it can wrap every micro-batch. If a wait outlives it, the deadline thread exits
    the rank with code 5 (see the module's docstring): one line "rank R has waited N s for its
    <what> at step S (<key>=T): <on_expiry()'s words>", every thread's stack, the other ranks
    told. ``on_expiry`` runs in that thread while the wait goes on: it says why and cleans up."""

    def __init__(self, what: str, timeout_s: float, rank: int,
                 on_expiry: Optional[Callable[[], str]] = None, key: str = "comm.timeout_s"):
        if not timeout_s > 0:
            raise ValueError(f"{key}={timeout_s} must be a positive number of seconds")
        self.what, self.timeout_s, self.rank, self.key = what, float(timeout_s), rank, key
        self.on_expiry = on_expiry
        self.since: Optional[float] = None  # monotonic start of the wait in progress
        self.expired = False  # set by the deadline thread before it stops the rank

    def __enter__(self) -> "Deadline":
        self.since = time.monotonic()
        _DeadlineThread.watch(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.since = None
        if exc_type is not None and issubclass(exc_type, Exception) and self.expired:
            # The wait failed because the deadline ended it (the data loader raises once
            # on_expiry has killed its workers): sleep while the deadline thread stops the rank
            # with its own line and exit 5, instead of raising into the exit path beside it (a
            # run under load once exited 5 with Hydra's "Error executing job" and neither
            # thread's message). Raise after 30 s if the rank is somehow still alive.
            time.sleep(30.0)


class _DeadlineThread(threading.Thread):
    """The one thread per process that times the :class:`Deadline` s; it only reads their
    ``since`` (never writes it: no race with the loop leaving a wait)."""

    _running: Optional["_DeadlineThread"] = None

    def __init__(self):
        super().__init__(name="llama_train-deadlines", daemon=True)
        self.pid = os.getpid()
        self.deadlines: "weakref.WeakSet[Deadline]" = weakref.WeakSet()

    @classmethod
    def watch(cls, deadline: Deadline) -> None:
        t = cls._running
        if t is None or t.pid != os.getpid() or not t.is_alive():  # first use, or a fork
            with _lock:
                t = cls._running
                if t is None or t.pid != os.getpid() or not t.is_alive():
                    t = cls._running = _DeadlineThread()
                    t.start()
        if deadline not in t.deadlines:
            t.deadlines.add(deadline)

    def run(self) -> None:
        last = thawed = time.monotonic()
        while True:
            ds = list(self.deadlines)
            shortest = min((d.timeout_s for d in ds), default=10.0)
            interval = min(1.0, max(0.05, shortest / 10))
            time.sleep(interval)
            now = time.monotonic()
            if now - last > interval + max(2.0, shortest / 2):
                thawed = now  # this process did not run for a while: every wait starts afresh
            last = now
            for d in ds:
                since = d.since
                if since is not None and now - max(since, thawed) > d.timeout_s:
                    _expire(d, now - since)


def _expire(d: Deadline, waited: float) -> None:
    d.expired = True
    step, _ = position()
    where = f"at step {step}" if step is not None else "at start-up"
    why = ""
    if d.on_expiry is not None:
        try:
            why = f": {d.on_expiry()}"
        except Exception as e:  # noqa: BLE001 - the exit must happen whatever the cleanup does
            why = f": ({type(e).__name__} while looking: {e})"
    msg = (f"rank {d.rank} has waited {waited:.0f} s for its {d.what} {where} "
           f"({d.key}={d.timeout_s:g}){why}. Rank {d.rank} stops rather than wait forever.")
    abort_job(msg)  # the other ranks (waiting for this one in a collective) stop now too
    _exit(msg, d.rank)


class Watchdog(threading.Thread):
    """The judging thread; a second thread (``_beat``) does all the store I/O. Store calls can
    block far longer than the store's timeout when rank 0 is stopped (a TCPStore ``check`` on a
    stopped server waits for its reply indefinitely), so the judge never calls the store: it
    only reads the times at which the I/O thread last succeeded and last saw the peer move."""

    def __init__(self, group, rank: int, world_size: int, timeout_s: float, host: str, port: int):
        super().__init__(name="llama_train-watchdog", daemon=True)
        self.group, self.rank, self.world = group, rank, world_size
        self.timeout_s = timeout_s
        self.interval = min(1.0, max(0.1, timeout_s / 10))
        self.op_timeout = min(5.0, max(1.0, timeout_s / 4))
        # a gap this long between two of the judge's checks means this process did not run
        self.freeze_s = self.interval + max(2.0, timeout_s / 2)
        self.host, self.port = host, port
        self.peer = (rank + 1) % world_size  # the ring: rank r watches r+1
        self._halt = threading.Event()
        self._store = None
        self._ids: Dict[int, dict] = {}  # rank -> its published identity (host, pid, start)
        self._beat = 0
        now = time.monotonic()
        # written by the I/O thread, read by the judge (single assignments: no lock needed)
        self._store_ok = now  # last round of store calls that all succeeded
        self._err: Optional[BaseException] = None
        self._peer_beat, self._peer_at, self._peer_pos = None, now, (None, "start")
        self._peer_exited = False
        self._rank0_pos: Tuple[Optional[int], str] = (None, "unknown")
        self._abort: Optional[str] = None
        self._posted_abort = False  # this rank posted the abort: it is not told by it
        self._io = threading.Thread(target=self._io_loop, name="llama_train-watchdog-io",
                                    daemon=True)

    # -- the judge -----------------------------------------------------------------------------
    def run(self) -> None:
        import torch.distributed as dist

        self._io.start()
        last = time.monotonic()
        while not self._halt.wait(self.interval):
            if not dist.is_initialized() or dist.group.WORLD is not self.group:
                break  # the group this watchdog was started for is gone
            now = time.monotonic()
            if now - last > self.freeze_s:
                # this process did not run for a while: peers get a fresh window, no blame
                self._store_ok = self._peer_at = now
            last = now
            if self._abort is not None and not self._posted_abort:
                _exit(f"rank {self.rank} stops (at {describe(*position())}) because another "
                      f"rank did: {self._abort}", self.rank)
            silent = now - self._store_ok
            if self.rank != 0 and silent > self.timeout_s:
                err = self._err
                step, phase = self._peer_pos if self.peer == 0 else self._rank0_pos
                self._fire(0, step, phase,
                           f"rank 0, which hosts the rendezvous store at {self.host}:{self.port},"
                           f" has not answered for {silent:.0f}s"
                           f"{f' ({type(err).__name__})' if err is not None else ''}",
                           store_ok=False)
            stale = now - self._peer_at
            if not self._peer_exited and stale > self.timeout_s:
                step, phase = self._peer_pos
                self._fire(self.peer, step, phase,
                           f"rank {self.peer} has not made progress for {stale:.0f}s",
                           store_ok=silent < 2 * self.interval + self.op_timeout)
        self._halt.set()

    def stop(self) -> None:
        """Halt both threads and wait for them: a daemon thread still inside a store call when
        the interpreter finalizes is torn down mid-C++ and aborts the process ("terminate called
        without an active exception", exit -6 at the end of a good run)."""
        self._halt.set()
        _changed.set()
        me = threading.current_thread()
        for t in (self, self._io):
            if t.is_alive() and t is not me:
                t.join(timeout=self.op_timeout + 2.0)
        if not self._io.is_alive():
            self._store = None  # close the client here, not during interpreter teardown

    def _fire(self, lost: int, step, phase, why: str, store_ok: bool) -> None:
        if self._halt.is_set():
            return  # stopping cleanly: a peer that left first is not lost
        msg = (f"rank {self.rank} stops the job: {why} (comm.timeout_s={self.timeout_s:g}); "
               f"rank {lost} last reported {describe(step, phase)}, rank {self.rank} is at "
               f"{describe(*position())}. Rank {lost} is hung or gone.")
        if store_ok:  # every other rank reads it and exits at once
            self._post_abort(msg)
        self._reap_if_local(lost)
        _exit(msg, self.rank)

    def _post_abort(self, msg: str) -> None:
        """Publish ``msg`` as the job's ``abort`` key (best effort, 1 s at most: from a thread,
        since a store call to a stopped rank 0 can block far longer)."""
        t = threading.Thread(target=self._publish_abort, args=(msg,), daemon=True)
        t.start()
        t.join(timeout=1.0)

    def _publish_abort(self, msg: str) -> None:
        try:
            self._connect().set(f"{PREFIX}abort", msg)
        except Exception:  # noqa: BLE001
            pass

    # -- the store I/O -------------------------------------------------------------------------
    def _io_loop(self) -> None:
        last = 0.0
        while not self._halt.is_set():
            # a beat every interval, and soon after the loop reports a new position (at most
            # every MIN_GAP_S), so a rank that stops is named at the step it stopped in
            _changed.wait(self.interval)
            _changed.clear()
            if self._halt.wait(max(0.0, MIN_GAP_S - (time.monotonic() - last))):
                break
            last = time.monotonic()
            try:
                self._round()
                self._store_ok, self._err = time.monotonic(), None
            except Exception as e:  # noqa: BLE001 - store unreachable or timed out: no news
                self._err = e
                self._store = None  # reconnect: a timed-out connection may be out of step
        self._say_exited()

    def _round(self) -> None:
        store = self._connect()
        self._beat += 1
        step, phase = position()
        store.set(f"{PREFIX}hb/{self.rank}", json.dumps([self._beat, step, phase]))
        if store.check([f"{PREFIX}abort"]):
            self._abort = store.get(f"{PREFIX}abort").decode(errors="replace")
        key = f"{PREFIX}hb/{self.peer}"
        if not self._peer_exited and store.check([key]):
            raw = store.get(key).decode()
            if raw == EXITED:
                self._peer_exited = True
            else:
                beat, pstep, pphase = json.loads(raw)
                if beat != self._peer_beat:
                    self._peer_beat, self._peer_pos = beat, (pstep, pphase)
                    self._peer_at = time.monotonic()
        if self.peer != 0 and self.rank != 0 and store.check([f"{PREFIX}hb/0"]):
            raw = store.get(f"{PREFIX}hb/0").decode()  # only to name rank 0's step if it stops
            if raw != EXITED:
                self._rank0_pos = tuple(json.loads(raw)[1:])
        for r in {self.peer, 0} - set(self._ids) - {self.rank}:
            if store.check([f"{PREFIX}id/{r}"]):
                self._ids[r] = json.loads(store.get(f"{PREFIX}id/{r}"))

    def _connect(self):
        if self._store is None:
            import torch.distributed as dist

            store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=self.op_timeout))
            if self._beat == 0:
                store.set(f"{PREFIX}id/{self.rank}", json.dumps(_identity(os.getpid())))
            self._store = store
        return self._store

    def _say_exited(self) -> None:
        """A rank that stops cleanly is no longer watched (best effort, on the open connection
        only: at the end of a job rank 0 and its store may be gone already)."""
        try:
            if self._store is not None:
                self._store.set(f"{PREFIX}hb/{self.rank}", EXITED)
        except Exception:  # noqa: BLE001
            pass

    def _reap_if_local(self, lost: int) -> None:
        """SIGKILL the frozen rank a few seconds from now if it runs on this host: it cannot run
        its own exit, and the launcher would give it 30 s after SIGTERM."""
        ident = self._ids.get(lost)
        if not ident or ident.get("pid") is None:
            return
        mine = _identity(os.getpid())
        if any(ident.get(k) != mine.get(k) for k in ("host", "boot", "pidns")):
            return
        if _start_time(ident["pid"]) != ident.get("start"):
            return  # gone already, or the pid now belongs to another process
        reaper = ("import os,sys,time\n"
                  "pid,start=int(sys.argv[1]),sys.argv[2]\n"
                  "time.sleep(float(sys.argv[3]))\n"
                  "try:\n"
                  "    s=open(f'/proc/{pid}/stat').read()\n"
                  "    if s[s.rindex(')')+2:].split()[19]==start: os.kill(pid,9)\n"
                  "except (OSError,ValueError): pass\n")
        try:
            subprocess.Popen([sys.executable, "-I", "-S", "-c", reaper, str(ident["pid"]),
                              str(ident["start"]), str(REAP_DELAY_S)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, close_fds=True)
            log.error("rank %d: rank %d (pid %d on this host) will be killed in %.0fs",
                      self.rank, lost, ident["pid"], REAP_DELAY_S)
        except OSError:
            pass


def _exit(msg: str, rank: int) -> None:
    say_error(f"{msg} Exiting with code {EXIT_LOST_RANK}; relaunch the job: it resumes from "
              f"the last complete checkpoint.")
    dump_threads(f"rank {rank}'s threads as it stops (its loop is thread "
                 f"0x{threading.main_thread().ident:016x})")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_LOST_RANK)


def dump_threads(title: str) -> None:
    """Every thread's Python stack to stderr (faulthandler: it needs neither the GIL nor a
    working loop), after one line naming the process: where a job that stops was."""
    import faulthandler

    try:
        sys.stderr.flush()
        print(f"--- {title}, pid {os.getpid()}:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # stderr is no file
        pass


def _identity(pid: int) -> dict:
    """What tells whether another rank's pid is a process on this machine, and which one."""
    def read(path: str) -> Optional[str]:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot": read("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns, "pid": pid, "start": _start_time(pid)}


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None
