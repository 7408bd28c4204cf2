"""Test environment: CPU DeepSpeed, offline hubs, a per-session cache for prepared data."""

import glob
import os
import shutil
import tempfile
import time

from llama_train.proc import ds_shm_buffer

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
