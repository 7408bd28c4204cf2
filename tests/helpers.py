"""Run llama-train for real: in-process config composition, or through the deepspeed launcher."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

# TINY: a run that takes seconds, the tiny model on a slice of the built-in corpus; one list for
# the tests and the start-up bench, which times this run
from llama_train.bench.startup import TINY  # noqa: F401 - re-exported for the tests
from llama_train.proc import free_port, kill_session  # free_port: re-exported for the tests
from llama_train.records import METRICS_FILE, RUN_INFO_FILE, Record, parse_line, read_metrics

# tests/ (this file, conftest.py, warm_ranks.py, workers/) and the repo above it: the test files
# sit one level down, in the directory of the package they test (docs/architecture.md)
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKERS = TESTS / "workers"  # the scripts the tests launch as ranks or children
BIN = Path(sys.executable).parent


# ZeRO-3 with the tiny settings (6 steps), a checkpoint every 2: conftest.py's zero3_run, which
# test_launcher_runs.py compares with ZeRO-0 and test_zero3.py resumes, reshards and exports
ZERO3 = ["deepspeed.zero_stage=3", "trainer.save_every=2"]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    # wandb's service address, which wandb sets in a test process that ran it in-process (for its
    # child processes to share that service): a launched job starts its own, as from a shell
    env.pop("WANDB_SERVICE", None)
    if extra:
        env.update(extra)
    return env


def launcher_cmd(overrides: List[str], nprocs: int = 2, port: Optional[int] = None,
                 extra_launcher: Optional[List[str]] = None) -> List[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port",
            str(port or free_port()), *(extra_launcher or []), "--module", "llama_train.train",
            *overrides]


def node_cmds(hostfile: Path, per_node: int, port: int, entry: List[str]) -> List[List[str]]:
    """The two 'nodes' of a two-host hostfile on this machine, as launch/multinode.sh starts
    them in no-ssh mode (launch/local_two_nodes.sh runs it once per node): ``deepspeed
    --hostfile H --master_port P --no_ssh --node_rank K --master_addr 127.0.0.1 ENTRY...``."""
    Path(hostfile).write_text(f"node0 slots={per_node}\nnode1 slots={per_node}\n")
    return [[str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--master_port", str(port),
             "--no_ssh", "--node_rank", str(k), "--master_addr", "127.0.0.1", *entry]
            for k in (0, 1)]


def run_nodes(cmds: List[List[str]], logs: List[Path], env: Optional[Dict[str, str]] = None,
              warm: bool = False, timeout: float = 300) -> List:
    """Both nodes' launches at once (:func:`node_cmds`), each into its log; their exit codes
    (each process group killed on the way out). ``warm``: forked from the warm parent."""
    with spawn(cmds[0], logs[0], env, warm) as p0, spawn(cmds[1], logs[1], env, warm) as p1:
        if warm and warm_server() is not None:
            assert all(isinstance(p, warm_server_job_type()) for p in (p0, p1)), _WARM.why
        return [p0.wait(timeout=timeout), p1.wait(timeout=timeout)]


_WARM = None  # the warm parent this process's environment was last launched from
# The warm parents of the environments this process has launched with, the most recently used
# last, KEEP_WARM kept: a test that sets a variable (monkeypatch) gets a parent with it, and the
# next test, the variable gone again, the one it had before (~4 CPU-s a parent started)
_WARM_PARENTS: List = []
_WARM_LOCK = threading.Lock()  # test_hang.py launches from a pool of threads
KEEP_WARM = 3


def warm_server():
    """The warm parent (tests/warm_ranks.py) that can fork this test process's launches now,
    started when none can; None when LLAMA_TRAIN_TEST_WARM=0 (every command exec'd for real)."""
    global _WARM
    if os.environ.get("LLAMA_TRAIN_TEST_WARM", "1") == "0":
        return None
    from warm_ranks import WarmServer

    env = _env()
    with _WARM_LOCK:
        _WARM_PARENTS[:] = [s for s in _WARM_PARENTS if not s.dead]
        # none fits where a variable an import may read differs from what it started with (an
        # import here set one, lm_eval sets HF_XET_HIGH_PERFORMANCE; or a test did)
        server = next((s for s in reversed(_WARM_PARENTS) if s.fits(env)), None)
        if server is None:
            _log_warm_start(env)
            server = WarmServer(env, str(REPO))
            if len(_WARM_PARENTS) >= KEEP_WARM:
                _WARM_PARENTS.pop(0).retire()
        else:
            _WARM_PARENTS.remove(server)
        _WARM_PARENTS.append(server)
        _WARM = server
    return server


def _log_warm_start(env: Dict[str, str]) -> None:
    """LLAMA_TRAIN_TEST_WARM_LOG=FILE: a line per warm parent started, with the test and why none
    of those kept could fork its launch, to find what starts them (issue 56)."""
    path = os.environ.get("LLAMA_TRAIN_TEST_WARM_LOG")
    if path:
        from warm_ranks import env_difference

        why = [env_difference(s.env, s.import_env, env) for s in _WARM_PARENTS]
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', '')} "
                    f"{os.environ.get('PYTEST_CURRENT_TEST', '')}: {why}\n")


