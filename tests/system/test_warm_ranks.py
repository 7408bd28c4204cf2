"""The warm parent's ranks (tests/warm_ranks.py) get exactly what the deepspeed launcher gives.

Most multi-rank tests start their jobs forked from a warm parent (helpers.train). These tests
run one probe both ways, through the real ``deepspeed`` command and forked, and compare what each
rank received: its environment, sys.argv, sys.orig_argv, sys.executable, sys.path, working
directory, its own, its launcher's and its runner's command lines, stdin, stdout's buffering, and
what llama_train reads from them (under the launcher? the command to rerun), its descriptors,
session and signal dispositions. A rank that fails ends the job the same way: the same exit code,
the other ranks stopped with SIGTERM. A forked command's own ``subprocess.Popen`` (the benchmarks'
and the kill -9 drill's launches) forks its child too: that child gets what exec gives it, and
Popen gives back the same exit code and output."""

import json
import os
import signal
import subprocess
import sys

import pytest

import helpers
from helpers import BIN, REPO, free_port
from warm_ranks import PAD

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("LLAMA_TRAIN_TEST_WARM", "1") == "0",
    reason="LLAMA_TRAIN_TEST_WARM=0: every command is exec'd, no warm parent to compare")]

PROBE = "tests.workers.launch_probe"


def probe(out, cmd, warm: bool, env=None):
    out.mkdir()
    env = {"LLAMA_TRAIN_PROBE_OUT": str(out), **(env or {})}
    with helpers.spawn(cmd, out.parent / f"{out.name}.log", env, warm=warm) as proc:
        if warm:  # really forked: no interpreter started for it
            assert isinstance(proc, helpers.warm_server_job_type()), helpers.warm_server().why
        rc = proc.wait(timeout=120)
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    signals = {p.stem: p.read_text() for p in out.glob("*.signal")}
    return rc, records, signals, (out.parent / f"{out.name}.log").read_text()


def launch(port: int, *args: str, script: bool = False):
    """The probe launched as a module (``--module``, as llama_train.train is), or as a file
    (``deepspeed ... FILE.py``, as tests/workers/hang_worker.py is)."""
    what = [str(REPO / (PROBE.replace(".", "/") + ".py"))] if script else ["--module", PROBE]
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), *what, *args]


def differences(real: dict, warm: dict) -> dict:
    """Every field that differs (in env: every variable), but the probe's own output dir and
    the size of its command line's area (a forked process has the warm parent's) and the file
    pages it has mapped (compared apart: :func:`near`)."""
    real, warm = json.loads(json.dumps(real)), json.loads(json.dumps(warm))
    for r in (real, warm):
        r["env"].pop("LLAMA_TRAIN_PROBE_OUT")
        r.pop("cmdline_bytes")
        r.pop("rss_file_kib")
    keys = set(real) | set(warm)
    out = {k: (real.get(k), warm.get(k)) for k in keys if real.get(k) != warm.get(k)}
    if "env" in out:
        r, w = out["env"]
        out["env"] = {k: (r.get(k), w.get(k)) for k in set(r) | set(w) if r.get(k) != w.get(k)}
    return out


def near(real: dict, warm: dict) -> bool:
    """The file pages (libraries) a process has mapped in, what its RSS counts of them, within
    10% of an exec'd one's: a fork does not copy their page tables (warm_ranks maps them in)."""
    return abs(warm["rss_file_kib"] - real["rss_file_kib"]) < 0.1 * real["rss_file_kib"]


@pytest.mark.parametrize("script", [False, True], ids=["module", "file"])
def test_a_forked_rank_gets_what_the_launcher_gives(tmp_path, script):
    port = free_port()
    args = ["model=tiny", "trainer.output_dir=/x y", "--flag"]
    cmd = launch(port, *args, script=script)
    rc_real, real, _, log_real = probe(tmp_path / "real", cmd, warm=False)
    rc_warm, warm, _, log_warm = probe(tmp_path / "warm", cmd, warm=True)
    assert rc_real == rc_warm == 0, (log_real[-2000:], log_warm[-2000:])
    assert sorted(real) == sorted(warm) == ["0", "1"]
    for rank in real:
        assert differences(real[rank], warm[rank]) == {}, rank
        assert near(real[rank], warm[rank]), rank
    r = real["0"]  # what the comparison covers, as the launcher gives it
    assert r["argv"][1:] == ["--local_rank=0", *args]
    assert r["env"]["RANK"] == "0" and r["env"]["WORLD_SIZE"] == "2"
    assert r["env"]["MASTER_PORT"] == str(port) and r["env"]["LOCAL_SIZE"] == "2"
    assert "deepspeed.launcher.launch" in r["parent"]
    assert r["main_spec"] == (None if script else PROBE)  # a file ran, or the module
    assert r["path"][0] == str((REPO / PROBE.replace(".", "/")).parent if script else REPO)
    assert r["under_launcher"] and r["job_command"].startswith("deepspeed --num_gpus 2")


