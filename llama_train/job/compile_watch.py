"""trainer.compile's log lines (:class:`CompileWatch`, a hook on rank 0)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Dict, Optional

from llama_train.hooks import Hook

log = logging.getLogger("llama_train")


class CompileWatch(Hook):
    """trainer.compile's two log lines (rank 0): how long compiling took, and each recompile.

    The time is what dynamo's compile callbacks enclose (``torch._dynamo.callback``): tracing,
    AOT autograd and inductor's code generation (or the load from its cache,
    TORCHINDUCTOR_CACHE_DIR), for every graph of the first step this process runs, forward and
    the backward compiled lazily at the first backward. It is not the step's whole extra time:
    first-touch allocations and the first run of the new kernels are outside it. A compile after
    that step is a recompile (a guard failed: a new shape, dtype or grad mode; an evaluation's
    no_grad is one); each step that had some gets one line with the first guard failure
    dynamo recorded (``torch._dynamo.utils.guard_failures``; TORCH_LOGS=recompiles lists all).
    """

    def __init__(self) -> None:
        self.graphs = self.recompiles = 0  # since the last line
        self.seconds = 0.0
        self.first = True
        self._t0: Optional[float] = None
        try:
            from torch._dynamo.callback import callback_handler
            from torch._dynamo.utils import guard_failures
        except ImportError:  # a torch without these: compile runs, unmeasured
            log.warning("torch.compile: this torch has no torch._dynamo.callback; compile time "
                        "and recompiles are not logged")
            self._handler = None
            return
        self._handler, self._failures = callback_handler, guard_failures
        self._seen = self._failure_counts()
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _failure_counts(self) -> Dict[Any, int]:
        return {code: len(reasons) for code, reasons in list(self._failures.items())}

    def _start(self, args: Any) -> None:
        self._t0 = time.perf_counter()
        self.graphs += 1
        # compile id "frame/n": n > 0 is the frame's n-th recompile (a guard of the earlier failed)
        frame_compile = str(args.compile_id).split("/")[-1].split("_")[0]
        dynamo = getattr(args.callback_trigger, "name", "") == "DYNAMO"
        if dynamo and frame_compile not in ("0", ""):
            self.recompiles += 1

    def _end(self, args: Any) -> None:
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def _new_failure(self) -> Optional[str]:
        counts, first = self._failure_counts(), None
        for code, n in counts.items():
            if n > self._seen.get(code, 0) and first is None:
                reason = str(self._failures[code][self._seen.get(code, 0)]).splitlines()[0]
                first = f"{getattr(code, 'co_name', code)}: {reason.strip()}"
        self._seen = counts
        return first

    def on_step_end(self, step: int, metrics: Dict[str, Any]) -> None:
        if self._handler is None or (not self.graphs and not self.first):
            return
        why = self._new_failure()
        if self.first and not self.graphs:  # an earlier run in this process compiled the same code
            log.info("torch.compile: nothing compiled during step %d: dynamo reused the graphs "
                     "this process compiled before", step)
        elif self.first:
            log.info("torch.compile: %.1f s compiling %d graphs (forward and backward%s) during "
                     "step %d, this process's first: dynamo, AOT autograd and inductor or its "
                     "cache, not the step's other first-time costs", self.seconds, self.graphs,
                     f"; {self.recompiles} recompiles within the step, the first for {why}"
                     if self.recompiles else "", step)
        else:  # a recompile, or a frame first met now (an evaluation's): either way, compiled
            log.info("torch.compile recompiled during step %d: %d graph(s), %d of them "
                     "recompiles, %.1f s; first guard failure: %s (TORCH_LOGS=recompiles lists "
                     "all)", step, self.graphs, self.recompiles, self.seconds,
                     why or "none recorded")
        self.first, self.graphs, self.recompiles, self.seconds = False, 0, 0, 0.0

    def close(self) -> None:
        if self._handler is not None:
            for remove, fn in ((self._handler.remove_start_callback, self._start),
                               (self._handler.remove_end_callback, self._end)):
                with contextlib.suppress(ValueError):
                    remove(fn)
            self._handler = None
