"""Commands started from a warm parent: a `deepspeed` launch without its interpreters' start-up.

A tiny two-rank launch spends ~8 CPU-s starting four interpreters (DeepSpeed's runner, its
launcher and two ranks, each importing torch, DeepSpeed, Hydra and llama_train) for ~1 s of
training; the suite launches ~70 jobs. Here one parent process per test worker imports all of
that once, and each command is *forked* from it instead of exec'd: a separate process that runs
the command's module as ``python -u -m MOD ARGS`` would, with the environment, arguments, working
directory, ``sys.path`` and ``/proc/<pid>/cmdline`` it would have had.

For ``deepspeed ...`` the forked process runs DeepSpeed's own runner (``bin/deepspeed``), which
starts DeepSpeed's own launcher (``deepspeed.launcher.launch``), which starts the ranks: the
launcher's code decides every variable and argument a rank gets, its exit codes, its SIGTERM to
the other ranks when one fails, exactly as under the real command. Only process creation
changes: their ``subprocess.Popen`` of a ``python -u -m MOD`` command forks this warm interpreter
(:class:`ForkedPopen`); anything else is exec'd for real. Signals, exit codes, kills and hangs
happen to real processes. ``tests/system/test_warm_ranks.py`` records what the real launcher gives a
rank (environment, ``sys.argv``, ``sys.orig_argv``, ``sys.path``, working directory, its and its
launcher's command lines, what llama_train reads from them) and fails if this gives anything
different.

What cannot be the same, and why it does not matter to the tests that use it:

* the interpreter's start-up flags and hash seed are the parent's (the same ``python -u`` and an
  unset ``PYTHONHASHSEED`` as the launcher's ranks; ``random`` and numpy are reseeded as a fresh
  interpreter seeds them);
* modules are imported before the environment is the job's, so a command whose environment
  differs from the parent's in a variable not in :data:`RUNTIME_VARS` (read at run time, not at
  import) is exec'd for real instead (:func:`warm_enough`); what those imports write into the
  environment (DeepSpeed sets ``PYTORCH_NVML_BASED_CUDA_CHECK``) is set in each command as its
  own imports would set it;
* the parent's command line is padded (``--pad``) so that a forked process can write its own
  command line over it (as ``setproctitle`` does); ``/proc/<pid>/cmdline`` then ends in empty
  arguments;
* a job with an inductor cache of its own (a compiling one) finds what inductor learns once per
  process already learnt by the parent (:func:`_warm_inductor`): the same answers, not found
  again in each rank.

The tests that launch through this are those where the launcher is not the subject
(``helpers.train``, ``helpers.one_process``); ``launcher=True`` there, and ``helpers.spawn`` /
``helpers.run`` by default, start the real command.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional

# What the ranks import, imported once by the parent (the rest of llama_train comes with these).
# torch._dynamo: every rank imports it (torch.optim's AdamW asks it), 1-4 CPU-s a process.
# Not HF datasets (a rank imports it only to prepare data): pyarrow starts jemalloc's background
# thread, and a process with a second thread is not forked from (serve() checks).
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "deepspeed", "deepspeed.launcher.runner", "deepspeed.launcher.launch",
           "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "hydra", "omegaconf",
           "sentencepiece", "psutil", "llama_train.train", "llama_train.job.trainer",
           "llama_train.engine", "llama_train.data", "llama_train.hf",
           "llama_train.inference.generate")

# Variables a job may set differently from the parent and still be forked: read by the launcher
# and by llama_train at run time, never by an import. Any other difference: exec'd for real.
RUNTIME_VARS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CROSS_RANK", "CROSS_SIZE", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "HYDRA_FULL_ERROR",
    "LLAMA_TRAIN_FAULTS", "LLAMA_TRAIN_WATCHDOG_S", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT",
    "WANDB_ENTITY", "WANDB_API_KEY", "WANDB_SILENT", "WANDB_RUN_ID", "WANDB_RESUME",
    "LLAMA_TRAIN_PROBE_OUT", "LLAMA_TRAIN_PROBE_EXIT", "PYTEST_CURRENT_TEST",
    "HANG_WORKER_STOP",  # tests/workers/hang_worker.py: read as a step runs
    "PATH", "T",  # tests/system/test_docs_commands.py: the venv first on PATH, its tiny arguments
    # read when used, not on import: torch._inductor's cache_dir(), llama_train.paths.cache_dir()
    "TORCHINDUCTOR_CACHE_DIR", "LLAMA_TRAIN_CACHE",
})

PAD = 32768  # bytes of command line a forked process can write its own over


# --------------------------------------------------------------------------- in the forked child

def _interpreter(path: str) -> bool:
    try:
        return os.path.realpath(path) == os.path.realpath(sys.executable)
    except OSError:
        return False


def _script_of(path: str) -> Optional[str]:
    """The interpreter of a file whose ``#!`` line names this interpreter (a console script such
    as ``deepspeed``), else None."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    interp = first[2:].strip().split()[0].decode()
    return interp if _interpreter(interp) else None


