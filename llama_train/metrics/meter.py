"""Peak memory and wall time per phase of one process: what ``llama-bench memory`` and a
simulated rank (``comm.simulate_ranks``) report, measured the same way so that both compare
with the planner (:func:`llama_train.scaling.memory.rank_peak_memory`).

* CPU: the kernel's high-water mark of the resident set, ``VmHWM`` in ``/proc/self/status``,
  reset to the current ``VmRSS`` at the start of each phase (``echo 5 > /proc/self/clear_refs``),
  so each phase's peak is its own. A phase's peak above idle = its VmHWM - the idle VmRSS (read
  once, before anything of the model exists).
* CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, reset per phase, minus
  ``memory_allocated`` / ``memory_reserved`` at the idle point.
"""

from __future__ import annotations

import gc
import os
import re
import time
from typing import Any, Dict


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        m = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M)
    return int(m.group(1)) if m else 0


def rss() -> int:
    """Resident set now, bytes."""
    return _status_kib("VmRSS") * 1024


def hwm() -> int:
    """Resident-set high-water mark since the last :func:`reset_hwm`, bytes."""
    return _status_kib("VmHWM") * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0). False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def process_age_s() -> float:
    """Seconds since this process started (from /proc: the kernel's start time, so it counts
    the interpreter's start and every import before our code ran)."""
    with open("/proc/self/stat") as fh:
        start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class PeakMeter:
    """Per-phase peaks above the idle baseline (see the module docstring), and wall times.
    A phase measured again (each micro-batch's forward) keeps its highest peak and adds up its
    seconds."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        gc.collect()
        self.idle = {"rss": rss(), "hwm_since_start": hwm()}
        if self.cuda:
            self.idle.update(allocated=torch.cuda.memory_allocated(),
                             reserved=torch.cuda.memory_reserved())
        self.phases: Dict[str, Dict[str, Any]] = {}
        self.hwm_reset = True
        self._t0 = 0.0

    def start(self) -> None:
        self.hwm_reset = reset_hwm() and self.hwm_reset
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()

    def stop(self, phase: str) -> Dict[str, Any]:
        if self.cuda:
            self.torch.cuda.synchronize()
        seconds = time.perf_counter() - self._t0
        row: Dict[str, Any] = {"hwm": hwm(), "rss_after": rss(), "seconds": seconds}
        row["peak_above_idle"] = row["hwm"] - self.idle["rss"]
        if self.cuda:
            c = self.torch.cuda
            row.update(max_allocated=c.max_memory_allocated(), max_reserved=c.max_memory_reserved(),
                       max_allocated_above_idle=c.max_memory_allocated() - self.idle["allocated"],
                       max_reserved_above_idle=c.max_memory_reserved() - self.idle["reserved"])
        before = self.phases.get(phase)
        if before is not None:  # the same phase again: its highest peak, its summed time
            row = {k: (before[k] + v if k == "seconds" else max(before[k], v))
                   for k, v in row.items()}
            row["count"] = before.get("count", 1) + 1
        self.phases[phase] = row
        return row

    @property
    def key(self) -> str:
        """The figure a phase's peak is read from."""
        return "max_allocated_above_idle" if self.cuda else "peak_above_idle"

    def report(self) -> Dict[str, Any]:
        worst = max(self.phases, key=lambda k: self.phases[k][self.key])
        return {"idle": self.idle, "phases": self.phases, "peak_above_idle":
                self.phases[worst][self.key], "peak_phase": worst, "hwm_reset": self.hwm_reset,
                "measure": ("torch.cuda.max_memory_allocated" if self.cuda else
                            "VmHWM - idle VmRSS")}
