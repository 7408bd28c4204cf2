"""What the bootstraps of both approaches share: resampling the runs within each budget, and
percentile intervals over the refits (:class:`BootstrapResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np


@dataclass
class BootstrapResult:
    """Percentile intervals from refits on runs resampled with replacement within each budget."""

    n_resamples: int
    n_failed: int  # refits that gave no answer (reasons in ``failures``); not in the intervals
    seed: int
    ci: Dict[str, Tuple[float, float]]  # 2.5 and 97.5 percentiles; empty if < MIN_OK refits succeeded
    failures: Dict[str, int]
    samples: Dict[str, np.ndarray]  # one value per successful refit (for bands); not in to_dict
    level: float = 0.95

    def to_dict(self) -> Dict[str, Any]:
        return {"resamples": self.n_resamples, "failed": self.n_failed, "ok": self.n_resamples - self.n_failed,
                "seed": self.seed, "level": self.level, "ci": {k: list(v) for k, v in self.ci.items()},
                "failures": dict(self.failures), "over_10pct_failed": self.n_failed > 0.1 * self.n_resamples}


BOOTSTRAP_MIN_OK = 10  # fewer successful refits than this: no interval, rather than a made-up one


def percentiles(values: Sequence[float], level: float = 0.95) -> Optional[Tuple[float, float]]:
    """The central ``level`` interval of the refits' values; None below BOOTSTRAP_MIN_OK of them."""
    if len(values) < BOOTSTRAP_MIN_OK:
        return None
    lo, hi = np.percentile(np.asarray(values, dtype=float), [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def resample(rng: np.random.Generator, size: int) -> np.ndarray:
    """Indices of ``size`` runs drawn with replacement (one budget's runs, one refit)."""
    return rng.integers(0, size, size)