def plan(cmd: List[str]) -> Optional[dict]:
    """How to run ``cmd`` in this interpreter, as ``exec`` would: ``python -u -m MOD ARGS``,
    ``python -m MOD ARGS``, ``python [-u] FILE.py ARGS`` or a console script of this
    interpreter; None: exec it for real."""
    if not cmd:
        return None
    if _interpreter(cmd[0]):
        flags, i = [], 1
        while i < len(cmd) and cmd[i] in ("-u",):
            flags.append(cmd[i])
            i += 1
        if i + 1 < len(cmd) and cmd[i] == "-m":
            return {"module": cmd[i + 1], "args": cmd[i + 2:], "unbuffered": "-u" in flags,
                    "executable": os.path.abspath(cmd[0]), "cmdline": list(cmd)}
        if i < len(cmd) and cmd[i].endswith(".py") and os.path.isfile(cmd[i]):
            # python [-u] FILE ARGS (the launcher's ranks of a script): run as the file
            return {"script": cmd[i], "args": cmd[i + 1:], "unbuffered": "-u" in flags,
                    "executable": os.path.abspath(cmd[0]), "cmdline": list(cmd)}
        return None
    interp = _script_of(cmd[0]) if os.sep in cmd[0] else None
    if interp:  # the kernel runs it as [interpreter, script, args...]
        return {"script": cmd[0], "args": cmd[1:], "unbuffered": False,
                "executable": interp, "cmdline": [interp, *cmd]}
    return None


_BASE: Dict[str, object] = {}  # the parent's environment and sys.path, as it started
_PRIVATE: List[int] = []  # the parent's own descriptors, closed in what it forks


def _launcher(how: dict) -> bool:
    """DeepSpeed's runner (the ``deepspeed`` script) or its launcher module."""
    if "module" in how:
        return how["module"].startswith("deepspeed.launcher.")
    return os.path.basename(how["script"]) in ("deepspeed", "ds")


def warm_enough(env: Dict[str, str]) -> Optional[str]:
    """Why ``env`` cannot run in this interpreter (a variable an import may have read differs),
    or None."""
    base, imported = _BASE["env"], _BASE["import_env"]
    for k in sorted(set(base) | set(env)):
        if base.get(k) == env.get(k) or k in RUNTIME_VARS:
            continue
        if k in imported and env.get(k) == imported[k]:
            continue  # what the command's own import would set
        return f"{k} differs from the warm parent's"
    return None


