"""Faults whose message was wrong or missing (issue 54, classes 7, 8, 9, 11, 12): each one ends
in its documented exit code and one line that names the cause and the fix, never a traceback.

* 7: a DataLoader worker that dies (SIGKILL: what the kernel's OOM killer sends; SIGSEGV,
  SIGBUS; an exit code; a MemoryError of its own): exit 6 naming the worker, the signal and the
  settings that use less memory. Before: ``ConnectionResetError`` or torch's "DataLoader worker
  (pid N) is killed by signal" raised from its SIGCHLD handler wherever the loop was, exit 1.
* 8: the rendezvous: MASTER_PORT in use, MASTER_ADDR that does not resolve, a port that is no
  port, ranks that never meet: exit 2 naming the variable and the fix. Before: torch's
  EADDRINUSE traceback; an unresolvable name retried for the whole start-up timeout (10 min).
* 9: W&B online without network: falls back to offline within 30 s with a warning naming the
  cause, and the run ends with its ``wandb sync`` command. Before: ~100 s, then a traceback.
* 11: messages that are true: the first save on a full disk says the disk is full; a partial
  save is said removed only when rank 0 removed it, and "nothing was written" when none was
  made; a planted ``.tmp-step_*`` link is named, not blamed on free space; a lone surrogate in a
  .jsonl names the file and line; a run none of whose steps was good is not told to save more
  often.
* 12: ``launch/multinode.sh`` checks every hostfile line (and, in ssh mode, that each host
  resolves) before it starts anything, naming the line and the fix.

Runs of the entry point are one process each (a few seconds of start-up); the launcher runs
(marked slow) start 2 ranks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import (REPO, TINY, docs_prepared, free_port, launcher_cmd, losses_so_far, rank_pid,
                     run, spawn, tail, tiny_prepared, wait_for)

LAUNCH = REPO / "launch"


def _train(tmp_path: Path, overrides=(), env=None, timeout: float = 120, name: str = "run"):
    """``python -m llama_train.train`` with the tiny settings, one process: (exit code, its
    whole output)."""
    out, log = tmp_path / name, tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "llama_train.train", *TINY, f"trainer.output_dir={out}",
           "sample.tokens=0", *overrides]
    rc = run(cmd, log, timeout=timeout, env=env, check=False, warm=True)
    return rc, log.read_text(errors="replace")


def _one_error(text: str) -> str:
    """The one ``llama-train: error:`` line of a run's output (asserted: one, no traceback)."""
    errors = [line for line in text.splitlines() if "llama-train: error:" in line]
    assert len(errors) == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    return errors[0]


# ------------------------------------------------------------------------------------------------
# 7. A DataLoader worker that dies


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> str:
    return docs_prepared(tmp_path_factory.mktemp("round3_data"), 1024)


