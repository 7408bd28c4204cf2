"""Test environment: CPU DeepSpeed, offline hubs, a per-session cache for prepared data."""

import gc
import glob
import os
import shutil
import sys
import tempfile
import time

import pytest

from llama_train.proc import ds_shm_buffer

# One OpenBLAS thread for numpy/scipy in this process and in what it starts, set before numpy is
# imported: on 2 cores OpenBLAS's spin-waiting threads make the many small solves of the scaling
# fits several times slower whenever anything else runs (tests/scaling/test_scaling_fit.py beside two
# busy processes: 17.5 s with its default 2 threads, 6.9 s with 1). The launched ranks get
# OMP_NUM_THREADS=1 from helpers._env. Under pytest-xdist (make test: 3 workers on 2 cores) so
# does torch in each worker and what it starts: with a thread per core each, the workers'
# OpenMP threads spun against each other (a fresh clone's make test: 26:13 of CPU, 16:18 of tests;
# with one thread: 21:54 and 13:54). Alone (PYTEST_WORKERS=0) torch keeps both cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch's first import (none comes earlier)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# torch.compile's kernels built in the compiling process: by default inductor starts a pool of
# compile workers (each a fresh interpreter importing torch) in every rank that compiles, for the
# few small kernels of the tiny model (tests/job/test_compile.py's ZeRO-3 test: 107.5 CPU-s with the
# pool, 100.8 without). Read when torch._inductor.config is imported: before torch is.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# What scikit-learn's import sets in a test process (lm_eval and the scaling fits import it; read
# by Intel's OpenMP, which torch here does not use), set from the start: a launch after that
# import differed from the warm parents in it and started another (3 in a run, ~4 CPU-s each).
os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")
os.environ.pop("WANDB_API_KEY", None)

_SESSION_CACHE = None
_SESSION_START = time.time()


def pytest_configure(config):
    global _SESSION_CACHE
    # the controller's, inherited by its xdist workers: what once_per_session builds is this
    # session's, even in a LLAMA_TRAIN_CACHE that outlives it
    os.environ.setdefault("LLAMA_TRAIN_TEST_SESSION", f"{os.getpid()}-{int(time.time())}")
    if "LLAMA_TRAIN_CACHE" not in os.environ:
        _SESSION_CACHE = tempfile.mkdtemp(prefix="llama_train_cache_")
        os.environ["LLAMA_TRAIN_CACHE"] = _SESSION_CACHE
        _share_extracted_corpus(_SESSION_CACHE)
    if not (os.environ.get("PYTEST_XDIST_WORKER")
            or not getattr(config.option, "numprocesses", None)):
        return  # xdist's controller, which runs no test
    gc.disable()  # until the collection is done: pytest_collection_finish
    if os.environ.get("LLAMA_TRAIN_TEST_HYDRA_MEMO", "1") != "0":
        import hydra_memo

        hydra_memo.install()  # Hydra's composition remembered in this process (~5x faster)


def pytest_collection_finish(session):
    """What the collection made (torch, Hydra, every test module: ~400k objects) kept out of
    the cyclic garbage collector's full passes, and those passes made rarer: each looked at
    every object of the process, ~0.5 s, ~30 times in a worker of the in-process tier (a
    third of them while collecting, with the collector off now), ~8 times and ~0.4 s each
    now. Garbage in reference cycles is still collected; only what lives at this point is
    frozen (after one collection), as ``gc.freeze`` is meant for."""
    if not gc.isenabled():
        gc.collect()
        gc.freeze()
        gc.set_threshold(700, 10, 100)  # a full pass after 100 of the middle one's, not 10
        gc.enable()


def _share_extracted_corpus(session_cache: str) -> None:
    """The session's cache starts empty (no prepared data of an earlier session is trusted),
    except its corpus/ directory: a link to one kept in the venv (as the Makefile keeps
    DeepSpeed's built ops), so the built-in corpus is extracted (12 s of CPU) once per checkout,
    not once per session. Each read checks the file against its sha256 and the extraction
    code's digest (llama_train.data.corpus), so an edit to the rules is extracted afresh."""
    kept = os.path.join(sys.prefix, "llama_train_test_cache", "corpus")
    try:
        os.makedirs(kept, exist_ok=True)
        os.symlink(kept, os.path.join(session_cache, "corpus"))
    except OSError:
        pass  # a read-only environment: each session extracts it