def warm_server_job_type():
    from warm_ranks import WarmJob

    return WarmJob


def start(cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None, warm: bool = False):
    """``cmd`` in a session of its own, stdout and stderr into ``log`` (truncated), stdin from
    /dev/null. ``warm``: forked from the warm parent (tests/warm_ranks.py) where it can be,
    the same command exec'd otherwise. Returns a ``Popen`` or the warm parent's job."""
    full = _env(env)
    server = warm_server() if warm else None
    if server is not None:
        Path(log).write_text("")
        job = server.start([str(c) for c in cmd], full, str(REPO), str(log))
        if job is not None:
            return job
        # LLAMA_TRAIN_TEST_WARM=require: a test that asks to fork and cannot fails, saying why
        assert os.environ.get("LLAMA_TRAIN_TEST_WARM") != "require", \
            f"not forked ({server.why}): {' '.join(map(str, cmd))}"
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, cwd=REPO, env=full, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def spawn(cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None, warm: bool = False):
    """Start a process group; it is killed on exit whatever happens in the test. ``warm``:
    forked from the warm parent (:func:`start`); the launcher's own tests never ask for it."""
    proc = start(cmd, log, env, warm)
    try:
        yield proc
    finally:
        kill_session(proc)


def dump_stacks(proc: subprocess.Popen, wait_s: float = 3.0, gap_s: float = 0.5) -> int:
    """Ask every llama-train process of ``proc`` (itself or the ranks it launched, and their
    DataLoader workers) to print its threads' stacks into the log: SIGUSR1, for which
    llama_train.train registers faulthandler. The launcher's own processes (their command lines name the module only as an
    argument) are left alone: SIGUSR1 would kill them. Returns how many were asked."""
    import psutil

    asked = 0
    try:
        top = psutil.Process(proc.pid)
        family = [top, *top.children(recursive=True)]
    except psutil.Error:
        return 0
    for child in family:
        try:
            cmd = child.cmdline()
            if "-m" in cmd and cmd[cmd.index("-m") + 1:][:1] == ["llama_train.train"]:
                child.send_signal(signal.SIGUSR1)
                asked += 1
                time.sleep(gap_s)  # one at a time: they all write to the same log
        except psutil.Error:
            continue
    if asked:
        time.sleep(wait_s)
    return asked


def run(cmd: List[str], log: Path, timeout: float = 300, env=None, check: bool = True,
        warm: bool = False) -> int:
    with spawn(cmd, log, env, warm) as proc:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # a hang is read from the stacks of every process, not from the log's last line
            asked = dump_stacks(proc)
            raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n"
                                 f"{tail(log, 400 if asked else 60)}")
    if check and rc != 0:
        raise AssertionError(f"exit {rc}: {' '.join(cmd)}\n{tail(log)}")
    return rc


def one_process(out: Path, overrides: List[str], log: Path, timeout: float = 300,
                warm: bool = True) -> int:
    """Plain ``python -m llama_train.train`` with the tiny settings, no launcher: a world of one
    (micro-batch 4 keeps the global batch of the launcher runs' 2 ranks x 2). Forked from the
    warm parent unless ``warm=False``."""
    cmd = [sys.executable, "-m", "llama_train.train", *TINY, f"trainer.output_dir={out}",
           "trainer.micro_batch=4", *overrides]
    return run(cmd, log, timeout, warm=warm)


