"""Approach 2 of Hoffmann et al. 2022 (Sec. 3.2) on our own runs: a parabola of the final loss
in ln N per IsoFLOP budget, its minimum N_opt (or why the budget is refused), the power laws
N_opt, D_opt ∝ C^a, C^b through the minima, and their bootstrap."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from llama_train.scaling.bootstrap import BootstrapResult, percentiles, resample
from llama_train.scaling.laws import ScalingError
from llama_train.scaling.runs import RunPoint, group_budgets


# A budget with one of these is not used for the power laws: its minimum is not a measurement.
REFUSALS = {
    "too_few_runs": "fewer than 3 runs",
    "too_few_sizes": "fewer than 3 distinct sizes",
    "opens_downward": "parabola opens downward: no minimum",
    "min_below_range": "minimum below the smallest sampled N",
    "min_above_range": "minimum above the largest sampled N",
}
# Kept, but worth a look: the minimum is bracketed by one point only.
# llama-plan fit's default --window: each parabola over the runs within 2 sizes of its budget's best
# run (at most 5 sizes). Far from its minimum an IsoFLOP curve is not a parabola in ln N (the
# largest size of a small budget trains for ~100 steps), and a sweep's over-trained points lie there.
DEFAULT_WINDOW = 2
WARNINGS = {"best_run_at_edge": "lowest loss at the smallest or largest sampled N"}
FLAG_TEXT = {**REFUSALS, **WARNINGS}


def _quadratic(x: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Least-squares (c0, c1, c2) of l = c0 + c1 x + c2 x^2."""
    v = np.stack([np.ones_like(x), x, x * x], axis=1)
    return np.linalg.lstsq(v, l, rcond=None)[0]


def _near_best(x: np.ndarray, l: np.ndarray, window: int) -> np.ndarray:
    """Mask of the runs whose size is among the ``window`` sizes either side of the best run's
    (and the best run's own): the part of an IsoFLOP curve a parabola in ln N describes."""
    sizes = np.unique(x)
    i = int(np.searchsorted(sizes, x[int(np.argmin(l))]))
    return np.isin(x, sizes[max(0, i - window):i + window + 1])


def _parabola_min(x: np.ndarray, l: np.ndarray, min_runs: int = 3, x_range: Optional[Tuple[float, float]] = None,
                  window: Optional[int] = None):
    """(x0, coeffs in x - x0, x at the minimum or None, refusal or None); x = ln N.

    Shared by the fit and every bootstrap refit so both refuse the same cases. ``x_range`` is the
    range the minimum must lie in (default: x's own); a bootstrap refit passes the budget's full
    sampled range, since a resample that happens to miss an edge run has not sampled less. With
    ``window`` only the runs within that many sizes of the best run are fitted, and the minimum
    must lie within their range.
    """
    if window is not None and x.size:
        keep = _near_best(x, l, window)
        x, l = x[keep], l[keep]
        x_range = (float(x.min()), float(x.max()))
    if x.size < min_runs:
        return None, None, None, "too_few_runs"
    if np.unique(x).size < 3:
        return None, None, None, "too_few_sizes"
    x0 = float(x.mean())
    c = _quadratic(x - x0, l)
    if not c[2] > 0:
        return x0, c, None, "opens_downward"
    xm = x0 - c[1] / (2.0 * c[2])
    lo, hi = (float(x.min()), float(x.max())) if x_range is None else x_range
    if xm < lo:
        return x0, c, xm, "min_below_range"
    if xm > hi:
        return x0, c, xm, "min_above_range"
    return x0, c, xm, None


