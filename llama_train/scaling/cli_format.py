"""The tables and SI formatting of ``llama-plan``'s output (:mod:`llama_train.scaling.cli`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence


def _si(x: float, unit: str = "") -> str:
    """1.234e10 -> '12.3B' (counts) ."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def _gib(x: float) -> str:
    if x >= 2**30:
        return f"{x / 2**30:,.2f} GiB"
    if x >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    return f"{x / 2**10:.1f} KiB" if x else "0"


def _table(rows: Sequence[Sequence[Any]], header: Optional[Sequence[str]] = None) -> str:
    rows = [[str(c) for c in r] for r in rows]
    if header:
        rows = [list(header)] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if header and k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