def train(out: Path, overrides: List[str] = (), nprocs: int = 2, timeout: float = 300,
          check: bool = True, env=None, log_name: str = "train.log",
          launcher: bool = False) -> int:
    """``deepspeed --num_gpus N --module llama_train.train`` with the tiny settings. Hydra's
    options in ``overrides`` (``--multirun``) go first: Hydra reads none after an override.
    The command runs forked from the warm parent (DeepSpeed's runner and launcher deciding what
    each rank gets: tests/warm_ranks.py); ``launcher=True``: exec'd for real, where the
    launcher is what the test checks."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [o for o in overrides if o.startswith("--")]
    rest = [o for o in overrides if not o.startswith("--")]
    cmd = launcher_cmd([*flags, *TINY, f"trainer.output_dir={out}", *rest], nprocs)
    return run(cmd, out.parent / f"{out.name}-{log_name}", timeout, env, check,
               warm=not launcher)


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def copy_at_step(src: Path, dst: Path, step: int) -> Path:
    """``dst``: run ``src`` as a run stopped right after its checkpoint of ``step`` would have
    left it (later checkpoints, metrics lines and the end-of-run sample removed), to resume from
    without training the first steps again."""
    ckpt = src / "checkpoints" / f"step_{step:08d}"
    assert ckpt.is_dir(), f"{src} kept no checkpoint of step {step} (trainer.keep_last)"
    shutil.copytree(src, dst)
    ckpts = dst / "checkpoints"
    for d in ckpts.glob("step_*"):
        if int(d.name.split("_")[1]) > step:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(f"step_{step:08d}\n")
    kept = [line for line in (dst / METRICS_FILE).read_text().splitlines()
            if parse_line(line).step <= step]
    (dst / METRICS_FILE).write_text("".join(f"{line}\n" for line in kept))
    for name in ("sample.txt", RUN_INFO_FILE):
        (dst / name).unlink(missing_ok=True)
    return dst


def export_hf(checkpoints: Path, hf_dir: Path) -> None:
    """``llama-export`` in a process of its own (forked from the warm parent): the newest
    checkpoint under ``checkpoints`` -> a Hugging Face model directory ``hf_dir``."""
    run([str(BIN / "llama-export"), str(checkpoints), str(hf_dir)],
        Path(hf_dir).parent / f"{Path(hf_dir).name}-export.log", warm=True)


def import_hf(hf_dir: Path, out: Path) -> None:
    """``llama-import`` in a process of its own (forked from the warm parent): a Hugging Face
    model directory -> a llama-train weights file ``out``."""
    run([str(BIN / "llama-import"), str(hf_dir), str(out)],
        Path(out).parent / f"{Path(out).name}-import.log", warm=True)


def assert_hf_logits_match(checkpoints: Path, hf_dir: Path, tol: float = 1e-4):
    """The exported ``hf_dir``, loaded by transformers, computes the logits of the newest
    checkpoint under ``checkpoints`` (within ``tol``, both in eval mode). Returns that
    checkpoint's (ModelArgs, consolidated state dict)."""
    import torch
    import transformers

    from llama_train.checkpoint import load_consolidated
    from llama_train.model import Transformer

    args, sd, _ = load_consolidated(str(checkpoints))
    ours = Transformer(args)
    ours.load_state_dict(sd)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    x = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf.eval()(x).logits - ours.eval()(x)).abs().max().item()
    assert diff < tol, diff
    return args, sd


def metrics(out: Path) -> List[Record]:
    return read_metrics(out / METRICS_FILE)


def resumed_from(out: Path) -> List[str]:
    """The checkpoints the run in ``out`` resumed from, one per resume, in order."""
    return [r["checkpoint"] for r in metrics(out) if r.get("event") == "resume"]


def losses(out: Path) -> Dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(out) if "loss" in r}


def losses_so_far(out: Path) -> Dict[int, float]:
    """``losses`` of a job still writing them, for polling it: {} before its metrics.jsonl
    exists (a half-written last line is skipped by ``metrics``)."""
    try:
        return losses(out)
    except FileNotFoundError:
        return {}


def rank_pid(launcher_pid: int, local_rank: int) -> Optional[int]:
    """The pid of local rank ``local_rank`` under the deepspeed launcher ``launcher_pid`` (None
    while it has not started, or once it is gone)."""
    import psutil

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return None
    for p in children:
        try:
            if (f"--local_rank={local_rank}" in p.cmdline()
                    and "deepspeed.launcher.launch" in " ".join(p.parent().cmdline())):
                return p.pid
        except psutil.Error:
            continue
    return None