@dataclass
class IsoFlopParabola:
    """One budget's fit L = c0 + c1 u + c2 u^2, u = ln N - x0, and whether its minimum is usable."""

    flops: float
    n_runs: int
    n_min: float
    n_max: float
    x0: Optional[float]
    coeffs: Optional[Tuple[float, float, float]]
    n_opt: Optional[float]  # where the parabola's minimum lies (also when refused for lying outside)
    d_opt: Optional[float]  # C / (6 N_opt)
    loss_at_min: Optional[float]
    best_run: str
    best_n_params: float
    best_val_loss: float
    flags: List[str]
    n_opt_ci: Optional[Tuple[float, float]] = None  # bootstrap 95% interval, when bootstrapped

    @property
    def used(self) -> bool:
        return not any(f in REFUSALS for f in self.flags)

    def loss(self, n: Any) -> Any:
        if self.coeffs is None:
            raise ScalingError(f"budget {self.flops:.3g}: no parabola ({', '.join(self.flags)})")
        u = np.log(np.asarray(n, dtype=float)) - self.x0
        c0, c1, c2 = self.coeffs
        return c0 + c1 * u + c2 * u * u

    def to_dict(self) -> Dict[str, Any]:
        return {"flops": self.flops, "runs": self.n_runs, "n_min": self.n_min, "n_max": self.n_max,
                "n_opt": self.n_opt, "n_opt_ci": self.n_opt_ci, "d_opt": self.d_opt,
                "loss_at_min": self.loss_at_min, "used": self.used, "flags": list(self.flags),
                "flag_text": [FLAG_TEXT[f] for f in self.flags],
                "parabola_ln_n": None if self.coeffs is None else {"x0": self.x0, "c0": self.coeffs[0],
                                                                     "c1": self.coeffs[1], "c2": self.coeffs[2]}}


def fit_isoflop_parabola(flops: float, members: Sequence[RunPoint], min_runs: int = 3,
                         window: Optional[int] = None) -> IsoFlopParabola:
    """Least-squares parabola of val_loss against ln N over one IsoFLOP group (or, with
    ``window``, over the runs within that many sizes of its best run); flags refusals."""
    x = np.log([r.n_params for r in members])
    l = np.array([r.val_loss for r in members], dtype=float)
    x0, c, xm, why = _parabola_min(x, l, min_runs, window=window)
    flags = [why] if why else []
    best = min(members, key=lambda r: r.val_loss)
    n_sizes = [r.n_params for r in members]
    if not why and best.n_params in (min(n_sizes), max(n_sizes)):
        flags.append("best_run_at_edge")
    n_opt = d_opt = l_min = None
    if xm is not None:
        n_opt = float(math.exp(xm))
        d_opt = float(flops / (6.0 * n_opt))
        l_min = float(c[0] - c[1] ** 2 / (4.0 * c[2]))
    return IsoFlopParabola(flops=float(flops), n_runs=len(members), n_min=float(min(n_sizes)), n_max=float(max(n_sizes)),
                           x0=x0, coeffs=None if c is None else tuple(float(v) for v in c), n_opt=n_opt, d_opt=d_opt,
                           loss_at_min=l_min, best_run=best.run, best_n_params=best.n_params,
                           best_val_loss=best.val_loss, flags=flags)


@dataclass
class PowerLaw:
    """y = k C^exponent, least squares on ln y against ln C."""

    k: float
    exponent: float

    def __call__(self, c: Any) -> Any:
        return self.k * np.asarray(c, dtype=float) ** self.exponent


def _line(x: np.ndarray, y: np.ndarray) -> Tuple[float, float]:
    """(slope, intercept) by least squares."""
    slope, icpt = np.linalg.lstsq(np.stack([x, np.ones_like(x)], axis=1), y, rcond=None)[0]
    return float(slope), float(icpt)


def fit_power_law(c: Iterable[float], y: Iterable[float]) -> PowerLaw:
    slope, icpt = _line(np.log(np.asarray(list(c), dtype=float)), np.log(np.asarray(list(y), dtype=float)))
    return PowerLaw(k=math.exp(icpt), exponent=slope)


@dataclass
class Approach2Result:
    parabolas: List[IsoFlopParabola]
    n_opt_law: Optional[PowerLaw]  # N_opt = k_N C^a
    d_opt_law: Optional[PowerLaw]  # D_opt = k_D C^b (D_opt = C / 6 N_opt, so b = 1 - a)
    bootstrap: Optional[BootstrapResult] = None
    error: Optional[str] = None  # why there are no power laws (fewer than 2 usable budgets)

    @property
    def used(self) -> List[IsoFlopParabola]:
        return [p for p in self.parabolas if p.used]

    def to_dict(self) -> Dict[str, Any]:
        ci = self.bootstrap.ci if self.bootstrap else {}
        out: Dict[str, Any] = {"budgets_used": len(self.used), "budgets": len(self.parabolas), "error": self.error}
        if self.n_opt_law:
            out.update({"a": self.n_opt_law.exponent, "a_ci": ci.get("a"), "k_N": self.n_opt_law.k,
                        "b": self.d_opt_law.exponent, "b_ci": ci.get("b"), "k_D": self.d_opt_law.k})
        out["bootstrap"] = self.bootstrap.to_dict() if self.bootstrap else None
        return out


