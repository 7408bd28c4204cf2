"""Data that changes, shrinks or stops coming under a running job, and a tokenizer source
whose lines are too long (issue 29).

* A shard rewritten in place (same size, valid ids) after its blocks were checked: the next read
  of it is refused (``DataChanged``, exit 3) before a changed token is yielded; a ``touch`` or an
  identical rewrite is not refused (its blocks are checked again as they are read).
* A shard truncated mid-run: ``DataChanged`` naming the file (exit 3), never a SIGBUS, with
  DataLoader workers or without.
* A rank that waits longer than ``comm.timeout_s`` for its data loader (a stopped worker, a hung
  file system) says so and exits 5, naming the rank, the step and "data loader"; no worker is
  left behind.
* A tokenizer source whose lines are all longer than SentencePiece's limit: a DataError naming
  the length, the file and ``data.tokenizer_max_line_bytes`` (exit 2), not SentencePiece's
  ``INTERNAL`` error.

Loader-level checks run in this process, or in a small child process where the process itself
must die (SIGBUS before the fix, exit 5); the trainer is run for real (one process, and 2 ranks
through the deepspeed launcher for the slow tests), its jobs started in parallel per module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from helpers import (REPO, TINY, _env, docs_prepared, launcher_cmd, rank_pid, spawn, tail, tiny_prepared,
                     wait_for)
from llama_train import watchdog
from llama_train.data import DataConfig, DataError, TrainLoader, prepare_data, train_tokenizer
from llama_train.data import prepare as prepare_module
from llama_train.records import parse_line

SEQ = 16
SEED = 7
BLOCK = 1024  # checksum block of the module's data, in bytes: 512 uint16 tokens
G, M = 8, 2  # global batch, micro batch of the loader-level tests


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """25 pages of the Python docs, 5000-token shards of 1 KiB checksum blocks (10 per shard)."""
    return docs_prepared(tmp_path_factory.mktemp("holes"), BLOCK)


@pytest.fixture
def step_noted():
    """The watchdog's position (what the trainer notes each step), restored afterwards."""
    before = dict(watchdog._position)
    yield lambda step: watchdog.note(step=step, phase="train")
    watchdog._position.update(before)


def rewrite_in_place(path: Path, block_tokens: int) -> None:
    """Write the shard again through its own inode (same size, every id still valid), with two
    different tokens of every block swapped: what an in-place copy or edit does."""
    tokens = np.fromfile(path, dtype=np.uint16)
    for lo in range(0, len(tokens), block_tokens):
        blk = tokens[lo:lo + block_tokens]
        j = next((k for k in range(1, len(blk)) if blk[k] != blk[0]), None)
        if j is not None:
            blk[[0, j]] = blk[[j, 0]]
    with open(path, "r+b") as f:
        f.write(tokens.tobytes())