def wait_for(pred, timeout: float, interval: float = 0.2) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


def assert_losses_close(a: Dict[int, float], b: Dict[int, float], tol: float) -> None:
    """Same steps, every loss within ``tol`` (absolute)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = max(abs(a[k] - b[k]) for k in a)
    assert worst < tol, f"max |diff| {worst:.2e} >= {tol}: {a} vs {b}"


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "LLAMA_TRAIN_FAULTS")


@contextmanager
def launch_vars_restored():
    """The launcher variables (RANK, WORLD_SIZE...) as they were before, whatever an in-process
    run of the entry point set (it makes itself rank 0 of 1 when no launcher started it)."""
    before = {k: os.environ.get(k) for k in LAUNCH_VARS}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def world_of_one():
    """This process as rank 0 of 1 (the in-process tier): the first Trainer starts the group,
    later ones reuse it. Afterwards the group is destroyed, DeepSpeed's cached groups are
    forgotten and the launcher variables restored, so another module can start its own."""
    import torch

    from llama_train.engine import shutdown_distributed

    threads = torch.get_num_threads()
    with launch_vars_restored():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ.pop("LLAMA_TRAIN_FAULTS", None)
        try:
            yield
        finally:
            shutdown_distributed()
            torch.set_num_threads(threads)


def compose_cfg(overrides):
    """llama-train's config for ``overrides``: composed by Hydra and checked (no data, no
    process group)."""
    from hydra import compose, initialize_config_dir

    from llama_train.config import load_config
    from llama_train.paths import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return load_config(compose("config", overrides=list(overrides)))


def cfg_for(out: Path, *overrides: str):
    """The in-process tier's config: the tiny settings on one rank (micro-batch 4 keeps the
    global batch of the launcher tests' 2 ranks x 2)."""
    return compose_cfg([*TINY, "trainer.micro_batch=4", f"trainer.output_dir={out}", *overrides])


def trained_and_exported(root: Path, steps: int):
    """The tiny model trained ``steps`` steps in this process (a world of one), its checkpoint at
    the last step in ``root/run`` and that checkpoint exported to ``root/hf``: (run, hf)."""
    from llama_train.hf import export_main
    from llama_train.train import train as train_in_process

    out, hf = root / "run", root / "hf"
    train_in_process(cfg_for(out, f"trainer.max_steps={steps}", f"trainer.save_every={steps}"))
    export_main([str(out), str(hf)])
    return out, hf


def tiny_prepared():
    """The tiny config and its prepared data: what the launched runs train on (prepared once a
    session, in conftest's LLAMA_TRAIN_CACHE). Returns (config, PreparedData)."""
    from llama_train.data import prepare_data

    cfg = compose_cfg(TINY)
    return cfg, prepare_data(cfg.data, vocab_size=cfg.model.vocab_size)


def rows(out: Path) -> List[Record]:
    return read_metrics(out / METRICS_FILE)


def step_rows(out: Path) -> Dict[int, dict]:
    return {r["step"]: r for r in rows(out) if "loss" in r}



def docs_prepared(root: Path, block_bytes: int) -> str:
    """25 pages of the Python docs prepared with a 512-piece tokenizer into 5000-token shards
    of ``block_bytes`` checksum blocks (the data-loader tests' small corpus). Returns its dir."""
    import json

    import pydoc_data.topics
    import pytest

    from llama_train.data import DataConfig, prepare_data, train_tokenizer
    from llama_train.data import prepare as prepare_module

    topics = pydoc_data.topics.topics
    docs = [topics[k] for k in sorted(topics)[:25]]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_tokenizer(docs, 512, root / "tok")
    cfg = DataConfig(source=str(src), tokenizer=tok, prepared_dir=str(root / "prepared"),
                     val_fraction=0.2, num_proc=1, shard_tokens=5000, streaming=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare_module, "BLOCK_BYTES", block_bytes)
        return prepare_data(cfg, 512).dir


def run_main(argv, monkeypatch, capsys, port: bool = True) -> tuple:
    """``llama-train <argv>`` through its real ``main()`` in this process: (exit code, stderr +
    stdout). ``port``: a fresh MASTER_PORT (main() ends its group: a new one each)."""
    from llama_train import train as train_mod

    monkeypatch.setattr(sys, "argv", ["llama-train", *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # main() sets it; restored afterwards
    if port:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
    code = 0
    try:
        train_mod.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.err + out.out
