"""Commands started from a warm parent: a `deepspeed` launch without its interpreters' start-up.

A tiny two-rank launch spends ~8 CPU-s starting four interpreters (DeepSpeed's runner, its
launcher and two ranks, each importing torch, DeepSpeed, Hydra and llama_train) for ~1 s of
training; the suite launches ~70 jobs. Here one parent process per test worker (and per
environment it launches with: tests/helpers.py keeps the last 3) imports all of that once, and
each command is *forked* from it instead of exec'd: a separate process that runs
the command's module as ``python -u -m MOD ARGS`` would, with the environment, arguments, working
directory, ``sys.path`` and ``/proc/<pid>/cmdline`` it would have had.

For ``deepspeed ...`` the forked process runs DeepSpeed's own runner (``bin/deepspeed``), which
starts DeepSpeed's own launcher (``deepspeed.launcher.launch``), which starts the ranks: the
launcher's code decides every variable and argument a rank gets, its exit codes, its SIGTERM to
the other ranks when one fails, exactly as under the real command. Only process creation
changes: their ``subprocess.Popen`` is :class:`ForkedPopen`, a ``Popen`` whose child, when it is
a command of this interpreter, is forked from it instead of exec'd, with the descriptors, working
directory, session, signal dispositions and exit handlers exec would leave it; anything else is
exec'd for real. The benchmarks and the kill -9 drill, which launch jobs to measure or check
something else, get it too (:data:`CHILDREN_FORKED_MODULES`), whatever ``Popen`` form they use
(``run``, ``call``, pipes, ``capture_output``, ``cwd``, ``start_new_session``...). Signals, exit
codes, kills and hangs happen to real processes. ``tests/system/test_warm_ranks.py`` records what
the real launcher gives a rank, and what an exec'd child of ``Popen`` gets (environment,
``sys.argv``, ``sys.orig_argv``, ``sys.path``, working directory, command lines, descriptors,
session, signal dispositions, what llama_train reads from them) and fails if this gives anything
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
* memory: a fork does not copy the page tables of file mappings (the libraries' code), so each
  forked process maps in the file pages the parent's imports mapped (``MADV_POPULATE_READ``),
  and its RSS counts about what an exec'd interpreter's does (within 3%; llama-bench memory
  measures the peak above idle RSS); ``MALLOC_MMAP_THRESHOLD_`` (its ranks') is applied as glibc
  applies it at start-up, ``mallopt``, but over the heap the parent's imports left;
* modules a command imported stay imported in the processes it forks (``runpy`` runs the
  child's ``__main__`` afresh);
* the parent's command line is padded (``--pad``) so that a forked process can write its own
  command line over it (as ``setproctitle`` does); ``/proc/<pid>/cmdline`` then ends in empty
  arguments;
* Hydra's composition is remembered, as in the test processes (tests/hydra_memo.py, filled
  with the tiny settings' before the first fork: :func:`_remember_compositions`): the same
  config, composed in a fifth of the CPU;
* a job with an inductor cache of its own (a compiling one) finds what inductor learns once per
  process already learnt by the parent (:func:`_warm_inductor`): the same answers, not found
  again in each rank.

The tests that launch through this are those where the launcher is not the subject
(``helpers.train``, ``helpers.one_process``); ``launcher=True`` there, and ``helpers.spawn`` /
``helpers.run`` by default, start the real command.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import inspect
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Dict, List, Optional, Tuple

# What the ranks import, imported once by the parent (the rest of llama_train comes with these).
# torch._dynamo: every rank imports it (torch.optim's AdamW asks it), 1-4 CPU-s a process.
# Not HF datasets (a rank imports it only to prepare data): pyarrow starts jemalloc's background
# thread, and a process with a second thread is not forked from (serve() checks).
# From "deepspeed.module_inject.auto_ep_config" on: what the ranks of the tiny runs still
# imported themselves, ~46 ms of CPU each (~70 under ZeRO): DeepSpeed's config reader and engine
# their expert-parallel parts, its ZeRO optimizers Muon and SuperOffload, llama_train.data its
# preparation (which finds the prepared data), the DataLoader its multiprocessing parts.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "deepspeed", "deepspeed.launcher.runner", "deepspeed.launcher.launch",
           "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "hydra", "omegaconf",
           "sentencepiece", "psutil", "llama_train.train", "llama_train.job.trainer",
           "llama_train.engine", "llama_train.data", "llama_train.hf",
           "llama_train.inference.generate",
           "deepspeed.module_inject.auto_ep_config", "deepspeed.module_inject.auto_ep_layer",
           "llama_train.data.prepare",
           "llama_train.comm.simulate", "llama_train.engine.float8", "llama_train.job.runlock",
           "multiprocessing.popen_fork", "multiprocessing.synchronize",
           "torch.utils.serialization", "encodings.idna",
           "deepspeed.runtime.zero.muon.muon_optimizer",
           "deepspeed.runtime.superoffload.superoffload_stage3", "deepspeed.comm.mori",
           "torch._dynamo.repro.after_dynamo", "torch._inductor.compiler_bisector",
           "torch._subclasses.schema_check_mode", "torch.profiler._cupti_monitor")

# Variables a job may set differently from the parent and still be forked: read by the launcher
# and by llama_train at run time, never by an import. Any other difference: exec'd for real.
RUNTIME_VARS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CROSS_RANK", "CROSS_SIZE", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "HYDRA_FULL_ERROR",
    "LLAMA_TRAIN_FAULTS", "LLAMA_TRAIN_WATCHDOG_S", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT",
    "WANDB_ENTITY", "WANDB_API_KEY", "WANDB_SILENT", "WANDB_RUN_ID", "WANDB_RESUME",
    "LLAMA_TRAIN_PROBE_OUT", "LLAMA_TRAIN_PROBE_EXIT", "PYTEST_CURRENT_TEST",
    "HANG_WORKER_STOP",  # tests/workers/hang_worker.py: read as a step runs
    "LLAMA_BENCH_TURNS",  # llama_train.bench.lockstep: its workers' turn pipes, read at start
    "PATH", "T",  # tests/system/test_docs_commands.py: the venv first on PATH, its tiny arguments
    # read when used, not on import: torch._inductor's cache_dir(), llama_train.paths.cache_dir()
    "TORCHINDUCTOR_CACHE_DIR", "LLAMA_TRAIN_CACHE",
})

# Variables the C library reads at start-up, which a forked command applies itself the same
# way (glibc's MALLOC_MMAP_THRESHOLD_: llama-bench memory's ranks): :func:`_apply_start_vars`.
START_VARS = frozenset({"MALLOC_MMAP_THRESHOLD_"})

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


_BASE: Dict[str, object] = {}  # the parent's environment, sys.path, handlers..., as it started
_PRIVATE: List[int] = []  # the parent's own descriptors, closed in what it forks
_EXIT_HANDLERS: List[tuple] = []  # (func, args, kwargs): what the imports gave atexit, in order

# Commands whose own subprocesses are forked too (:class:`ForkedPopen` as their
# ``subprocess.Popen``): DeepSpeed's runner and launcher, which start the ranks, and the
# benchmarks and the kill -9 drill, which launch jobs (``deepspeed``, a ``python -m`` worker) as
# the means of measuring or checking something else: memory, saves, steps, bandwidth, resumes.
# Not ``llama-bench startup`` (interpreter start-up is what it measures), not
# ``llama_train.bench.data`` (its cold prepare times a fresh process), not
# ``llama_train.scaling.study`` (it launches from a pool of threads: a fork copies one thread).
CHILDREN_FORKED_MODULES = ("llama_train.bench.memory", "llama_train.bench.checkpoint",
                           "llama_train.bench.train", "llama_train.bench.allreduce",
                           "tests.workers.popen_probe")  # test_warm_ranks.py's contract
CHILDREN_FORKED_BENCHES = ("memory", "checkpoint", "train", "allreduce")  # llama-bench NAME
CHILDREN_FORKED_SCRIPTS = ("deepspeed", "ds", "fault_inject.py")  # launch/fault_inject.py


def _forks_children(how: dict) -> bool:
    """Whether the command ``how`` runs gets :class:`ForkedPopen` (the lists above)."""
    if "module" in how:
        return (how["module"].startswith("deepspeed.launcher.")
                or how["module"] in CHILDREN_FORKED_MODULES)
    name = os.path.basename(how["script"])
    if name == "llama-bench":
        return how["args"][:1] != [] and how["args"][0] in CHILDREN_FORKED_BENCHES
    return name in CHILDREN_FORKED_SCRIPTS


def warm_enough(env: Dict[str, str]) -> Optional[str]:
    """Why ``env`` cannot run in this interpreter (a variable an import may have read differs),
    or None."""
    return env_difference(_BASE["env"], _BASE["import_env"], env)


def env_difference(base: Dict[str, str], imported: Dict[str, str],
                   env: Dict[str, str]) -> Optional[str]:
    """Why ``env`` cannot run in a warm parent started with ``base`` whose imports set
    ``imported``, or None."""
    for k in sorted(set(base) | set(env)):
        if base.get(k) == env.get(k) or k in RUNTIME_VARS:
            continue
        if k in imported and env.get(k) == imported[k]:
            continue  # what the command's own import would set
        if k in START_VARS and k not in base and env[k].isdigit():
            continue  # applied as the C library's start-up applies it (_apply_start_vars)
        return f"{k} differs from the warm parent's"
    return None


def _apply_start_vars(env: Dict[str, str]) -> None:
    """What the C library does at start-up with :data:`START_VARS`: ``MALLOC_MMAP_THRESHOLD_``
    is glibc's ``mallopt(M_MMAP_THRESHOLD, n)`` (a fixed threshold, as the variable sets it)."""
    value = env.get("MALLOC_MMAP_THRESHOLD_")
    if value is not None and value != _BASE["env"].get("MALLOC_MMAP_THRESHOLD_"):
        ctypes.CDLL(None).mallopt(-3, int(value))  # M_MMAP_THRESHOLD


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