@pytest.fixture
def quick_worker_checks(monkeypatch):
    """torch's DataLoader finds a worker that ended without a word (an exit code; a signal whose
    SIGCHLD came while the loader was not reading) at its check of the workers, made each
    MP_STATUS_CHECK_INTERVAL (5 s) that it waits for a batch: each 0.1 s here, so these tests
    do not wait 5 s for it (what they check is what the loader then says)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter as iterator

    monkeypatch.setattr(iterator._try_get_data, "__defaults__", (0.1,))


def _read_until_error(loader, batches: int = 200):
    it = iter(loader)
    for _ in range(batches):
        next(it)


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGBUS", "SIGKILL"])
@pytest.mark.usefixtures("quick_worker_checks")
def test_a_worker_killed_by_a_signal_is_named_by_the_loader(small_data, sig):
    """Loader level: the worker's death comes out of the next read as DataWorkerDied (exit 6)
    naming the worker, the signal, its likely cause and data.num_workers / trainer.micro_batch,
    whatever the read ran into (a reset connection, torch's "exited unexpectedly")."""
    from llama_train.data import TrainLoader
    from llama_train.data.loader import DataWorkerDied

    loader = TrainLoader(small_data, 16, 8, 2, 0, 1, 7, num_workers=1)
    it = iter(loader)
    try:
        next(it)
        worker = loader._loader._iterator._workers[0]
        os.kill(worker.pid, getattr(signal, sig))
        with pytest.raises(DataWorkerDied) as e:
            for _ in range(200):
                next(it)
    finally:
        loader.close()
    msg = str(e.value)
    assert e.value.exit_code == 6
    assert f"DataLoader worker 0 (pid {worker.pid}) was killed by {sig}" in msg, msg
    assert "data.num_workers (now 1" in msg and "trainer.micro_batch (now 2" in msg, msg
    assert {"SIGKILL": "out-of-memory killer", "SIGSEGV": "segmentation fault",
            "SIGBUS": "/dev/shm"}[sig] in msg, msg
    assert "\n" not in msg


def _exit_in_worker(self, samples):
    os._exit(3)


def _oom_in_worker(self, samples):
    raise MemoryError()


@pytest.mark.parametrize("how", ["exit code", "MemoryError"])
@pytest.mark.usefixtures("quick_worker_checks")
def test_a_worker_that_exits_or_runs_out_of_memory_is_named(small_data, monkeypatch, how):
    from llama_train.data import TrainLoader
    from llama_train.data import loader as loader_module
    from llama_train.data.loader import DataWorkerDied

    monkeypatch.setattr(loader_module._Windows, "__getitem__",
                        _exit_in_worker if how == "exit code" else _oom_in_worker)
    loader = TrainLoader(small_data, 16, 8, 2, 0, 1, 7, num_workers=1)
    try:
        with pytest.raises(DataWorkerDied) as e:
            _read_until_error(loader)
    finally:
        loader.close()
    msg = str(e.value)
    want = "exited with code 3" if how == "exit code" else "ran out of memory (MemoryError)"
    assert want in msg and "data.num_workers" in msg, msg
    assert "\n" not in msg and "Traceback" not in msg


def _worker_of(pid: int):
    """The DataLoader workers (torch names them pt_data_worker) under process ``pid``."""
    try:
        return [c for c in psutil.Process(pid).children(recursive=True)
                if c.name() == "pt_data_worker"]
    except psutil.Error:
        return []


@pytest.mark.slow
def test_a_worker_sigkilled_mid_run_stops_the_run_with_exit_6(tmp_path):
    """What the OOM killer does, from outside: SIGKILL to the run's DataLoader worker after
    step 2. Before: exit 1 with torch's "DataLoader worker (pid N) is killed by signal: Killed"
    traceback, raised in the optimizer step (or a ConnectionResetError)."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "llama_train.train", *TINY, f"trainer.output_dir={out}",
           "trainer.max_steps=100000", "data.num_workers=1", "sample.tokens=0"]
    with spawn(cmd, log, warm=True) as proc:
        assert wait_for(lambda: len(losses_so_far(out)) >= 2 or proc.poll() is not None, 120)
        workers = _worker_of(proc.pid)
        assert workers, tail(log)
        os.kill(workers[0].pid, signal.SIGKILL)
        rc = proc.wait(timeout=60)
    text = log.read_text(errors="replace")
    line = _one_error(text)
    assert rc == 6, text[-3000:]
    assert re.search(rf"rank 0's DataLoader worker 0 \(pid {workers[0].pid}\) was killed by "
                     r"SIGKILL \(signal 9\) at step \d+", line), line
    assert "data.num_workers (now 1" in line and "trainer.micro_batch" in line, line
    assert "relaunch" in line


@pytest.mark.slow
def test_two_ranks_a_worker_of_rank_1_killed_the_job_exits_6(tmp_path):
    """2 ranks through the launcher: rank 1's worker SIGKILLed; the job's status is 6 (rank 1
    exits at once, rank 0 loses it and exits 5 later), rank 1's line names its worker."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", "trainer.max_steps=100000",
                        "data.num_workers=1", "sample.tokens=0"])
    with spawn(cmd, log, warm=True) as proc:
        assert wait_for(lambda: len(losses_so_far(out)) >= 2 or proc.poll() is not None, 180)
        r1 = rank_pid(proc.pid, 1)
        workers = _worker_of(r1) if r1 else []
        assert workers, tail(log)
        os.kill(workers[0].pid, signal.SIGKILL)
        rc = proc.wait(timeout=90)
    text = log.read_text(errors="replace")
    assert rc == 6, text[-3000:]
    named = [line for line in text.splitlines() if "llama-train: error:" in line
             and "DataLoader worker" in line]
    assert len(named) == 1 and "rank 1's DataLoader worker 0" in named[0], text[-3000:]
    assert "SIGKILL" in named[0] and "data.num_workers" in named[0]
    assert "Traceback" not in text, text[-3000:]