@pytest.fixture(scope="module")
def one_rank():
    """The module's tests run in this process as rank 0 of a world of one
    (helpers.world_of_one), from its first test to its last; a module asks for it with
    ``pytestmark = pytest.mark.usefixtures("one_rank")``."""
    from helpers import world_of_one

    with world_of_one():
        yield


@pytest.fixture
def faults(monkeypatch):
    """``faults("kind:k=v;...")`` sets LLAMA_TRAIN_FAULTS for the in-process runs of one test
    (llama_train.job.faults); unset before and after."""
    def set_faults(spec: str) -> None:
        monkeypatch.setenv("LLAMA_TRAIN_FAULTS", spec)
    monkeypatch.delenv("LLAMA_TRAIN_FAULTS", raising=False)
    return set_faults


def once_per_session(name: str, build) -> str:
    """``build(dir)`` run once for the whole test session, whichever pytest-xdist worker asks
    first; the others wait for it (a lock in the session's LLAMA_TRAIN_CACHE, which every worker
    shares) and get the same directory. A build that failed is not reused: the next asker builds
    afresh. Returns the directory."""
    import fcntl

    root = os.path.join(os.environ["LLAMA_TRAIN_CACHE"],
                        f"session-runs-{os.environ['LLAMA_TRAIN_TEST_SESSION']}")
    os.makedirs(root, exist_ok=True)
    out = os.path.join(root, name)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not os.path.exists(out + ".done"):
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            open(out + ".done", "w").close()
    return out


@pytest.fixture(scope="session")
def zero3_run():
    """ZeRO-3 on 2 ranks through the launcher (helpers.ZERO3): 6 steps, checkpoints at 2, 4
    and 6. One run for the session, whichever worker needs it first (once_per_session):
    test_launcher_runs.py compares its losses with ZeRO-0's, test_zero3.py resumes, reshards and
    exports copies of it, test_checkpoint_holes.py converts it to universal. Read it, never write
    to it."""
    from pathlib import Path

    from helpers import ZERO3, train

    return Path(once_per_session("zero3_run", lambda out: train(Path(out), ZERO3)))


# The files with the most launcher runs, longest first. `make test` runs the suite on three
# pytest-xdist workers that take whole files (--dist loadfile) in collection order: starting
# with these leaves the short files to fill the end, instead of one long file running alone.
# That order holds only with --no-loadscope-reorder: by default xdist sends the files with the
# most tests first.
HEAVY_FIRST = ("test_docs_commands.py", "test_zero3.py", "test_hang.py", "test_reliability.py", "test_launcher_runs.py",
               "test_integrity.py", "test_mixture.py", "test_data_holes.py", "test_checkpoint.py",
               "test_bench.py", "test_scaling_study.py", "test_checkpoint_holes.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within


def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller cleans up, once every worker (and its jobs) has stopped
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    # Workers that start DeepSpeed without llama_train.engine (which unlinks them) leave its CPU
    # all-reduce buffers (~66 MB each) in /dev/shm; remove the ones this session created.
    for path in glob.glob(ds_shm_buffer("127.0.0.1", "*", "*")):
        try:
            if os.stat(path).st_mtime >= _SESSION_START - 1:
                os.unlink(path)
        except OSError:
            pass


def _tree_cpu() -> float:
    """CPU seconds of this process, every child it has reaped, and every live descendant with
    what each of those has reaped: a process that ends inside the tree moves from its own count
    into its parent's, so a difference of two readings is what the tree spent in between."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    tick = os.sysconf("SC_CLK_TCK")
    kids, me = {}, os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append((int(pid), fields))
    todo = [me]
    while todo:
        for pid, fields in kids.get(todo.pop(), ()):
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
            todo.append(pid)
    return total


if os.environ.get("LLAMA_TRAIN_TEST_CPU"):
    # LLAMA_TRAIN_TEST_CPU=FILE: one JSON line per test with the CPU seconds its process tree
    # spent (module fixtures count in the first test that needs them) and its wall seconds, to
    # find where `make test`'s CPU goes (issue 56).
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json

        cpu, wall = _tree_cpu(), time.time()
        yield
        row = {"test": item.nodeid, "cpu_s": round(_tree_cpu() - cpu, 2),
               "wall_s": round(time.time() - wall, 2),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(os.environ["LLAMA_TRAIN_TEST_CPU"], "a") as f:
            f.write(json.dumps(row) + "\n")
