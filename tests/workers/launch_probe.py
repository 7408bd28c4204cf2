"""What a rank receives from whatever started it, as JSON in $LLAMA_TRAIN_PROBE_OUT/<RANK>.json
(tests/system/test_warm_ranks.py compares the real launcher's ranks with forked ones).

``LLAMA_TRAIN_PROBE_EXIT=R:CODE``: rank R exits with CODE once the others have written their
record; the others wait to be stopped (the launcher's SIGTERM) and record that they were.

``--bare`` (its first argument): the same record without importing DeepSpeed and torch first
(~0.1 CPU-s, not ~3), for a test that reads only what the process was given, not what a rank's
imports add (nor compares it with a rank's)."""

import json
import logging
import os
import signal
import sys
import time


def cmdline(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0")]
    except OSError:
        return []
    while argv and not argv[-1]:
        argv.pop()
    return argv


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def descriptors() -> dict:
    """Each open descriptor: what it is (a file, a pipe, /dev/null...) and whether exec would
    pass it on."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            inheritable = os.get_inheritable(int(name))
        except OSError:
            continue  # the listing's own, closed with it
        kind = target if target.startswith("/dev/") else (
            "file" if target.startswith("/") else target.split(":")[0])
        out[name] = [kind, inheritable]
    return out


def dispositions() -> dict:
    """Each signal's handler as Python sees it, and the kernel's blocked, ignored and caught
    sets (those hold the handlers Python does not know of too)."""
    names = {}
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        h = signal.getsignal(s)
        names[str(int(s))] = (h.name if isinstance(h, signal.Handlers) else
                              "default_int_handler" if h is signal.default_int_handler else
                              "not Python's" if h is None else "a Python function")
    with open("/proc/self/status") as f:
        masks = dict(line.split(":\t") for line in f.read().splitlines()
                     if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    return {"handlers": names, "masks": masks}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split(f"{field}:")[1].split()[0])


def _cmdline_bytes() -> int:
    with open("/proc/self/cmdline", "rb") as f:
        return len(f.read())


def _stdin_text() -> str:
    """What stdin holds (a pipe's or a file's text; a terminal is not read)."""
    return "" if os.isatty(0) else sys.stdin.read()


def main() -> None:
    if sys.argv[1:2] != ["--bare"]:
        # what every rank imports (torch.optim's AdamW imports torch._dynamo): each sets a
        # variable
        import deepspeed  # noqa: F401
        import torch._dynamo  # noqa: F401

    import llama_train
    from llama_train import proc

    ds_log = logging.getLogger("DeepSpeed")
    out = os.environ["LLAMA_TRAIN_PROBE_OUT"]
    rank = os.environ.get("RANK", "solo")
    launcher = proc.stop_with_launcher()
    ppid = os.getppid()
    record = {
        "argv": sys.argv, "orig_argv": sys.orig_argv, "executable": sys.executable,
        "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path,
        "cmdline": cmdline(os.getpid()), "parent": cmdline(ppid),
        "grandparent": cmdline(parent(ppid)), "under_launcher": launcher is not None,
        "job_command": proc.job_command(), "stdin": os.readlink("/proc/self/fd/0"),
        "stdout_write_through": sys.stdout.write_through, "main": __name__,
        "same_session_as_parent": os.getsid(0) == os.getsid(ppid),
        "llama_train": llama_train.__file__,
        "main_spec": getattr(sys.modules["__main__"].__spec__, "name", None),  # None: a file
        # DeepSpeed's logger (and its handlers): a rank's DeepSpeed says only what a real one says
        "deepspeed_log_levels": [ds_log.level, [h.level for h in ds_log.handlers]],
        "fds": descriptors(), "stdout_is_stderr": os.path.sameopenfile(1, 2),
        "signals": dispositions(), "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(), "stdin_text": _stdin_text(),
        # how much command line the process has: a forked one, the warm parent's padded area
        "cmdline_bytes": _cmdline_bytes(), "rss_file_kib": _status_kib("RssFile"),
    }
    print(f"probe {rank}: on stdout")
    print(f"probe {rank}: on stderr", file=sys.stderr)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    stop = os.environ.get("LLAMA_TRAIN_PROBE_EXIT")
    if not stop:
        return
    who, code = stop.split(":")
    if rank == who:
        others = int(os.environ["WORLD_SIZE"]) - 1
        while len(os.listdir(out)) < others + 1:
            time.sleep(0.05)
        sys.exit(int(code))

    def stopped(signum, frame):
        with open(os.path.join(out, f"{rank}.signal"), "w") as f:
            f.write(signal.Signals(signum).name)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    time.sleep(60)


if __name__ == "__main__":
    main()