def fit_approach2(runs: Sequence[RunPoint], *, groups: Optional[List[Tuple[float, List[RunPoint]]]] = None,
                  bootstrap: int = 0, seed: int = 0, min_runs: int = 3, window: Optional[int] = None) -> Approach2Result:
    """Hoffmann et al.'s Approach 2: a parabola in ln N per budget, then N_opt, D_opt ∝ C^a, C^b.

    Budgets whose parabola is refused (see REFUSALS) are reported, not used. With ``bootstrap``
    > 0 the runs of every used budget are resampled with replacement (each budget keeps its
    size) and everything refitted; a resample in which any used budget gets refused counts as
    failed and is left out of the intervals. ``window``: fit each parabola to the runs within
    that many sizes of the budget's best run (None: all), in the fit and in every resample.
    """
    groups = group_budgets(runs) if groups is None else groups
    parabolas = [fit_isoflop_parabola(c, members, min_runs, window) for c, members in groups]
    used = [p for p in parabolas if p.used]
    if len(used) < 2:
        why = "; ".join(f"{p.flops:.3g}: {', '.join(FLAG_TEXT[f] for f in p.flags)}" for p in parabolas if not p.used)
        return Approach2Result(parabolas, None, None, error=(
            f"{len(used)} usable IsoFLOP budget(s) of {len(parabolas)}; the power laws need 2+ (3+ to mean much)"
            + (f"; refused: {why}" if why else "")))
    c = np.array([p.flops for p in used])
    res = Approach2Result(parabolas, fit_power_law(c, [p.n_opt for p in used]),
                          fit_power_law(c, [p.d_opt for p in used]))
    if bootstrap > 0:
        data = [(np.log([r.n_params for r in members]), np.array([r.val_loss for r in members], dtype=float))
                for p, (_, members) in zip(parabolas, groups) if p.used]
        res.bootstrap = _bootstrap_approach2(data, used, bootstrap, seed, min_runs, window)
    return res


def _bootstrap_approach2(data, used: List[IsoFlopParabola], n: int, seed: int, min_runs: int,
                         window: Optional[int] = None) -> BootstrapResult:
    rng = np.random.default_rng([seed, 2])
    log_c = np.log([p.flops for p in used])
    log_c6 = log_c - math.log(6.0)
    rows: List[Tuple[float, float, float, float]] = []
    per_budget: List[List[float]] = [[] for _ in used]
    failures: Dict[str, int] = {}
    for _ in range(n):
        x_opt = np.empty(len(used))
        why_this = set()
        for j, (x, l) in enumerate(data):
            idx = resample(rng, x.size)
            _, _, xm, why = _parabola_min(x[idx], l[idx], min_runs, (float(x.min()), float(x.max())), window)
            if why:
                why_this.add(why)
            else:
                x_opt[j] = xm
                per_budget[j].append(math.exp(xm))
        if why_this:
            for w in why_this:
                failures[w] = failures.get(w, 0) + 1
            continue
        a, log_kn = _line(log_c, x_opt)
        b, log_kd = _line(log_c, log_c6 - x_opt)
        rows.append((a, log_kn, b, log_kd))
    arr = np.array(rows).reshape(-1, 4)
    samples = {"a": arr[:, 0], "log_k_N": arr[:, 1], "b": arr[:, 2], "log_k_D": arr[:, 3]}
    ci = {k: v for k, v in (("a", percentiles(arr[:, 0])), ("b", percentiles(arr[:, 2])),
                            ("k_N", percentiles(np.exp(arr[:, 1]))), ("k_D", percentiles(np.exp(arr[:, 3]))))
          if v is not None}
    for p, vals in zip(used, per_budget):
        p.n_opt_ci = percentiles(vals)
    return BootstrapResult(n_resamples=n, n_failed=n - len(rows), seed=seed, ci=ci, failures=failures, samples=samples)
