"""The range of a numeric setting, checked before any work starts. One definition,
:class:`Range`, serves config keys (each config dataclass checks its fields' ranges in
``__post_init__``: :meth:`Range.message`) and command-line options (:func:`check_options` after
``parse_args``), so every refusal reads the same way: the key or option, the value, the range
and what the value means (``trainer.max_steps=-3 must be in [1, 2**31 - 1]: ...``).

Plain Python (no torch): configs and ``--help`` never wait for it. An upper bound is where a
value stops meaning anything but a job that fails hours later or never ends; each says why
where it is set (docs/reliability.md, "Bounds checked before work starts").
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# numpy's legacy seeds and SentencePiece's random_seed are unsigned 32-bit (torch takes 64)
SEED_MAX = 2**32 - 1


def _show(x: float) -> str:
    """A bound as a person reads it: ``2**40``, ``2**31 - 1``, ``65536``, ``1e+30``."""
    if not isinstance(x, int):
        return f"{x:g}"
    if x >= 2**20 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    if x >= 2**20 and x & (x + 1) == 0:
        return f"2**{x.bit_length()} - 1"
    return str(x)


@dataclass(frozen=True)
class Range:
    """``lo <= value <= hi`` (``<`` where open; None: unbounded), optionally integers only, or
    None where ``optional``. ``fix`` is what the value means or how to choose one."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False
    fix: str = ""

    def text(self) -> str:
        """``>= 1``, ``in (0, 1]``, ``<= 100`` (``finite`` where unbounded)."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            return (f"in {'(' if self.lo_open else '['}{_show(lo)}, {_show(hi)}"
                    f"{')' if self.hi_open else ']'}")
        if lo is not None:
            return f"{'>' if self.lo_open else '>='} {_show(lo)}"
        if hi is not None:
            return f"{'<' if self.hi_open else '<='} {_show(hi)}"
        return "finite"

    def problem(self, value: Any, unset: str = "null") -> Optional[str]:
        """Why ``value`` is out of this range (``must be >= 1``), or None when it is in it;
        ``unset`` names the value that leaves an optional setting out."""
        kind = "an integer" if self.integer else "a number"
        if value is None:
            return None if self.optional else f"must be {kind} {self.text()}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be {kind} {self.text()}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"is not a finite number: give {kind} {self.text()}"
        if self.integer and not float(value).is_integer():
            return f"must be {kind} {self.text()}"
        lo, hi = self.lo, self.hi
        if ((lo is not None and (value <= lo if self.lo_open else value < lo))
                or (hi is not None and (value >= hi if self.hi_open else value > hi))):
            return f"must be {self.text()}" + (f" or {unset}" if self.optional and unset else "")
        return None

    def message(self, name: str, value: Any, unset: str = "null") -> Optional[str]:
        """``<name>=<value> must be ...: <fix>.`` or None."""
        why = self.problem(value, unset)
        if why is None:
            return None
        return f"{name}={value} {why}" + (f": {self.fix}" if self.fix else "") + "."


def check_options(args: argparse.Namespace, ranges: Mapping[str, Range]) -> Optional[str]:
    """The first option of ``ranges`` (``dest`` -> Range) whose value in ``args`` is out of
    range, as ``--top-p=2.0 must be in (0, 1]...``; None when all are in range. Each command
    reports it its own way (``parser.error``: exit 2)."""
    for dest, rng in ranges.items():
        if not hasattr(args, dest):
            continue
        msg = rng.message(f"--{dest.replace('_', '-')}", getattr(args, dest), unset="")
        if msg is not None:
            return msg
    return None


__all__ = ["INT32_MAX", "INT64_MAX", "SEED_MAX", "SIMULATE_MAX_RANKS", "Range", "check_options"]


# The most ranks comm.simulate_ranks may simulate (checked with the config, before anything
# starts). This process answers every collective for all N ranks, and what torch does around a
# collective is per rank: all_gather_object unpickles N objects (the checkpoint's agreement
# check), so a save's time grows with N. At 1,000,000 ranks a tiny model's save took 57 s, and a
# SIGTERM'd run saves twice (the save under way, then the stop's), so SIGTERM seemed ignored;
# at 65,536 it takes 3-7 s and a SIGTERM during a save ends the run within seconds, as a real
# rank's does. No data-parallel job trained to date has more ranks (Llama 3: 16,384 GPUs).
SIMULATE_MAX_RANKS = 2**16
