"""What a rank receives from whatever started it, as JSON in $LLAMA_TRAIN_PROBE_OUT/<RANK>.json
(tests/system/test_warm_ranks.py compares the real launcher's ranks with forked ones).

``LLAMA_TRAIN_PROBE_EXIT=R:CODE``: rank R exits with CODE once the others have written their
record; the others wait to be stopped (the launcher's SIGTERM) and record that they were."""

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


def main() -> None:
    # what every rank imports (torch.optim's AdamW imports torch._dynamo): each sets a variable
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
    }
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