def _two_nodes(out, cmds, warm: bool):
    """Both nodes' launches at once, each rank's record (by its global RANK)."""
    out.mkdir()
    env = {"LLAMA_TRAIN_PROBE_OUT": str(out)}
    logs = [out.parent / f"{out.name}-node{k}.log" for k in (0, 1)]
    rcs = helpers.run_nodes(cmds, logs, env, warm=warm, timeout=120)
    assert rcs == [0, 0], "\n".join(log.read_text()[-2000:] for log in logs)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_two_nodes_forked_ranks_get_what_the_launcher_gives(tmp_path):
    """Two launcher invocations of one machine, --no_ssh --node_rank 0 and 1 (as
    launch/local_two_nodes.sh; tests/engine/test_zeropp.py's hpZ job runs them forked), 2 ranks
    per node: each rank's environment (CROSS_RANK, LOCAL_RANK, ... ) and the rest are the
    real launcher's."""
    cmds = helpers.node_cmds(tmp_path / "hostfile", 2, free_port(), ["--module", PROBE, "a=1"])
    real = _two_nodes(tmp_path / "real", cmds, warm=False)
    warm = _two_nodes(tmp_path / "warm", cmds, warm=True)
    assert sorted(real) == sorted(warm) == ["0", "1", "2", "3"]
    for rank in real:
        assert differences(real[rank], warm[rank]) == {}, rank
    r = real["3"]
    assert (r["env"]["CROSS_RANK"], r["env"]["LOCAL_RANK"], r["env"]["WORLD_SIZE"]) == \
        ("1", "1", "4")
    assert r["argv"][1:] == ["--local_rank=1", "a=1"] and r["under_launcher"]


def test_a_failing_rank_ends_the_job_as_the_launcher_ends_it(tmp_path):
    port = free_port()
    env = {"LLAMA_TRAIN_PROBE_EXIT": "1:3"}
    real = probe(tmp_path / "real", launch(port), warm=False, env=env)
    warm = probe(tmp_path / "warm", launch(port), warm=True, env=env)
    assert real[0] == warm[0] == 3, (real[3][-2000:], warm[3][-2000:])
    assert real[2] == warm[2] == {"0": "SIGTERM"}


def test_a_plain_python_m_command_is_forked_as_exec_would_run_it(tmp_path):
    cmd = [sys.executable, "-m", PROBE, "a", "b c"]
    rc_real, real, _, _ = probe(tmp_path / "real", cmd, warm=False)
    rc_warm, warm, _, _ = probe(tmp_path / "warm", cmd, warm=True)
    assert rc_real == rc_warm == 0
    # its parent is whoever started it: this test process, or the warm parent; llama_train
    # reads a parent's command line only to tell a launcher, which under_launcher compares
    assert set(differences(real["solo"], warm["solo"])) <= {"parent", "grandparent"}
    assert near(real["solo"], warm["solo"])
    assert real["solo"]["argv"][1:] == ["a", "b c"] and not real["solo"]["under_launcher"]


def test_a_job_whose_environment_an_import_may_read_is_exec_d(tmp_path):
    """A variable an import may have read (not one of warm_ranks.RUNTIME_VARS) set otherwise
    than in the warm parent: the command is exec'd for real, not forked. (The probe --bare: only
    what it was given is read here, not what its imports would add.)"""
    cmd = [sys.executable, "-m", PROBE, "--bare"]
    out = tmp_path / "p"
    out.mkdir()
    env = {"LLAMA_TRAIN_PROBE_OUT": str(out), "OMP_NUM_THREADS": "2"}
    with helpers.spawn(cmd, tmp_path / "p.log", env, warm=True) as proc:
        assert isinstance(proc, subprocess.Popen)
        assert proc.wait(timeout=60) == 0
    assert json.loads((out / "solo.json").read_text())["env"]["OMP_NUM_THREADS"] == "2"