# ------------------------------------------------------------------------------------------------
# 8. The rendezvous


@pytest.mark.slow
def test_master_port_in_use_names_the_port_and_the_fix(tmp_path):
    """Before: torch's DistNetworkError traceback (EADDRINUSE), exit 1."""
    port = free_port()
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", port))
        holder.listen()
        rc, text = _train(tmp_path, ["trainer.max_steps=2"], env={"MASTER_PORT": str(port)})
    line = _one_error(text)
    assert rc == 2, text[-3000:]
    assert f"MASTER_PORT={port} is already in use" in line, line
    assert "--master_port" in line and "MASTER_PORT=N" in line, line


@pytest.mark.slow
def test_master_addr_that_does_not_resolve_is_named_at_once(tmp_path):
    """Before: torch retried the name for the whole start-up timeout (comm.timeout_s + 5 s,
    10 min by default), a warning every few seconds."""
    t0 = time.monotonic()
    rc, text = _train(tmp_path, ["trainer.max_steps=2"], timeout=90,
                      env={"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(free_port())})
    line = _one_error(text)
    assert rc == 2, text[-3000:]
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in line, line
    assert "--master_addr" in line and "rank 0" in line, line
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("port, words", [("abc", "is not a TCP port number"),
                                         ("70000", "is not a TCP port number"),
                                         ("0", "is not a TCP port number")])
def test_master_port_that_is_no_port_is_refused(monkeypatch, port, words):
    from llama_train.engine.distributed import RendezvousError, check_rendezvous_address

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(RendezvousError, match=f"MASTER_PORT='{port}' {words}"):
        check_rendezvous_address()


def test_ranks_that_never_meet_are_explained(monkeypatch):
    """torch's two timeouts of a rendezvous, told apart: rank 0 waiting for the others, and a
    rank that cannot reach rank 0."""
    from llama_train.engine.distributed import rendezvous_error

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "3")
    server = rendezvous_error(RuntimeError(
        "Timed out after 605 seconds waiting for clients. 1/4 clients joined."))
    assert "only 1 of the 4 ranks joined the rendezvous at 10.0.0.1:29500" in str(server)
    client = rendezvous_error(RuntimeError(
        "The client socket has timed out after 605000ms while trying to connect to (10.0.0.1, "
        "29500)."))
    assert "rank 3 could not reach the job's rendezvous at 10.0.0.1:29500" in str(client)
    assert "MASTER_ADDR must be rank 0's host" in str(client)
    assert rendezvous_error(RuntimeError("something else")) is None


# ------------------------------------------------------------------------------------------------
# 9. W&B online without network


def _no_wandb_env(extra=None) -> dict:
    """An online W&B run whose server refuses connections (a closed local port)."""
    closed = free_port()
    return {"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{closed}",
            "WANDB_SILENT": "true", **(extra or {})}


def _seconds(line: str) -> int:
    h, m, s = (int(x) for x in line[:8].split(":"))
    return h * 3600 + m * 60 + s


@pytest.mark.slow
def test_wandb_online_without_network_goes_offline_within_30s(tmp_path):
    """Before: wandb.init retried for ~90 s, then a CommError traceback, exit 1."""
    rc, text = _train(tmp_path, ["trainer.max_steps=2", "tracking.wandb.mode=online"],
                      env=_no_wandb_env(), timeout=150)
    assert rc == 0 and "Traceback" not in text, text[-3000:]
    assert "llama-train: error:" not in text
    lines = text.splitlines()
    warned = [i for i, line in enumerate(lines) if "wandb: cannot log online" in line]
    assert len(warned) == 1, text[-3000:]
    line = lines[warned[0]]
    assert "Connection refused" in line and "tracking.wandb.mode=offline" in line, line
    before = next(line for line in reversed(lines[:warned[0]]) if re.match(r"\d\d:\d\d:\d\d ", line))
    assert _seconds(line) - _seconds(before) < 30, (before, line)
    assert "logged offline (it could not log online at start" in text and "wandb sync " in text


@pytest.mark.slow
def test_wandb_init_that_times_out_goes_offline(tmp_path):
    """Where a proxy stands between (no probe), wandb.init's own timeout decides: short here."""
    env = _no_wandb_env({"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
                         "WANDB_INIT_TIMEOUT": "3"})
    rc, text = _train(tmp_path, ["trainer.max_steps=2", "tracking.wandb.mode=online"], env=env,
                      timeout=150)
    assert rc == 0 and "Traceback" not in text, text[-3000:]
    warned = [line for line in text.splitlines() if "wandb: cannot log online" in line]
    assert len(warned) == 1 and "wandb.init failed within 3s" in warned[0], text[-3000:]
    assert "wandb sync " in text


# ------------------------------------------------------------------------------------------------
# 11. Messages that are true


@pytest.mark.slow
def test_the_first_save_on_a_full_disk_says_the_disk_is_full(tmp_path):
    """A 4 MiB tmpfs as trainer.output_dir: the first checkpoint (15 MB) does not fit. Before:
    torch's "unexpected pos N vs M" and "4.0 MiB free", with no word of a full disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        rc, text = _train(disk, ["trainer.max_steps=3", "trainer.save_every=1"])
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    line = _one_error(text)
    assert rc == 3, text[-3000:]
    assert "the disk is full" in line and "Free space on the filesystem of" in line, line
    assert "The partial save" in line and "was removed" in line, line


@pytest.mark.slow
def test_a_planted_tmp_link_is_named_not_blamed_on_free_space(tmp_path):
    """Before: "Cannot call rmtree on a symbolic link ...; N MiB free ... Free space or fix
    permissions"."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (out / "checkpoints").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the run's")
    link = out / "checkpoints" / ".tmp-step_00000001"
    link.symlink_to(elsewhere)
    rc, text = _train(tmp_path, ["trainer.max_steps=2", "trainer.save_every=1"])
    line = _one_error(text)
    assert rc == 3, text[-3000:]
    assert f"{link} is a symbolic link" in line and f"rm {link}" in line, line
    assert "Free space" not in line and "MiB free" not in line and "was removed" not in line
    assert (elsewhere / "keep.txt").read_text() == "not the run's" and link.is_symlink()


@pytest.mark.slow
def test_a_save_that_made_nothing_does_not_say_it_removed_a_partial_save(tmp_path):
    """rank 0 cannot create the checkpoint directory (read-only): nothing was written, and the
    fix is the mount, not free space. Before: "The partial save ... was removed ... Free space
    or fix permissions"."""
    rc, text = _train(tmp_path, ["trainer.max_steps=2", "trainer.save_every=1"],
                      env={"LLAMA_TRAIN_FAULTS": "save_error:step=1,rank=0,errno=EROFS,at=mkdir"})
    line = _one_error(text)
    assert rc == 3, text[-3000:]
    assert "Nothing was written" in line and "was removed" not in line, line
    assert "read-only: remount it read-write" in line and "Free space" not in line, line


@pytest.mark.slow
def test_two_ranks_a_removed_partial_save_is_never_said_left_behind(tmp_path):
    """ENOSPC on rank 1 in the save of step 2: rank 0 removes the partial save; no rank says
    it "could not" (before: a rank other than 0 looked before rank 0 had removed it)."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = launcher_cmd([*TINY, f"trainer.output_dir={out}", "trainer.max_steps=4",
                        "trainer.save_every=2", "sample.tokens=0", "trainer.async_save=false"])
    rc = run(cmd, log, timeout=180, check=False, warm=True,
             env={"LLAMA_TRAIN_FAULTS": "save_error:step=2,rank=1,errno=ENOSPC"})
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if "llama-train: error:" in line]
    assert rc == 3 and errors and "Traceback" not in text, text[-3000:]
    for line in errors:
        assert "could not" not in line and "was removed" in line, line
        assert "the disk is full" in line, line
    assert not (out / "checkpoints" / ".tmp-step_00000002").exists()


@pytest.mark.parametrize("code, cause, fix", [
    ("ENOSPC", "the disk is full", "Free space on it"),
    ("EROFS", "the filesystem is read-only", "Remount it read-write"),
    ("EACCES", "this user may not write there", "Give this user write permission"),
    ("EIO", "the disk returned an I/O error", "dmesg"),
])
def test_disk_errors_say_their_cause_and_its_fix(tmp_path, code, cause, fix):
    """An output file that cannot be written mid-run, a disk error outside the checkpoints:
    the cause and the fix by errno. Before: "read-only, full or gone", "Free space, fix the
    permissions or the mount" for each, and "resumes from the last complete checkpoint" where
    none had been saved."""
    import errno

    from llama_train.train import _disk_error, _unwritable

    e = OSError(getattr(errno, code), os.strerror(getattr(errno, code)),
                str(tmp_path / "metrics.jsonl"))
    line = _unwritable(e, str(tmp_path))
    assert f"({cause}: trainer.output_dir={tmp_path})" in line and f"{fix}" in line, line
    assert "no checkpoint had been saved yet" in line and "starts again from step 0" in line
    line = _disk_error(e, None)
    assert f": {cause} (" in line and fix in line, line
    for other in ("Free space", "Remount", "permission", "dmesg"):
        assert other not in line or other in fix, line


def test_a_lone_surrogate_in_a_jsonl_names_the_file_and_line(tmp_path):
    """``{"text": "bad \\ud800 here"}``: valid JSON to Python, refused by Arrow's reader.
    Before: "could not read local json files ...: ValueError: Trailing data at position 337"."""
    from llama_train.data import DataConfig, DataError
    from llama_train.data.sources import open_source

    src = tmp_path / "docs.jsonl"
    rows = [json.dumps({"text": f"document {i}, plain text"}) for i in range(20)]
    rows.insert(12, '{"text": "bad \\ud800 here", "id": 12}')
    src.write_text("\n".join(rows) + "\n")
    for streaming in (True, False):
        source = open_source(DataConfig(source=str(src), streaming=streaming))
        with pytest.raises(DataError) as e:
            list(source.iter_texts())
        msg = str(e.value)
        assert f"{src} line 13 holds a lone surrogate (\\ud800 at character 4 of its 'text' " \
               f"value)" in msg, msg
        assert "Fix or remove that line" in msg and "\n" not in msg


@pytest.fixture(scope="module")
def poisoned_imports(tmp_path_factory):
    """Hugging Face exports of untrained tiny weights: one tensor NaN; one finite but so large
    that every logit overflows (the loss of the very first step is NaN)."""
    import torch

    from llama_train.hf import export_hf
    from llama_train.model import Transformer

    root = tmp_path_factory.mktemp("poisoned")
    cfg, prepared = tiny_prepared()
    torch.manual_seed(0)
    sd = Transformer(cfg.model).state_dict()
    nan = dict(sd)
    nan["layers.0.attention.wq.weight"] = torch.full_like(sd["layers.0.attention.wq.weight"],
                                                          float("nan"))
    huge = dict(sd)
    huge["output.weight"] = torch.full_like(sd["output.weight"], 3e38)
    return {name: export_hf(cfg.model, weights, root / name,
                            tokenizer_model=prepared.tokenizer_path)
            for name, weights in (("nan", nan), ("huge", huge))}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nan", "huge", "bad data"])
def test_a_run_with_no_good_step_is_not_told_to_save_more_often(tmp_path, poisoned_imports, case):
    """NaN weights from an import, finite weights whose first loss is NaN, data whose first
    batches are: no checkpoint interval would have saved a good step, so "lower
    trainer.save_every" was false advice (exit 4 before for each)."""
    over, env = ["trainer.max_steps=6", "trainer.save_every=1000"], None
    if case == "bad data":
        env = {"LLAMA_TRAIN_FAULTS": "nan:batch=1;nan:batch=2;nan:batch=3"}
    else:
        over.append(f"trainer.init_from={poisoned_imports[case]}")
    rc, text = _train(tmp_path, over, env=env)
    line = _one_error(text)
    assert "save_every" not in line, line
    if case == "nan":  # refused with the tensor's name before anything starts
        assert rc == 2 and "layers.0.self_attn.q_proj.weight" in line and "NaN" in line, line
    else:
        assert rc == 4, text[-3000:]
        assert "no step of this run has been good yet" in line, line
        assert "trainer.init_from" in line and "the first batches of its data" in line, line


# ------------------------------------------------------------------------------------------------
# 12. launch/multinode.sh checks the hostfile before it starts anything


def _multinode(tmp_path: Path, hostfile: str, env=None):
    """launch/multinode.sh with ``hostfile`` and a stand-in for deepspeed that notes its start:
    (result, whether it was started)."""
    hosts, started = tmp_path / "hosts", tmp_path / "started"
    hosts.write_text(hostfile)
    stub = tmp_path / "deepspeed"
    stub.write_text(f"#!/bin/sh\necho \"$@\" > {started}\n")
    stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "HOSTFILE", "NO_SSH",
                          "NUM_GPUS")}
    res = subprocess.run(["bash", str(LAUNCH / "multinode.sh"), "trainer.max_steps=1"],
                         env={**clean, "HOSTFILE": str(hosts), "DEEPSPEED": str(stub),
                              **(env or {})},
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    return res, started.exists()


@pytest.mark.parametrize("bad, lineno, words", [
    ("gpu2 slots=0", 3, "slots=0 is not a positive whole number"),
    ("gpu2 slots=-4", 3, "slots=-4 is not a positive whole number"),
    ("gpu2 slots=8gpus", 3, "slots=8gpus is not a positive whole number"),
    ("gpu2 slots=", 3, "slots= is not a positive whole number"),
    ("gpu2 slots = 8", 3, "write 'gpu2 slots=8'"),
    ("gpu2", 3, "no slots=N: write 'gpu2 slots=<"),
    ("gpu2:8", 3, "DeepSpeed's is 'gpu2 slots=8'"),
    ("slots=8", 3, "no host name before slots="),
    ("localhost slots=4", 3, "host localhost is already on line 2"),
    ("gpu2 slots=8 gpus=8", 3, "not '<host> slots=<N>'"),
])
def test_a_bad_hostfile_line_is_named_before_anything_starts(tmp_path, bad, lineno, words):
    res, started = _multinode(tmp_path, f"# nodes\nlocalhost slots=4\n{bad}\n\n",
                              {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    assert res.returncode == 2 and not started, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, res.stderr
    assert f"line {lineno}: '{bad}'" in errors[0] and words in errors[0], errors[0]


def test_a_hostfile_of_comments_only_is_refused(tmp_path):
    res, started = _multinode(tmp_path, "# nothing\n\n   \n")
    assert res.returncode == 2 and not started and "no '<host> slots=<N>' line" in res.stderr


def test_a_host_that_does_not_resolve_is_refused_in_ssh_mode_only(tmp_path):
    """ssh mode reaches hosts by name: one that does not resolve is named with its line. In
    no-ssh mode the names are labels: accepted, as launch/local_two_nodes.sh needs."""
    hostfile = "localhost slots=2\nno-such-node.invalid slots=2 # the second node\n"
    res, started = _multinode(tmp_path, hostfile)
    assert res.returncode == 2 and not started, res.stderr
    assert "line 2: 'no-such-node.invalid slots=2 # the second node': host " \
           "no-such-node.invalid does not resolve" in res.stderr, res.stderr
    res, started = _multinode(tmp_path, hostfile, {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"})
    assert res.returncode == 0 and started, res.stderr


def test_good_hostfile_lines_all_pass(tmp_path):
    """Comments after an entry, tabs, CRLF line ends, no newline at the end."""
    res, started = _multinode(tmp_path, "# c\r\nlocalhost slots=2 # rank 0's\r\n\t127.0.0.1\tslots=8",
                              {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"})
    assert res.returncode == 0 and started, res.stderr