def train_shards(d: Path) -> list:
    return sorted(d.glob("train-*.bin"))


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- 1. a shard rewritten in place -------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.slow
def test_a_shard_rewritten_in_place_is_refused_before_a_changed_token_is_yielded(
        prepared, tmp_path, workers, step_noted):
    """Every block is read (and checked) in the first epoch; then every train shard is
    rewritten in place. Before: the loader went on yielding the new bytes (crc32s are checked
    once per process). Now: every batch it yields is the stream as prepared (batches a worker
    read before the change included), then DataChanged (exit 3) naming the shard, the rank, the
    step and what to do."""
    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    ref = iter(TrainLoader(prepared, SEQ, G, M, 0, 1, SEED, num_workers=0))
    loader = TrainLoader(d, SEQ, G, M, 0, 1, SEED, num_workers=workers)
    it = iter(loader)
    yielded_after = 0
    try:
        for _ in range(loader.num_windows // M + 1):  # one epoch: every block checked
            assert same(next(it), next(ref))
        for shard in train_shards(d):
            rewrite_in_place(shard, BLOCK // 2)
        step_noted(41)
        with pytest.raises(DataError) as e:
            for _ in range(loader.num_windows):
                assert same(next(it), next(ref)), "a changed token was yielded"
                yielded_after += 1
    finally:
        loader.close()
    assert yielded_after <= 4 * workers  # at most what the worker had prefetched
    from llama_train.data.errors import DataChanged

    msg = str(e.value)
    assert isinstance(e.value, DataChanged) and e.value.exit_code == 3, (type(e.value), msg)
    assert re.search(rf"shard {re.escape(str(d))}/train-0000\d\.bin was changed while this job "
                     r"was reading it", msg), msg
    assert "rank 0 stopped at step 41, before training on it" in msg, msg
    assert "put the shard back as prepared" in msg and f"llama-data info {d} --verify" in msg
    assert "\n" not in msg and "Traceback" not in msg


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.slow
def test_a_touched_or_identically_rewritten_shard_is_checked_again_not_refused(
        prepared, tmp_path, workers):
    """Only a change of the bytes stops the run: a new mtime alone (touch), or the same bytes
    written again, makes the loader check the blocks again as it reads them, and go on."""
    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    ref = iter(TrainLoader(prepared, SEQ, G, M, 0, 1, SEED, num_workers=0))
    loader = TrainLoader(d, SEQ, G, M, 0, 1, SEED, num_workers=workers)
    it = iter(loader)
    try:
        for _ in range(loader.num_windows // M + 1):
            assert same(next(it), next(ref))
        shards = train_shards(d)
        os.utime(shards[0], ns=(time.time_ns(), time.time_ns() + 10**9))
        shards[1].write_bytes(shards[1].read_bytes())  # same inode, same bytes, new mtime
        for _ in range(loader.num_windows // M + 1):
            assert same(next(it), next(ref))
    finally:
        loader.close()


def test_a_block_first_read_after_an_in_place_rewrite_is_data_changed_not_old_corruption(
        prepared, tmp_path):
    """A rewritten shard's block that this process had not checked yet fails its crc32 as
    data changed under the job (exit 3, with the change), not as corruption from before the
    job started (exit 2); reads of blocks whose bytes did not change go on."""
    from llama_train.data import PackedTokens
    from llama_train.data.errors import DataChanged

    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    pt = PackedTokens(d, "train")
    k = [s["file"] for s in pt.shards].index("train-00001.bin")
    s0, bt = int(pt._starts[k]), BLOCK // 2
    before = pt[s0 + 10 : s0 + 20]  # opens the shard, checks block 0
    path = d / "train-00001.bin"
    tokens = np.fromfile(path, dtype=np.uint16)
    j = next(x for x in range(5 * bt + 1, 6 * bt) if tokens[x] != tokens[5 * bt])
    tokens[[5 * bt, j]] = tokens[[j, 5 * bt]]  # block 5 only
    with open(path, "r+b") as f:
        f.write(tokens.tobytes())
    assert np.array_equal(pt[s0 + 10 : s0 + 20], before)  # block 0 is unchanged: read on
    with pytest.raises(DataChanged) as e:
        pt[s0 + 5 * bt : s0 + 5 * bt + 10]
    assert (f"shard {path} was changed while this job was reading it (modified "
            in str(e.value)) and "block 5 of 10" in str(e.value)


def test_a_reader_keeps_few_shards_open_and_still_sees_changes(prepared, tmp_path, step_noted):
    """Reads hold open files now (pread, not maps), so a reader keeps at most _max_open of them
    (1T tokens are ~20,000 shards; the soft limit is often 1024): the oldest is closed, and a
    shard reopened after a change is checked as changed, never trusted."""
    from llama_train.data import PackedTokens
    from llama_train.data.errors import DataChanged

    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    ref, pt = PackedTokens(prepared, "train"), PackedTokens(d, "train")
    pt._max_open = 2
    assert len(pt.shards) > 4

    def open_shards() -> int:
        return sum(1 for fd in os.listdir("/proc/self/fd")
                   if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(d)))

    starts = np.random.default_rng(0).integers(0, len(pt) - SEQ, 300)
    for a in starts:
        assert np.array_equal(pt[int(a):int(a) + SEQ], ref[int(a):int(a) + SEQ])
        assert open_shards() <= 2
    assert np.array_equal(pt.windows(starts[:50], SEQ),
                          np.stack([ref[int(a):int(a) + SEQ] for a in starts[:50]]))
    first = d / pt.shards[0]["file"]
    assert pt._fds[0] is None or pt.close() is None  # shard 0 closed: reopened on its next read
    rewrite_in_place(first, BLOCK // 2)
    step_noted(3)
    with pytest.raises(DataChanged, match=f"shard {first} was changed while this job"):
        pt[0:SEQ]


# --- 2. a shard truncated mid-run: a child process, since before the fix it died of SIGBUS ------
TRUNCATE = textwrap.dedent("""
    import json, os, sys
    from llama_train import watchdog
    from llama_train.data import TrainLoader
    d, workers = sys.argv[1], int(sys.argv[2])
    loader = TrainLoader(d, 16, 8, 2, 0, 1, 7, num_workers=workers)
    it = iter(loader)
    for _ in range(loader.num_windows // 2 + 1):
        next(it)
    shard = os.path.join(d, "train-00001.bin")
    os.truncate(shard, os.path.getsize(shard) // 2)
    watchdog.note(step=12)
    try:
        for _ in range(loader.num_windows):
            next(it)
        out = {"type": None}
    except Exception as e:
        out = {"type": type(e).__name__, "msg": str(e), "code": getattr(e, "exit_code", None)}
    loader.close()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.slow
def test_a_shard_truncated_mid_run_is_named_never_a_sigbus(prepared, tmp_path, workers):
    """Before: with a worker, "DataLoader worker ... killed by signal: Bus error" (exit 1 from
    the trainer); without, the process died of SIGBUS without a word (mmap read past the new
    end). Now the loader reads with pread: DataChanged naming the file and both sizes."""
    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    res = subprocess.run([sys.executable, "-c", TRUNCATE, str(d), str(workers)], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["type"] == "DataChanged" and out["code"] == 3, out
    size = 5000 * 2
    msg = out["msg"]
    assert (f"shard {d}/train-00001.bin was truncated while this job was reading it: "
            f"{size // 2} bytes now, {size} as prepared") in msg, msg
    assert "rank 0 stopped at step 12, before training on it" in msg, msg
    assert "\n" not in msg and "Bus error" not in res.stderr


# --- 3. a data loader that stops delivering ------------------------------------------------------
STALL = textwrap.dedent("""
    import os, signal, sys, time
    from llama_train import watchdog
    from llama_train.data import TrainLoader
    from llama_train.data import loader as loader_module
    d, workers, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    loader = TrainLoader(d, 16, 8, 2, 0, 1, 7, num_workers=workers, data_timeout_s=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    watchdog.note(step=5)
    if how == "stop":  # SIGSTOP the worker: it cannot run, and ignores SIGTERM until continued
        pids = [w.pid for w in loader._loader._iterator._workers]
        print(" ".join(map(str, pids)), flush=True)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
    else:  # a read that never returns (a hung file system) in this process
        read = loader_module._Windows.read
        loader_module._Windows.read = lambda self, ids: time.sleep(3600)
    for _ in range(100):
        next(it)
    print("no stall detected", flush=True)
""")


@pytest.mark.slow  # a Python process of its own (imports torch): make test only
@pytest.mark.parametrize("workers,how", [(1, "stop"), (0, "hang")])
def test_a_data_loader_that_stops_delivering_stops_the_rank_with_exit_5(prepared, workers, how):
    """Before: the rank waited forever, silently (a stopped worker is alive to torch; a read in
    the main process blocks it). Now, past data_timeout_s (the trainer's comm.timeout_s), one
    line naming the rank, the step and the data loader (the worker's state), exit 5, and the
    stopped worker killed (SIGKILL: it ignores SIGTERM until continued)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", STALL, prepared, str(workers), how], cwd=REPO,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the stalled loader did not stop within 60 s\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - t0
    workers_left = []
    for pid in map(int, (out.split("\n")[0].split() if how == "stop" else [])):
        if wait_for(lambda: not _alive(pid), 5):
            continue
        workers_left.append(pid)
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 5, (proc.returncode, out, err[-3000:])
    line = next((x for x in err.splitlines() if x.startswith("llama-train: error:")), "")
    assert re.search(r"rank 0 has waited \d+ s for its data loader at step 5 "
                     r"\(comm\.timeout_s=2\)", line), err[-3000:]
    if how == "stop":
        assert "is stopped (state T" in line, line
    assert "Exiting with code 5" in line and not workers_left, (line, workers_left)
    assert seconds < 30, seconds


KILLED = textwrap.dedent("""
    # A rank under a launcher, as deepspeed has it: this harness (the session leader, a child
    # subreaper, as the launcher's init would be) starts the rank in a process group of its
    # own, so the group is not orphaned when the rank dies (an orphaned group's stopped
    # members get SIGHUP + SIGCONT from the kernel). The rank's worker is stopped, the rank
    # killed with SIGKILL; prints the worker's state 3 s later.
    import ctypes, os, signal, subprocess, sys, time
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], process_group=0,
                            stdout=subprocess.PIPE, text=True)
    worker = int(rank.stdout.readline())
    os.kill(worker, signal.SIGSTOP)
    time.sleep(0.5)
    rank.kill()
    rank.wait()
    time.sleep(3)
    s = open(f"/proc/{worker}/stat").read()
    print(s[s.rindex(")") + 2:].split()[0], flush=True)  # T: stopped, Z: dead, not reaped
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)
""")
RANK = textwrap.dedent("""
    import sys, time
    from llama_train.data import TrainLoader
    loader = TrainLoader(sys.argv[1], 16, 8, 2, 0, 1, 7, num_workers=1)
    it = iter(loader)
    next(it)
    print(loader._loader._iterator._workers[0].pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow  # a Python process of its own (imports torch): make test only
def test_a_rank_killed_with_kill_9_takes_its_stopped_worker_along(prepared):
    """A worker ignores SIGTERM and, stopped, everything but SIGKILL: before, a rank killed
    with kill -9 (the launcher's last resort) left its stopped worker behind for good (state
    T). Now a worker gets SIGKILL when its rank dies (PR_SET_PDEATHSIG): Z, dead."""
    res = subprocess.run([sys.executable, "-c", KILLED, prepared, RANK], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["Z"], (res.stdout, res.stderr[-2000:])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- 4. tokenizer training on lines longer than SentencePiece takes -----------------------------
def test_a_single_30mb_line_names_its_length_the_file_and_the_key(tmp_path, monkeypatch):
    """Before: "SentencePiece training failed: INTERNAL: src/trainer_interface.cc(467)
    [!sentences_.empty()]" (SentencePiece skips lines longer than its max_sentence_length
    without a word). Now: the line's length, the file and the keys that fix it; and with the
    key raised past the line the tokenizer trains on it."""
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "cache"))
    words = Path(prepare_module.__file__).read_text().split()
    rng = np.random.default_rng(0)
    text = " ".join(words[i] for i in rng.integers(0, len(words), 4_000_000))[:30_000_000]
    big = tmp_path / "big.txt"
    big.write_text(text)
    with pytest.raises(DataError) as e:
        prepare_data(DataConfig(source=str(big), num_proc=1), vocab_size=512)
    msg = str(e.value)
    assert "INTERNAL" not in msg and "\n" not in msg, msg
    assert (f"cannot train a tokenizer on data.source={str(big)!r}: all 1 of its non-empty lines "
            f"are longer than data.tokenizer_max_line_bytes=16384") in msg, msg
    assert f"the longest, {len(text):,} bytes, is line 1 of {big}" in msg, msg
    assert "put line breaks in the text" in msg and "data.tokenizer=" in msg, msg
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # nothing prepared


def test_long_lines_beside_short_ones_are_named_in_a_warning(tmp_path, caplog):
    """Lines SentencePiece skips while others train: the tokenizer is trained, and the log says
    how many lines (and bytes) it left out and which key takes them in."""
    import logging

    import pydoc_data.topics

    short = [x for t in sorted(pydoc_data.topics.topics)[:40]
             for x in pydoc_data.topics.topics[t].splitlines() if x.strip()][:3000]
    long_line = " ".join(short)[:50_000]
    nbytes = len(long_line.encode())
    with caplog.at_level(logging.WARNING, logger="llama_train.data.tokenizer"):
        path = train_tokenizer([long_line, *short], 512, tmp_path / "tok")
    assert Path(path).is_file()
    notes = [r.getMessage() for r in caplog.records if "tokenizer_max_line_bytes" in r.getMessage()]
    assert len(notes) == 1 and f"1 of {len(short) + 1} lines" in notes[0], notes
    assert f"{nbytes:,} bytes" in notes[0], notes
    path2 = train_tokenizer([long_line, *short], 512, tmp_path / "tok2", max_line_bytes=60_000)
    assert Path(path2).read_bytes() != Path(path).read_bytes()  # the long line was trained on


@pytest.mark.slow  # a Python process of its own (imports torch): make test only
def test_llama_data_exits_2_with_one_line_on_a_too_long_line(tmp_path):
    big = tmp_path / "one-line.txt"
    big.write_text("token " * 20_000)
    res = subprocess.run([sys.executable, "-m", "llama_train.data.cli", "prepare", "--source",
                          str(big), "--vocab-size", "512"], cwd=REPO,
                         env=_env({"LLAMA_TRAIN_CACHE": str(tmp_path / "cache")}),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    errors = [x for x in res.stderr.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and "data.tokenizer_max_line_bytes=16384" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


# --- the trainer, for real: one process, and 2 ranks through the launcher (slow) ---------------
def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max([0] + [int(r.step) for r in map(parse_line, lines) if r is not None])


def _workers_of(pid: int) -> list:
    """The DataLoader workers of a rank: its children forked with its own command line."""
    try:
        me = psutil.Process(pid)
        return [c.pid for c in me.children() if c.cmdline() == me.cmdline()]
    except psutil.Error:
        return []


def _rewrite(data: Path, ranks: list) -> dict:
    rewrite_in_place(data / "train-00000.bin", (1 << 18) // 2)
    return {}


def _truncate(data: Path, ranks: list) -> dict:
    shard = data / "train-00000.bin"
    os.truncate(shard, os.path.getsize(shard) // 3)
    return {}


def _stop_workers(data: Path, ranks: list) -> dict:
    pids = [w for r in ranks for w in _workers_of(r)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return {"workers": pids}


ACTIONS = {"rewrite": _rewrite, "truncate": _truncate, "stop": _stop_workers}


def _job(work: Path, tiny: str, name: str, action: str, at_step: int, nprocs: int,
         overrides: list) -> dict:
    """Train the tiny model on a copy of its prepared data ``tiny``; once step ``at_step`` is
    logged, do ``action`` to the data (or the data workers), then wait for the job's exit."""
    data, out, log = work / f"{name}-data", work / name, work / f"{name}.log"
    shutil.copytree(tiny, data)
    args = [*TINY, f"trainer.output_dir={out}", f"data.prepared_dir={data}", *overrides]
    if nprocs == 1:
        cmd = [sys.executable, "-m", "llama_train.train", *args, "trainer.micro_batch=4"]
    else:
        cmd = launcher_cmd(args, nprocs)
    res = {"name": name, "log_path": log}
    with spawn(cmd, log, warm=True) as proc:
        if not wait_for(lambda: _last_step(out) >= at_step or proc.poll() is not None, 300, 0.05):
            return {**res, "error": f"step {at_step} never logged\n{tail(log)}"}
        ranks = [proc.pid] if nprocs == 1 else [rank_pid(proc.pid, r) for r in range(nprocs)]
        if proc.poll() is not None or None in ranks:
            return {**res, "error": f"the job ended before step {at_step}\n{tail(log)}"}
        res.update(ACTIONS[action](data, ranks), at_step=_last_step(out))
        t0 = time.monotonic()
        try:
            res["rc"] = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            res["rc"] = None
        res["seconds"] = round(time.monotonic() - t0, 1)
        # before spawn kills what is left of the session: no data worker may outlive the job
        res["orphans"] = [p for p in res.get("workers", []) if not wait_for(
            lambda: not _alive(p), 5)]
    res["log"] = log.read_text(errors="replace")
    res["last_step"] = _last_step(out)
    res["checkpoints"] = sorted(int(p.name.split("_")[1])
                                for p in (out / "checkpoints").glob("step_*"))
    res["out"] = out
    return res


def _run_jobs(work: Path, jobs: dict) -> dict:
    tiny = tiny_prepared()[1].dir  # once, before the threads: Hydra's composition is global
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(_job, work, tiny, name, *spec) for name, spec in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


TIMEOUT_S = 6  # comm.timeout_s of the stalled jobs
ONE_RANK = {  # action, at step, ranks, overrides
    "rewrite-1rank": ("rewrite", 40, 1, ["trainer.max_steps=300", "trainer.save_every=10"]),
    "truncate-1rank": ("truncate", 40, 1, ["trainer.max_steps=300", "trainer.save_every=10"]),
    "stall-1rank": ("stop", 3, 1, ["trainer.max_steps=100000", f"comm.timeout_s={TIMEOUT_S}"]),
}
TWO_RANKS = {
    "truncate-2ranks-0workers": ("truncate", 20, 2, ["trainer.max_steps=300",
                                                    "trainer.save_every=10",
                                                    "data.num_workers=0"]),
    "stall-2ranks": ("stop", 3, 2, ["trainer.max_steps=100000", "comm.timeout_s=10"]),
}


@pytest.fixture(scope="module")
def one_rank_jobs(tmp_path_factory) -> dict:
    return _run_jobs(tmp_path_factory.mktemp("one_rank"), ONE_RANK)


@pytest.fixture(scope="module")
def two_rank_jobs(tmp_path_factory) -> dict:
    return _run_jobs(tmp_path_factory.mktemp("two_ranks"), TWO_RANKS)


def _error_lines(res: dict) -> list:
    return [x for x in res["log"].splitlines() if "llama-train: error:" in x]


def _check_data_changed(res: dict, what: str) -> None:
    """Exit 3, one line naming the shard and the step it stopped at; nothing after that step
    logged or saved; every checkpoint verifies."""
    from llama_train.checkpoint import verify

    assert "error" not in res, res["error"]
    log = res["log"]
    assert res["rc"] == 3, (res["rc"], tail(res["log_path"], 80))
    lines = _error_lines(res)
    assert lines, tail(res["log_path"], 80)
    m = re.search(rf"shard \S+/train-00000\.bin was {what} while this job was reading it.* "
                  r"rank \d stopped at step (\d+), before training on it", lines[0])
    assert m, lines
    step = int(m.group(1))
    assert res["at_step"] <= step <= res["at_step"] + 12, (res["at_step"], step)
    assert res["last_step"] < step and max(res["checkpoints"]) < step, (res, step)
    for s in res["checkpoints"]:
        ckpt = res["out"] / "checkpoints" / f"step_{s:08d}"
        assert verify(ckpt, checksums=True) is None, ckpt
    assert "Traceback" not in log and "Bus error" not in log, tail(res["log_path"], 80)


@pytest.mark.slow
def test_training_stops_with_exit_3_when_its_shard_is_rewritten_in_place(one_rank_jobs):
    """Before: a shard rewritten in place at step 40 of 300 was trained on for the rest of the
    run, checkpoints saved, exit 0."""
    _check_data_changed(one_rank_jobs["rewrite-1rank"], "changed")


@pytest.mark.slow
def test_training_stops_with_exit_3_when_its_shard_is_truncated(one_rank_jobs):
    """Before: "RuntimeError: DataLoader worker (pid N) is killed by signal: Bus error. It is
    possible that dataloader's workers are out of shared memory", a traceback, exit 1."""
    _check_data_changed(one_rank_jobs["truncate-1rank"], "truncated")


@pytest.mark.slow
def test_two_ranks_without_workers_stop_with_exit_3_on_a_truncated_shard(two_rank_jobs):
    """Before: data.num_workers=0 on 2 ranks: a rank died of SIGBUS without a word."""
    _check_data_changed(two_rank_jobs["truncate-2ranks-0workers"], "truncated")


def _check_stalled(res: dict, timeout_s: int, ranks: int) -> None:
    assert "error" not in res, res["error"]
    assert res["rc"] == 5, (res["rc"], tail(res["log_path"], 80))
    assert res["seconds"] < timeout_s + 20, res["seconds"]
    lines = _error_lines(res)
    pattern = (r"rank (\d) has waited \d+ s for its data loader at step "
               rf"(\d+) \(comm\.timeout_s={timeout_s}\)")
    named = [m for m in (re.search(pattern, x) for x in lines) if m]
    assert named, tail(res["log_path"], 80)
    assert all(res["at_step"] <= int(m.group(2)) <= res["at_step"] + 6 for m in named), lines
    assert len(res["workers"]) == ranks and not res["orphans"], res
    assert not [x for x in res["log"].splitlines() if "Traceback" in x], tail(res["log_path"], 80)


@pytest.mark.slow
def test_a_stopped_data_worker_stops_the_job_with_exit_5(one_rank_jobs):
    """Before: 1 rank, its DataLoader worker SIGSTOPped: no output for 128 s at
    comm.timeout_s=10, until killed."""
    _check_stalled(one_rank_jobs["stall-1rank"], TIMEOUT_S, 1)


@pytest.mark.slow
def test_two_ranks_whose_workers_both_stop_exit_5(two_rank_jobs):
    """Before: 2 ranks, both workers stopped (a hung shared file system): hung >= 184 s with no
    message (each rank waits for its data, so no collective and no heartbeat times out)."""
    _check_stalled(two_rank_jobs["stall-2ranks"], 10, 2)