def _stdio(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr buffered as the interpreter's start-up buffers them: ``-u`` or
    ``PYTHONUNBUFFERED``, written through; else stdout line-buffered on a terminal only,
    stderr always."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        line = not unbuffered and (fd == 2 or os.isatty(fd))
        stream.reconfigure(write_through=unbuffered, line_buffering=line)


def run_here(cmd: List[str], env: Dict[str, str], how: dict) -> int:
    """Become ``cmd``: its environment, arguments, command line and ``sys.path``; run its
    module as ``__main__``; leave as the interpreter would (non-daemon threads joined, exit
    handlers run, streams flushed). Returns the exit code (-SIGINT: re-raise it)."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    for k, v in _BASE["import_env"].items():  # as the command's own imports would set them
        os.environ.setdefault(k, v)
    _apply_start_vars(env)
    _set_cmdline(how["cmdline"])
    sys.orig_argv = list(how["cmdline"])
    sys.executable = how["executable"]
    _stdio(how["unbuffered"] or bool(env.get("PYTHONUNBUFFERED")))
    import random

    random.seed()  # a fresh interpreter seeds from the OS; forks would share the parent's state
    # the loggers as the imports left them: a rank forked from DeepSpeed's launcher would keep
    # the level its --log_level set (INFO), where a rank it exec's starts at DeepSpeed's WARNING
    _restore_log_levels(_BASE["log_levels"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # the launcher it starts, the ranks, a benchmark's jobs: forked too (_forks_children)
    subprocess.Popen = ForkedPopen if _forks_children(how) else _REAL_POPEN
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
    """Each logger's level and its handlers' levels back to ``levels``. Only those that differ
    are set: ``Logger.setLevel`` clears the level cache of every logger (~320 here), so setting
    them all took ~10 ms of CPU in each forked process."""
    import logging

    for name, (level, handlers) in levels.items():
        lg = logging.getLogger(name if name != "root" else None)
        if lg.level != level:
            lg.setLevel(level)
        for h, hl in zip(lg.handlers, handlers):
            if h.level != hl:
                h.setLevel(hl)


def _fresh_signals() -> None:
    """Each signal's disposition as exec and then the interpreter's start-up leave it: a handler
    of the caller's is gone, a signal it ignores stays ignored (but SIGPIPE and SIGXFSZ, which
    the start-up ignores whatever came), the rest as the warm parent's start-up and imports
    set them; faulthandler off unless the warm parent had it on."""
    if faulthandler.is_enabled() and not _BASE["faulthandler"]:
        faulthandler.disable()
    for s, base in _BASE["signals"].items():
        try:
            faulthandler.unregister(s)  # a user signal the caller had it dump stacks on
        except (RuntimeError, ValueError):
            pass
        now = signal.getsignal(s)
        if now == signal.SIG_IGN and s not in (signal.SIGPIPE, signal.SIGXFSZ):
            want = signal.SIG_IGN
        elif base == signal.SIG_IGN and s not in (signal.SIGPIPE, signal.SIGXFSZ):
            # ignored in the warm parent only: exec'd from a caller that handles it, it would
            # start with the default (SIGINT: the interpreter's KeyboardInterrupt)
            want = signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL
        else:
            want = base
        if want is not None and now != want:
            signal.signal(s, want)


def _fresh_exit_handlers() -> None:
    """Only the exit handlers a fresh interpreter's imports register: none of the caller's
    (its atexit functions, its ``weakref.finalize`` objects, a ``TemporaryDirectory``'s cleanup
    among them, would run again at this process's exit)."""
    if _BASE["exit_handlers_known"]:
        atexit._clear()  # noqa: SLF001
        for func, args, kwargs in _EXIT_HANDLERS:
            atexit.register(func, *args, **kwargs)
    for f in list(weakref.finalize._registry):  # noqa: SLF001
        if f not in _BASE["finalizers"]:
            f.detach()
    threading._threading_atexits[:] = _BASE["threading_atexits"]  # noqa: SLF001


def _mapped_file_pages() -> List[Tuple[int, int]]:
    """(address, length) of each run of file pages (libraries' code and data) this process has
    mapped in: what an interpreter's imports leave mapped, which a fork does not copy (the
    kernel maps a file's page into the child when it first touches it: into its RSS, later)."""
    import numpy as np

    page, runs = os.sysconf("SC_PAGE_SIZE"), []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        spans = [line.split() for line in maps]
        for fields in spans:
            if len(fields) < 6 or not fields[5].startswith("/"):
                continue  # anonymous memory: a fork copies its page tables
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // page * 8)
            present = np.frombuffer(pagemap.read((end - start) // page * 8), np.uint64) >> 63
            edges = np.flatnonzero(np.diff(np.concatenate(([0], present, [0])).astype(np.int8)))
            runs += [(start + int(a) * page, int(b - a) * page)
                     for a, b in zip(edges[::2], edges[1::2])]
    return runs


def _map_file_pages() -> None:
    """Map in the file pages the warm parent had (:func:`_mapped_file_pages`), as an exec'd
    interpreter's imports would have: its RSS then counts what an exec'd one's does."""
    libc = ctypes.CDLL(None, use_errno=True)
    for addr, length in _BASE.get("file_pages", ()):
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), 22)  # MADV_POPULATE_READ


def _child(cmd, env, how, prepare) -> None:
    """In a freshly forked process: ``prepare()`` (its descriptors, directory, session, as exec
    would leave them), the rest of a fresh interpreter's state, then :func:`run_here`; never
    returns."""
    code = 1
    try:
        gc.freeze()  # the caller's objects: never collected here (its files never flushed twice)
        _map_file_pages()
        prepare()
        _fresh_signals()
        _fresh_exit_handlers()
        code = run_here(cmd, env, how)
    except BaseException:  # noqa: BLE001 - nothing may return into the parent's code
        traceback.print_exc()
    finally:
        _leave(code)


def _wire(p2cread: int, c2pwrite: int, errwrite: int) -> None:
    """Descriptors 0, 1 and 2 as ``Popen``'s child gets them (``_posixsubprocess``'s
    ``child_exec``: a descriptor already in place made inheritable, one in the way dup'd first)."""
    if c2pwrite == 0:
        c2pwrite = os.dup(c2pwrite)
    while errwrite in (0, 1):
        errwrite = os.dup(errwrite)
    for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
        if fd == target:
            os.set_inheritable(fd, True)
        elif fd != -1:
            os.dup2(fd, target)


def _close_fds(close_fds: bool, keep) -> None:
    """Close what exec would: with ``close_fds`` every descriptor but 0, 1, 2 and ``keep``
    (``pass_fds``, made inheritable), else the close-on-exec ones."""
    keep = set(keep)
    for fd in keep:
        os.set_inheritable(fd, True)
    for fd in sorted(int(x) for x in os.listdir("/proc/self/fd")):
        if fd in keep:
            continue
        try:
            if (close_fds and fd > 2) or not os.get_inheritable(fd):
                os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, gone with it


class _Signals:
    """``Popen``'s signalling, for a process whose ``pid`` and ``returncode`` the subclass has."""

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_REAL_POPEN = subprocess.Popen
# Popen._execute_child's parameters (POSIX, Python 3.11), in order; another signature: never fork
_EXEC_ARGS = ("args", "executable", "preexec_fn", "close_fds", "pass_fds", "cwd", "env",
              "startupinfo", "creationflags", "shell", "p2cread", "p2cwrite", "c2pread",
              "c2pwrite", "errread", "errwrite", "restore_signals", "gid", "gids", "uid", "umask",
              "start_new_session", "process_group")
_CAN_FORK = tuple(inspect.signature(_REAL_POPEN._execute_child).parameters)[1:] == _EXEC_ARGS


def _fork_plan(c: dict) -> Tuple[Optional[tuple], Optional[str]]:
    """``((how, cmd, env), None)`` when the child ``Popen`` was asked for (``c``: its
    ``_execute_child`` arguments) can be forked; ``(None, why)`` when exec must start it (``why``
    None: not a command of this interpreter, or asked for what only exec does)."""
    if (not _CAN_FORK or c["shell"] or c["executable"] is not None or c["preexec_fn"] is not None
            or (c["gid"], c["gids"], c["uid"]) != (None, None, None) or c["umask"] >= 0
            or c["process_group"] != -1 or isinstance(c["args"], (str, bytes))):
        return None, None
    try:
        cmd = [os.fsdecode(a) for a in c["args"]]
        cwd = None if c["cwd"] is None else os.fsdecode(c["cwd"])
        env = dict(os.environ) if c["env"] is None else \
            {os.fsdecode(k): os.fsdecode(v) for k, v in c["env"].items()}
    except TypeError:
        return None, None
    if cwd is not None and not os.path.isdir(cwd):
        return None, None  # exec's machinery raises as it would
    if cwd is not None and os.path.realpath(cwd) != os.getcwd() and \
            not all(os.path.isabs(a) for a in cmd[:1] + [a for a in cmd[1:] if a.endswith(".py")]):
        return None, None  # a path relative to the child's directory: plan() reads ours
    how = plan(cmd)
    if how is None:
        return None, None
    threads = _threads()  # a fork copies one thread: any other's locks could stay held
    why = warm_enough(env) or (None if threads == 1 else f"{threads} threads here")
    return (None, why) if why else ((how, cmd, env), None)


class ForkedPopen(_REAL_POPEN):
    """``subprocess.Popen`` (and so ``run``, ``call``, ``check_output``...) whose child, a
    command :func:`plan` recognises with an environment :func:`warm_enough` admits, is forked
    from this warm interpreter instead of exec'd: descriptors, directory, session, signals and
    exit handlers as exec would leave them (:func:`_child`). Any other child (a shell,
    ``preexec_fn``, ``executable=``, another user, a process with threads...) is exec'd by
    ``Popen``'s own machinery. Popen does the rest as for an exec'd child: pipes, pid, wait,
    poll, communicate, signals."""

    def _execute_child(self, *a):
        c = dict(zip(_EXEC_ARGS, a))
        fork, why = _fork_plan(c)
        if fork is None:
            # LLAMA_TRAIN_TEST_WARM=require: a command of ours that cannot be forked says why
            if why and os.environ.get("LLAMA_TRAIN_TEST_WARM") == "require":
                raise RuntimeError(f"not forked ({why}): {shlex.join(map(str, c['args']))}")
            return super()._execute_child(*a)
        how, cmd, env = fork
        sys.audit("subprocess.Popen", cmd[0], cmd, c["cwd"], c["env"])
        for stream in (sys.stdout, sys.stderr):  # else the child would write them out again
            stream.flush()

        def prepare() -> None:
            _wire(c["p2cread"], c["c2pwrite"], c["errwrite"])
            if c["cwd"] is not None:
                os.chdir(c["cwd"])
            if c["start_new_session"]:
                os.setsid()
            _close_fds(c["close_fds"], c["pass_fds"])

        pid = os.fork()
        if pid == 0:
            _child(cmd, env, how, prepare)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(c["p2cread"], c["p2cwrite"], c["c2pread"], c["c2pwrite"],
                             c["errread"], c["errwrite"])


# --------------------------------------------------------------------------- the warm parent

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@contextlib.contextmanager
def _recording_exit_handlers():
    """``atexit.register`` and ``unregister`` recorded in :data:`_EXIT_HANDLERS` meanwhile (the
    imports' handlers: what a forked command starts with, :func:`_fresh_exit_handlers`)."""
    register, unregister = atexit.register, atexit.unregister
    recording = [True]

    def reg(func, *args, **kwargs):
        if recording[0]:
            _EXIT_HANDLERS.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    def unreg(func):
        if recording[0]:
            _EXIT_HANDLERS[:] = [h for h in _EXIT_HANDLERS if h[0] != func]
        return unregister(func)

    atexit.register, atexit.unregister = reg, unreg
    try:
        yield
    finally:
        recording[0] = False
        atexit.register, atexit.unregister = register, unregister


def _record_base(here: str) -> None:
    """What a fresh interpreter has after the imports, for :func:`run_here` and :func:`_child`
    to give each command: environment, ``sys.path``, loggers, signals, exit handlers."""
    # what the imports set in the environment (DeepSpeed: PYTORCH_NVML_BASED_CUDA_CHECK=1)
    _BASE["import_env"] = {k: v for k, v in os.environ.items() if _BASE["env"].get(k) != v}
    extra = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE["site_path"] = [p for p in sys.path[1:] if p != here and p not in extra]
    _BASE["log_levels"] = _log_levels()
    _BASE["signals"] = {s: signal.getsignal(s) for s in signal.valid_signals()
                        if s not in (signal.SIGKILL, signal.SIGSTOP)}
    _BASE["faulthandler"] = faulthandler.is_enabled()
    # every handler registered went through the recording (else: a forked command keeps all)
    _BASE["exit_handlers_known"] = atexit._ncallbacks() == len(_EXIT_HANDLERS)  # noqa: SLF001
    _BASE["finalizers"] = set(weakref.finalize._registry)  # noqa: SLF001
    _BASE["threading_atexits"] = list(threading._threading_atexits)  # noqa: SLF001
    _BASE["file_pages"] = _mapped_file_pages()


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
    with _recording_exit_handlers():
        for name in PRELOAD:
            importlib.import_module(name)
        _remember_compositions(here)
    _record_base(here)
    threads = _threads()  # a fork copies one thread: any other's locks could stay held
    # what the imports made, out of the collector's sight: a child's collections would walk
    # (and copy-on-write) the whole inherited heap, ~1 CPU-s per process
    gc.collect()
    gc.freeze()

    def reply(msg: dict) -> None:
        os.write(out, (json.dumps(msg) + "\n").encode())

    reply({"ready": threads == 1, "threads": threads, "import_env": _BASE["import_env"]})
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


def _remember_compositions(here: str) -> None:
    """Hydra's composition remembered (tests/hydra_memo.py, as in the test processes), filled
    here with the tiny settings' (``model=tiny``; in both run modes: ``hydra.main`` composes
    twice, once in Hydra's ``get_mode``, once to run) for every command forked after: a rank of
    the tiny model then spends ~35 ms of CPU on its two compositions instead of ~170 (the
    defaults list and the merged files, found afresh in each process). The overrides' values
    are applied and checked in the command as before; other groups, another config directory or
    edited files miss and compose as without it. Left out (Hydra as it is) under
    LLAMA_TRAIN_TEST_HYDRA_MEMO=0, and if composing here warned: a warning a command's
    composition gives must reach its own log."""
    import warnings

    if _BASE["env"].get("LLAMA_TRAIN_TEST_HYDRA_MEMO", "1") == "0":
        return
    sys.path.insert(0, here)
    try:
        import hydra_memo
    finally:
        sys.path.remove(here)
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from llama_train.bench.startup import TINY
    from llama_train.paths import CONFIG_DIR

    hydra_memo.install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # the search path llama_train.train's hydra.main builds (config_path: the package's)
            search = create_automatic_config_search_path(None, "llama_train.train",
                                                         str(CONFIG_DIR))
            hydra = Hydra.create_main_hydra2(task_name="train", config_search_path=search)
            try:
                for mode in (RunMode.MULTIRUN, RunMode.RUN):  # hydra's get_mode, then run
                    hydra.compose_config("config", list(TINY), run_mode=mode,
                                         with_log_configuration=False,
                                         validate_sweep_overrides=False)
            finally:
                GlobalHydra.instance().clear()
        ok = not caught
    except Exception:  # noqa: BLE001 - an optimisation only
        traceback.print_exc()
        ok = False
    if not ok:
        hydra_memo.uninstall()


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
    def prepare() -> None:  # as helpers.start's Popen: own session, /dev/null in, log out
        os.setsid()
        for fd in _PRIVATE:
            os.close(fd)
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        os.close(log)
        os.close(null)
        os.chdir(req["cwd"])

    pid = os.fork()
    if pid == 0:
        _child(req["cmd"], req["env"], how, prepare)
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
        self.import_env: Dict[str, str] = first.get("import_env", {})
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

    def fits(self, env: Dict[str, str]) -> bool:
        """Whether commands with ``env`` can be forked from it (what :func:`warm_enough` says in
        the parent)."""
        return not self.dead and env_difference(self.env, self.import_env, env) is None

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
