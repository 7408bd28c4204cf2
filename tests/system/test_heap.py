"""``llama-train`` (and so every rank under the launcher) keeps glibc's retained heap small:
``cli()`` calls :func:`llama_train.proc.limit_retained_heap` (``mallopt(M_MMAP_THRESHOLD,
65536)``), so freed tensors leave the resident set as under ``llama-bench memory``."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# Frees 64 touched 1 MiB tensors, each followed by a live 8 KiB one (so the heap cannot shrink
# from its top), after an 8 MiB one whose free raised glibc's dynamic mmap threshold; prints the
# MiB the resident set dropped by. With the limit on, the ``llama-train --help`` process (through
# cli(), the entry of every rank) runs the probe once the limit is set.
PROBE = """
import runpy, sys
import torch
import llama_train.proc as proc

def freed_mib():
    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    big = torch.ones(2 << 20)
    del big
    chunks, pins = [], []
    for _ in range(64):
        chunks.append(torch.ones(1 << 18))
        pins.append(torch.ones(2048))
    before = rss_kib()
    del chunks
    return (before - rss_kib()) / 1024

if sys.argv[1] == "train":
    limit = proc.limit_retained_heap
    def probed():
        was_set = limit()
        print("FREED", was_set, freed_mib(), flush=True)
        return was_set
    proc.limit_retained_heap = probed
    sys.argv = ["llama-train", "--help"]
    runpy.run_module("llama_train.train", run_name="__main__")
else:
    print("FREED", None, freed_mib(), flush=True)
"""


def _freed(mode: str, env_extra=None):
    env = dict(os.environ, DS_ACCELERATOR="cpu", **(env_extra or {}))
    if not env_extra:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [l for l in out.stdout.splitlines() if l.startswith("FREED")]
    assert lines, f"llama-train's cli() did not call limit_retained_heap:\n{out.stdout[-2000:]}"
    _, was_set, mib = lines[0].split()
    return was_set, float(mib)


@pytest.mark.slow
def test_llama_train_returns_freed_tensors_to_the_os():
    # glibc's default keeps the freed MiBs in the heap (the control: the probe measures something)
    assert _freed("plain")[1] < 8
    # the llama-train entry point sets the threshold first thing: they go back to the OS
    was_set, mib = _freed("train")
    assert was_set == "True" and mib > 56, mib


@pytest.mark.slow  # a Python process of its own (imports torch): make test only
def test_user_threshold_is_left_alone():
    # glibc read the user's variable at start; limit_retained_heap leaves it be
    was_set, _ = _freed("train", {"MALLOC_MMAP_THRESHOLD_": str(64 << 20)})
    assert was_set == "False"