def test_a_variable_this_process_set_since_is_in_a_new_warm_parent(tmp_path, monkeypatch):
    """An import in the test process sets a variable every later launch gets (lm_eval sets
    HF_XET_HIGH_PERFORMANCE): the next launch comes from a warm parent started with it, forked,
    not exec'd, and its rank sees it."""
    cmd = [sys.executable, "-m", PROBE]
    first = helpers.warm_server()
    monkeypatch.setenv("LLAMA_TRAIN_TEST_DRIFT", "1")
    _, records, _, _ = probe(tmp_path / "p", cmd, warm=True)
    assert helpers.warm_server() is not first
    assert records["solo"]["env"]["LLAMA_TRAIN_TEST_DRIFT"] == "1"


POPEN_PROBE = [sys.executable, "-m", "tests.workers.popen_probe"]


def _popen_probe(out, warm: bool):
    """tests/workers/popen_probe.py exec'd (its children exec'd) or forked (its children forked
    through warm_ranks.ForkedPopen): its record and each child's."""
    out.mkdir()
    log = out.parent / f"{out.name}.log"
    with helpers.spawn(POPEN_PROBE, log, {"LLAMA_TRAIN_PROBE_OUT": str(out)}, warm=warm) as p:
        if warm:
            assert isinstance(p, helpers.warm_server_job_type()), helpers.warm_server().why
        assert p.wait(timeout=240) == 0, log.read_text()[-3000:]
    kids = {f: json.loads((out / f / "solo.json").read_text()) for f in ("file", "capture")}
    for kid in kids.values():  # the same directory, under real/ or warm/; a pipe, another one
        kid["cwd"] = os.path.relpath(kid["cwd"], out)
        kid["stdin"] = kid["stdin"].split(":[")[0]
    files = sorted("atexit-PID" if p.name.startswith("atexit-") else p.name for p in out.iterdir())
    return json.loads((out / "popen.json").read_text()), kids, files


def test_a_child_forked_through_popen_gets_what_exec_gives(tmp_path):
    """A forked command's own subprocess.Popen / run (the benchmarks' and the drill's launches:
    cwd, env, stdout to a file, stderr=STDOUT, start_new_session, pass_fds, capture_output,
    input, close_fds=False) forks its child from the warm interpreter: the child gets what exec
    gives (environment, argv, cwd, sys.path, descriptors, session, signal dispositions, the
    libraries' pages in its RSS) and Popen gives back the same exit code and output."""
    real, real_kids, real_files = _popen_probe(tmp_path / "real", warm=False)
    warm, warm_kids, warm_files = _popen_probe(tmp_path / "warm", warm=True)
    # the prober's exit handler ran once, its temporary directory was there until it ended:
    # no child ran them
    assert real_files == warm_files == ["atexit-PID", "capture", "file", "file-cwd", "file.log",
                                        "popen.json"]
    assert real == warm and real["tmp_left"]
    for form in ("file", "capture"):
        r, w = real_kids[form], warm_kids[form]
        assert r["cmdline_bytes"] < PAD < w["cmdline_bytes"], form  # forked, really
        # its parent is the prober either way; the prober's parent: this process, the warm one
        assert set(differences(r, w)) <= {"grandparent"}, (form, differences(r, w))
        assert near(r, w), form
        assert r["parent"] == [*POPEN_PROBE]
    f, c = real_kids["file"], real_kids["capture"]
    passed, kept, closed = real["fds"]
    # what the comparison covers, as exec gives it
    assert real["file"]["rc"] == 0 and real["capture"]["rc"] == 3
    assert real["file"]["output"] == "probe solo: on stdout\nprobe solo: on stderr\n"
    assert (real["capture"]["stdout"], real["capture"]["stderr"]) == \
        ("probe solo: on stdout\n", "probe solo: on stderr\n")
    assert f["cwd"] == "file-cwd" and f["argv"][1:] == ["a b", "--c"]
    assert f["path"][0] == str(REPO / "tests" / "workers") and c["path"][0] == str(REPO)
    assert f["session_leader"] and not c["session_leader"] and f["stdout_is_stderr"]
    assert f["fds"][str(passed)] == ["pipe", True] and {str(kept), str(closed)} - set(f["fds"]) \
        == {str(kept), str(closed)}
    assert c["fds"][str(kept)] == ["pipe", True] and str(closed) not in c["fds"]
    assert c["fds"]["0"][0] == "pipe" and c["stdin_text"] == "to stdin\n"
    sig = f["signals"]["handlers"]
    assert (sig[str(int(signal.SIGTERM))], sig[str(int(signal.SIGUSR1))],
            sig[str(int(signal.SIGHUP))], sig[str(int(signal.SIGINT))]) == \
        ("SIG_DFL", "SIG_DFL", "SIG_IGN", "default_int_handler")
    assert f["env"]["WANDB_MODE"] == "offline"