def _set_cmdline(argv: List[str]) -> None:
    """Write ``argv`` over this process's command line (what ``/proc/<pid>/cmdline``, ps and
    psutil show), NUL-separated and NUL-padded to the original area (``setproctitle``'s way)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: stat fields 48, 49
    data = b"\0".join(a.encode() for a in argv) + b"\0"
    if len(data) > end - start:
        raise RuntimeError(f"command line of {len(data)} bytes over the {end - start} reserved")
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _sys_path(first: str, env: Dict[str, str]) -> List[str]:
    """``sys.path`` as a fresh interpreter builds it: the script's directory (or, for ``-m``, the
    working directory), ``PYTHONPATH``, then the installation's own entries."""
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *_BASE["site_path"]]


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def run_here(cmd: List[str], env: Dict[str, str], how: dict) -> int:
    """Become ``cmd``: its environment, arguments, command line and ``sys.path``; run its
    module as ``__main__``; leave as the interpreter would (non-daemon threads joined, exit
    handlers run, streams flushed). Returns the exit code (-SIGINT: re-raise it)."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    for k, v in _BASE["import_env"].items():  # as the command's own imports would set them
        os.environ.setdefault(k, v)
    _set_cmdline(how["cmdline"])
    sys.orig_argv = list(how["cmdline"])
    sys.executable = how["executable"]
    if how["unbuffered"]:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    import random

    random.seed()  # a fresh interpreter seeds from the OS; forks would share the parent's state
    # the loggers as the imports left them: a rank forked from DeepSpeed's launcher would keep
    # the level its --log_level set (INFO), where a rank it exec's starts at DeepSpeed's WARNING
    _restore_log_levels(_BASE["log_levels"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if _launcher(how):
        subprocess.Popen = ForkedPopen  # the launcher it starts and the ranks are forked too
    else:
        subprocess.Popen = _REAL_POPEN
    code = 0
    try:
        if "module" in how:
            sys.path[:] = _sys_path(os.getcwd(), env)
            sys.argv = ["-m", *how["args"]]  # run_module sets argv[0] to the module's file
            runpy.run_module(how["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[:] = _sys_path(os.path.dirname(os.path.realpath(how["script"])), env)
            sys.argv = [how["script"], *how["args"]]
            runpy.run_path(how["script"], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter prints it and exits 1
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # noqa: SLF001 - what the interpreter does before exit handlers
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    return code


def _leave(code: int) -> None:
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt: the interpreter dies of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _log_levels() -> Dict[str, tuple]:
    """Each logger's level and its handlers' levels."""
    import logging

    loggers = [logging.getLogger(), *[x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger)]]
    return {lg.name: (lg.level, [h.level for h in lg.handlers]) for lg in loggers}


def _restore_log_levels(levels: Dict[str, tuple]) -> None:
    import logging

    for name, (level, handlers) in levels.items():
        lg = logging.getLogger(name if name != "root" else None)
        lg.setLevel(level)
        for h, hl in zip(lg.handlers, handlers):
            h.setLevel(hl)


def _child(cmd, env, how, stdout=None, stderr=None) -> None:
    """In a freshly forked process: exec-like set-up, then :func:`run_here`; never returns."""
    code = 1
    try:
        if stdout is not None:
            os.dup2(stdout, 1)
        if stderr is not None:
            os.dup2(stderr, 2)
        code = run_here(cmd, env, how)
    except BaseException:  # noqa: BLE001 - nothing may return into the parent's code
        traceback.print_exc()
    finally:
        _leave(code)


def _fd(stream) -> Optional[int]:
    if stream is None:
        return None
    if stream == subprocess.STDOUT:
        return 1
    return stream if isinstance(stream, int) else stream.fileno()


class _Signals:
    """``Popen``'s signalling, for a process whose ``pid`` and ``returncode`` the subclass has."""

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedPopen(_Signals):
    """``subprocess.Popen`` for DeepSpeed's runner and launcher: a ``python -u -m MOD`` command
    whose environment the warm interpreter can run is forked, anything else started by the real
    ``Popen``. Has what the runner and the launcher use: pid, poll, wait, returncode,
    send_signal, terminate, kill."""

    def __new__(cls, args, *a, env=None, stdout=None, stderr=None, **kw):
        how = plan(list(args)) if not a and not kw else None
        env = dict(os.environ if env is None else env)
        if how is None or warm_enough(env) is not None:
            return _REAL_POPEN(args, *a, env=env, stdout=stdout, stderr=stderr, **kw)
        self = super().__new__(cls)
        self.args, self.returncode = list(args), None
        out, err = _fd(stdout), _fd(stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(self.args, env, how, out, err)
        self.pid = pid
        return self

    def __init__(self, *a, **kw):
        pass

    def _status(self, status: int) -> int:
        self.returncode = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                           else os.WEXITSTATUS(status))
        return self.returncode

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self._status(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode



_REAL_POPEN = subprocess.Popen


# --------------------------------------------------------------------------- the warm parent

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve() -> None:
    """The warm parent: import :data:`PRELOAD`, then answer one JSON request per stdin line,
    ``{"id", "cmd", "env", "cwd", "log"}``, by forking the command into a session of its own
    (``start_new_session``) with stdout and stderr appended to ``log``; replies
    ``{"id", "pid"}`` (or ``{"id", "error"}``: the client execs the command itself), and
    ``{"pid", "rc"}`` when a command ends. Exits when stdin closes."""
    import importlib

    # modules resolve as for the commands it runs (``-m`` in the same working directory): the
    # working directory first, not this file's directory
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[0] = os.getcwd()
    out = os.dup(1)  # the replies' pipe, kept from what imports and jobs print
    _PRIVATE.append(out)
    os.dup2(2, 1)
    _BASE["env"] = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports set in the environment (DeepSpeed: PYTORCH_NVML_BASED_CUDA_CHECK=1)
    _BASE["import_env"] = {k: v for k, v in os.environ.items() if _BASE["env"].get(k) != v}
    extra = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE["site_path"] = [p for p in sys.path[1:] if p != here and p not in extra]
    _BASE["log_levels"] = _log_levels()
    threads = _threads()  # a fork copies one thread: any other's locks could stay held
    # what the imports made, out of the collector's sight: a child's collections would walk
    # (and copy-on-write) the whole inherited heap, ~1 CPU-s per process
    gc.collect()
    gc.freeze()

    def reply(msg: dict) -> None:
        os.write(out, (json.dumps(msg) + "\n").encode())

    reply({"ready": threads == 1, "threads": threads})
    buf, jobs, closed = b"", set(), False
    while not closed or jobs:  # stdin closed: no more requests; the jobs running still reported
        ready, _, _ = select.select([] if closed else [0], [], [], 0.02)
        while jobs:  # reap ours
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            jobs.discard(pid)
            reply({"pid": pid, "rc": -os.WTERMSIG(status) if os.WIFSIGNALED(status)
                   else os.WEXITSTATUS(status)})
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            closed = True
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            why = warm_enough(req["env"]) if threads == 1 else f"{threads} threads in the parent"
            how = plan(req["cmd"]) if why is None else None
            if how is None:
                reply({"id": req["id"], "error": why or "not a command of this interpreter"})
                continue
            if _compiles(req["env"]):
                _warm_inductor(req["env"])
                threads = _threads()  # the next requests exec'd if it left a thread
            pid = _start(req, how)
            jobs.add(pid)
            reply({"id": req["id"], "pid": pid})


def _compiles(env: Dict[str, str]) -> bool:
    """Whether ``env`` is the first job's given an inductor cache of its own (those of
    tests/job/test_compile.py, which compile)."""
    base = _BASE["env"].get("TORCHINDUCTOR_CACHE_DIR")
    return "inductor" not in _BASE and env.get("TORCHINDUCTOR_CACHE_DIR", base) != base


def _warm_inductor(env: Dict[str, str]) -> None:
    """What every process that compiles finds out anew, found here once for the processes
    forked after it (each keeps it in memory): the vector instruction sets the CPU and compiler
    support (inductor builds a probe for each, in the job's cache, and loads each in a new
    interpreter: ~1.5 CPU-s a rank) and the hash of torch's sources (~0.3 s). Should it fail,
    each rank finds them as before."""
    from torch._inductor import codecache, cpu_vec_isa

    _BASE["inductor"] = True
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"]
    try:
        cpu_vec_isa.valid_vec_isa_list()
        codecache.torch_key()
    except Exception:  # noqa: BLE001 - an optimisation only
        traceback.print_exc()
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _start(req: dict, how: dict) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            for fd in _PRIVATE:
                os.close(fd)
            log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.chdir(req["cwd"])
            _child(req["cmd"], req["env"], how, log, log)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            _leave(code)
    for _ in range(10000):  # its own session before the client may signal its group
        try:
            if os.getpgid(pid) == pid:
                break
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    return pid


# --------------------------------------------------------------------------- in the test process

class WarmJob(_Signals):
    """A command the warm parent forked, with the ``subprocess.Popen`` interface the tests use
    (pid, poll, wait, returncode, send_signal, terminate, kill). Its process is the warm
    parent's child, not ours: its exit code comes from the parent."""

    def __init__(self, server: "WarmServer", pid: int, args: List[str]):
        self.server, self.pid, self.args = server, pid, args

    @property
    def returncode(self) -> Optional[int]:
        return self.server.rc.get(self.pid)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        with self.server.cond:
            if not self.server.cond.wait_for(lambda: self.pid in self.server.rc or
                                             self.server.dead, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        if self.pid not in self.server.rc:
            raise RuntimeError(f"the warm parent died before {self.args[:4]} ended")
        return self.server.rc[self.pid]



class WarmServer:
    """The warm parent of this test process: started on first use with the environment the
    launches get (``env``), stopped when this process exits."""

    def __init__(self, env: Dict[str, str], cwd: str):
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "serve", "--pad", "_" * PAD]
        self.proc = _REAL_POPEN(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        self.env = env
        self.cond = threading.Condition()
        self.rc: Dict[int, int] = {}
        self.replies: Dict[int, dict] = {}
        self.dead, self.next_id = False, 0
        first = json.loads(self.proc.stdout.readline() or b'{"ready": false}')
        self.usable, self.why = first.get("ready", False), first
        threading.Thread(target=self._read, name="warm-ranks", daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "rc" in msg:
                    self.rc[msg["pid"]] = msg["rc"]
                else:
                    self.replies[msg["id"]] = msg
                self.cond.notify_all()
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def start(self, cmd: List[str], env: Dict[str, str], cwd: str, log: str) -> Optional[WarmJob]:
        """``cmd`` forked with ``env`` in ``cwd``, its output appended to ``log``; None where it
        must be exec'd for real (:func:`warm_enough`, :func:`plan`)."""
        if not self.usable or self.dead:
            return None
        with self.cond:
            self.next_id += 1
            rid = self.next_id
        req = {"id": rid, "cmd": [str(c) for c in cmd], "env": env, "cwd": str(cwd),
               "log": str(log)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        with self.cond:
            self.cond.wait_for(lambda: rid in self.replies or self.dead, 60)
            msg = self.replies.pop(rid, None)
        if msg is None or "pid" not in msg:
            self.why = msg
            return None
        return WarmJob(self, msg["pid"], req["cmd"])

    def retire(self) -> None:
        """No more commands; it ends once those it runs have ended (their codes still come)."""
        self.usable = False
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        self.retire()
        try:
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve()
