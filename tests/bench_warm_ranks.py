"""CPU and wall time of the tests' tiny 2-rank launch, forked from the warm parent against exec'd.

    .venv/bin/python tests/bench_warm_ranks.py [--rounds 3] [--launches 4]

Each round runs, in turn, a fresh process that makes ``--launches`` launches with
``helpers.train`` forked from a warm parent (its start-up counted: once per process, as once per
pytest worker), then one that makes them exec'd (``launcher=True``); the CPU of each is its own
and everything it started (user + sys, children reaped), read after the warm parent has ended.
Prints each round and the medians per launch."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(mode: str, launches: int) -> dict:
    """In a fresh process: ``launches`` tiny launches of ``mode`` (warm | exec)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import helpers

    root = Path(tempfile.mkdtemp(prefix=f"bench_warm_{mode}_"))
    t = time.monotonic()
    for i in range(launches):
        helpers.train(root / f"r{i}", ["trainer.compile=false"], launcher=(mode == "exec"))
    for parent in helpers._WARM_PARENTS:  # its jobs' CPU reaches us once it has exited
        parent.close()
    wall = time.monotonic() - t
    shutil.rmtree(root, ignore_errors=True)
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return {"mode": mode, "launches": launches, "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--launches", type=int, default=4)
    p.add_argument("--one", choices=["warm", "exec"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.launches)))
        return
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    per = {"warm": [], "exec": []}
    print(f"command: {' '.join(sys.argv)}  (load average {os.getloadavg()[0]:.2f} at start)")
    for r in range(args.rounds):
        for mode in ("warm", "exec"):  # interleaved: the machine's drift falls on both
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--launches",
                                  str(args.launches)], env=env, capture_output=True, text=True,
                                 check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            per[mode].append(res)
            print(f"round {r + 1} {mode:4s}: {res['cpu_s']:.1f} CPU-s, {res['wall_s']:.1f} s wall "
                  f"for {args.launches} launches")
    for mode, rs in per.items():
        cpu = statistics.median(x["cpu_s"] for x in rs) / args.launches
        wall = statistics.median(x["wall_s"] for x in rs) / args.launches
        print(f"{mode:4s}: median {cpu:.2f} CPU-s and {wall:.2f} s wall per launch")
    w, e = (statistics.median(x["cpu_s"] for x in per[m]) for m in ("warm", "exec"))
    print(f"exec / warm CPU: {e / w:.2f}x (load average {os.getloadavg()[0]:.2f} at the end)")


if __name__ == "__main__":
    main()
