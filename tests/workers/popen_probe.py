"""Starts tests/workers/launch_probe.py through subprocess with the arguments the benchmarks and
the drill use, and records what each child gave back (tests/system/test_warm_ranks.py runs this
exec'd, where every child is exec'd, and forked from the warm parent, where its ``Popen`` forks
them: tests/warm_ranks.py's ForkedPopen).

Before starting them it handles SIGTERM and SIGUSR1, ignores SIGHUP, has faulthandler dump on
SIGUSR2, registers an exit handler and holds a TemporaryDirectory and descriptors a child must
not get: a child exec'd has none of that but the ignored SIGHUP. Each child's record goes to
``$LLAMA_TRAIN_PROBE_OUT/<form>/solo.json``; this process's to
``$LLAMA_TRAIN_PROBE_OUT/popen.json``."""

import atexit
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = Path(__file__).resolve().with_name("launch_probe.py")
REPO = PROBE.parent.parent.parent


def _env(out: Path, **extra) -> dict:
    out.mkdir()
    return {**os.environ, "LLAMA_TRAIN_PROBE_OUT": str(out), "WANDB_MODE": "offline", **extra}


def to_a_file(top: Path, passed: int) -> dict:
    """``Popen`` as llama-bench memory and the drill start a job: another directory, its own
    environment, stdout to a file, stderr=STDOUT, a session of its own, a descriptor passed."""
    out, sub = top / "file", top / "file-cwd"
    sub.mkdir()
    with open(top / "file.log", "w") as fh:
        proc = subprocess.Popen([sys.executable, "-u", str(PROBE), "a b", "--c"], cwd=sub,
                                env=_env(out), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, pass_fds=(passed,))
        rc = proc.wait(timeout=120)
    return {"rc": rc, "output": (top / "file.log").read_text()}


def captured(top: Path) -> dict:
    """``subprocess.run`` as llama-bench data runs a command: capture_output, text, input, a
    module run with ``-m``, an exit code of its own, the descriptors inheritable here kept."""
    env = _env(top / "capture", LLAMA_TRAIN_PROBE_EXIT="solo:3", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-m", "tests.workers.launch_probe", "x"], cwd=REPO,
                          env=env, capture_output=True, text=True, input="to stdin\n",
                          close_fds=False, timeout=120)
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def main() -> None:
    top = Path(os.environ["LLAMA_TRAIN_PROBE_OUT"])
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR2)
    atexit.register(lambda: (top / f"atexit-{os.getpid()}").write_text("ran"))
    tmp = tempfile.TemporaryDirectory(dir=top)  # its cleanup: at this process's exit only
    passed, kept = os.pipe()
    closed = os.open(os.devnull, os.O_RDONLY)  # not inheritable: exec closes it
    os.set_inheritable(kept, True)
    record = {"file": to_a_file(top, passed), "capture": captured(top),
              "tmp_left": os.path.isdir(tmp.name), "fds": [passed, kept, closed]}
    (top / "popen.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
