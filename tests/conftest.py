"""Test environment: CPU DeepSpeed, offline hubs, a per-session cache for prepared data."""

import glob
import os
import shutil
import tempfile
import time

import pytest

from llama_train.proc import ds_shm_buffer

# One OpenMP/BLAS thread in this process and in what it starts (helpers._env sets it for the
# launched ranks too), set before numpy and torch are imported: on 2 cores their spin-waiting
# thread pools run many times slower whenever anything else runs (test_scaling_fit.py beside two
# busy processes: 14.9 s with the default 2 threads, 5.6 s with 1), and the tests' small arrays
# and tensors gain nothing from a second thread.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("WANDB_API_KEY", None)

_SESSION_CACHE = None
_SESSION_START = time.time()


def pytest_configure(config):
    global _SESSION_CACHE
    if "LLAMA_TRAIN_CACHE" not in os.environ:
        _SESSION_CACHE = tempfile.mkdtemp(prefix="llama_train_cache_")
        os.environ["LLAMA_TRAIN_CACHE"] = _SESSION_CACHE


@pytest.fixture(scope="module")
def one_rank():
    """The module's tests run in this process as rank 0 of a world of one
    (helpers.world_of_one), from its first test to its last; a module asks for it with
    ``pytestmark = pytest.mark.usefixtures("one_rank")``."""
    from helpers import world_of_one

    with world_of_one():
        yield


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory):
    """ZeRO-3 on 2 ranks through the launcher (helpers.ZERO3): 6 steps, checkpoints at 2, 4
    and 6. One run for two modules: test_launcher_runs.py compares its losses with ZeRO-0's,
    test_zero3.py resumes, reshards and exports copies of it. Read it, never write to it."""
    from helpers import ZERO3, train

    out = tmp_path_factory.mktemp("zero3_run") / "reference"
    train(out, ZERO3)
    return out


def pytest_unconfigure(config):
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
