"""``llama-bench <name>``: benchmarks that print their figures and the command that made them."""

from __future__ import annotations

import importlib
import sys

from llama_train.bounds import Range

# Ranges shared by the benches' numeric options (each bench lists its own, checked at parse)
COUNT = Range(1, integer=True, fix="at least one")  # rounds, steps, sizes
COUNT0 = Range(0, integer=True)  # warmup rounds and steps
TIMEOUT_S = Range(0, 7 * 24 * 3600, lo_open=True, fix="seconds per run (at most a week)")
THREADS = Range(1, 4096, integer=True, optional=True, fix="CPU threads")

BENCHES = {
    "allreduce": "llama_train.bench.allreduce",
    "data": "llama_train.bench.data",
    "train": "llama_train.bench.train",
    "memory": "llama_train.bench.memory",
    "startup": "llama_train.bench.startup",
    "docmask": "llama_train.bench.docmask",
    "checkpoint": "llama_train.bench.checkpoint",
}


def emit(report: dict, json_arg, format_table) -> None:
    """Print a benchmark's report: JSON on stdout for ``--json -``, else the table (and the JSON
    file when ``--json PATH``)."""
    import json
    from pathlib import Path

    if json_arg == "-":
        print(json.dumps(report, indent=1))
        return
    print(format_table(report))
    if json_arg:
        Path(json_arg).write_text(json.dumps(report, indent=1))
        print(f"wrote {json_arg}")


def report_or_exit(name: str, make_report, args, format_table) -> None:
    """Run a benchmark and print its report; a failure it can explain exits 1 with its message."""
    try:
        report = make_report(args)
    except RuntimeError as e:
        print(f"llama-bench {name}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    emit(report, args.json, format_table)


def check_options(name: str, args, ranges) -> None:
    """Refuse (SystemExit, naming the option) a numeric option outside its range: ``ranges``
    maps each option's dest to a :class:`llama_train.bounds.Range`."""
    from llama_train.bounds import check_options as first_out_of_range

    msg = first_out_of_range(args, ranges)
    if msg is not None:
        raise SystemExit(f"llama-bench {name}: {msg}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        print(f"usage: llama-bench {{{','.join(BENCHES)}}} [options]  (--help on each)",
              file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(BENCHES[argv[0]])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
