"""Approach 3 of Hoffmann et al. 2022 (App. D.2) on our own runs: L(N, D) = E + A/N^alpha +
B/D^beta fitted with a Huber loss on log loss by L-BFGS from a grid of starts, and its bootstrap
(refits on runs resampled within each budget)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from llama_train.scaling.bootstrap import BootstrapResult, percentiles, resample
from llama_train.scaling.laws import LossLaw, ScalingError
from llama_train.scaling.runs import RunPoint, group_budgets


def paper_init_grid() -> np.ndarray:
    """Hoffmann et al. App. D.2's initialisations: (a, b, e, alpha, beta), 6*6*5*5*5 = 4500 rows."""
    a = np.arange(0.0, 25.1, 5.0)
    b = np.arange(0.0, 25.1, 5.0)
    e = np.arange(-1.0, 1.01, 0.5)
    al = np.arange(0.0, 2.01, 0.5)
    be = np.arange(0.0, 2.01, 0.5)
    mesh = np.meshgrid(a, b, e, al, be, indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1)


def _lse_parts(theta, log_n, log_d):
    """LSE(a - alpha log N, b - beta log D, e) and its softmax weights, shift-stabilised.

    theta is (5,) or (k, 5); returns arrays of shape (n,) or (k, n).
    """
    theta = np.asarray(theta, dtype=float)
    a, b, e, al, be = (theta[..., i, None] for i in range(5))
    t1 = a - al * log_n
    t2 = b - be * log_d
    t3 = e + 0.0 * t1
    m = np.maximum(np.maximum(t1, t2), t3)
    x1, x2, x3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(t3 - m)
    s = x1 + x2 + x3
    return m + np.log(s), x1 / s, x2 / s, x3 / s


def _huber_over_delta(r: np.ndarray, delta: float) -> np.ndarray:
    """Huber_delta(r) / delta: same minimiser, O(1) scale so L-BFGS's tolerances bite.

    Besiroglu et al. 2024 point to the original fit stopping early; with delta=1e-3 (and averaged
    terms) the objective is so small that L-BFGS's tolerances end the search too soon. Summing
    and dividing by delta keeps it O(1) per run.
    """
    ar = np.abs(r)
    return np.where(ar <= delta, 0.5 * r * r / delta, ar - 0.5 * delta)


def _objective_batch(thetas: np.ndarray, log_n, log_d, log_l, delta) -> np.ndarray:
    lse = _lse_parts(thetas, log_n, log_d)[0]
    return _huber_over_delta(lse - log_l, delta).sum(axis=-1)


def _objective_and_grad(theta: np.ndarray, log_n, log_d, log_l, delta) -> Tuple[float, np.ndarray]:
    lse, w1, w2, w3 = _lse_parts(theta, log_n, log_d)
    r = lse - log_l
    dh = np.clip(r / delta, -1.0, 1.0)  # d (huber/delta) / d r
    g1, g2 = dh * w1, dh * w2
    grad = np.array([g1.sum(), g2.sum(), (dh * w3).sum(), -(g1 @ log_n), -(g2 @ log_d)])
    return float(_huber_over_delta(r, delta).sum()), grad


@dataclass
class FitResult:
    law: LossLaw
    objective: float  # sum of Huber_delta / delta over runs, at the optimum
    n_points: int
    n_starts: int
    rms_log_residual: float
    converged: bool
    delta: float

    def to_dict(self) -> Dict[str, Any]:
        return {
            "fit": self.law.to_dict(),
            "compute_optimal_exponents": {"a": self.law.a, "b": self.law.b, "G": self.law.G},
            "objective": self.objective,
            "n_points": self.n_points,
            "n_starts": self.n_starts,
            "rms_log_residual": self.rms_log_residual,
            "converged": self.converged,
            "huber_delta": self.delta,
        }


def fit_loss_law(
    n_params: Iterable[float],
    n_tokens: Iterable[float],
    losses: Iterable[float],
    *,
    delta: float = 1e-3,
    top_k: Optional[int] = 100,
    init_grid: Optional[np.ndarray] = None,
    name: str = "fitted",
) -> FitResult:
    """Fit E, A, B, alpha, beta the way Hoffmann et al. do (App. D.2).

    Minimises sum_i Huber_delta(LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i) with
    L-BFGS from a grid of initialisations and keeps the best; A, B, E = exp(a), exp(b), exp(e).
    To stay fast we evaluate the objective at all 4500 grid points at once and run L-BFGS from
    the ``top_k`` best (``top_k=None`` runs it from every grid point, as in the paper).
    """
    from scipy.optimize import minimize

    n = np.asarray(list(n_params), dtype=float)
    d = np.asarray(list(n_tokens), dtype=float)
    l = np.asarray(list(losses), dtype=float)
    if not (n.shape == d.shape == l.shape) or n.ndim != 1:
        raise ScalingError(f"fit: n_params, n_tokens, losses must be equal-length 1-D ({n.shape}, {d.shape}, {l.shape})")
    if n.size < 5:
        raise ScalingError(f"fit: {n.size} runs cannot determine 5 constants; collect at least 5 (ideally 20+ over 3+ budgets)")
    for label, arr in (("n_params", n), ("n_tokens", d), ("losses", l)):
        if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            raise ScalingError(f"fit: every {label} value must be finite and > 0")
    if delta <= 0:
        raise ScalingError(f"fit: huber delta={delta} must be > 0")
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(l)

    grid = paper_init_grid() if init_grid is None else np.asarray(init_grid, dtype=float)
    if top_k is not None and top_k < len(grid):
        scores = np.concatenate(
            [_objective_batch(chunk, log_n, log_d, log_l, delta) for chunk in np.array_split(grid, max(1, len(grid) // 500))]
        )
        grid = grid[np.argsort(scores, kind="stable")[:top_k]]

    best = None
    for theta0 in grid:
        res = minimize(
            _objective_and_grad, theta0, args=(log_n, log_d, log_l, delta), jac=True,
            method="L-BFGS-B", options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-9},
        )
        if best is None or res.fun < best.fun:
            best = res
    a, b, e, al, be = (float(v) for v in best.x)
    if al <= 0 or be <= 0:
        raise ScalingError(
            f"fit: the best fit has non-positive exponents (alpha={al:.3g}, beta={be:.3g}); the runs "
            f"do not vary N and D enough. Sweep several sizes per FLOP budget over 3+ budgets"
        )
    law = LossLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=al, beta=be, name=name,
                  source="fitted with Huber(delta=%g) on log loss, L-BFGS from a grid (Hoffmann et al. App. D.2)" % delta)
    resid = np.log(law.loss(n, d)) - log_l
    return FitResult(law=law, objective=float(best.fun), n_points=int(n.size), n_starts=int(len(grid)),
                     rms_log_residual=float(np.sqrt(np.mean(resid**2))), converged=bool(best.success), delta=delta)



@dataclass
class NoiseAndMisfit:
    """How far the law misses the runs against how far a seed moves one: the classical split of
    the residuals into pure error (runs that repeat a budget, N and D with another seed) and lack
    of fit (the rest). When the law misses by much more than seeds differ, more seeds narrow its
    intervals little: its form or the sweep's edges limit them."""

    seed_sd: Optional[float]  # one run's sd in log loss, pooled over the repeated points; None without any
    repeated_points: int  # (budget, N, D) points run with 2+ seeds
    dof: int  # sum over them of (runs - 1)
    rms_residual: float  # the law's rms log residual over all runs
    budget_residual: List[Tuple[float, float]]  # (budget, mean log residual of its runs)

    def to_dict(self) -> Dict[str, Any]:
        return {"seed_sd_log": self.seed_sd, "repeated_points": self.repeated_points, "seed_dof": self.dof,
                "rms_log_residual": self.rms_residual,
                "budget_mean_log_residual": [{"flops": c, "mean": m} for c, m in self.budget_residual]}


def noise_and_misfit(law: LossLaw, groups: Sequence[Tuple[float, Sequence[RunPoint]]]) -> NoiseAndMisfit:
    """The law's residuals (log of its loss over each run's) per budget, and the seeds' pure error."""
    ss, dof, points, resid, per_budget = 0.0, 0, 0, [], []
    for budget, members in groups:
        r = [math.log(law.loss(m.n_params, m.effective_tokens) / m.val_loss) for m in members]
        resid += r
        per_budget.append((float(budget), float(np.mean(r))))
        same: Dict[Tuple[float, float], List[float]] = {}
        for m in members:
            same.setdefault((m.n_params, m.tokens), []).append(math.log(m.val_loss))
        for logs in (v for v in same.values() if len(v) > 1):
            ss += float(np.sum((np.asarray(logs) - np.mean(logs)) ** 2))
            dof += len(logs) - 1
            points += 1
    return NoiseAndMisfit(seed_sd=math.sqrt(ss / dof) if dof else None, repeated_points=points, dof=dof,
                          rms_residual=float(np.sqrt(np.mean(np.square(resid)))), budget_residual=per_budget)


A3_KEYS = ("E", "A", "B", "alpha", "beta", "a", "b")


def bootstrap_approach3(runs: Sequence[RunPoint], fit: FitResult, *, n: int = 100, seed: int = 0, top_k: int = 10,
                        groups: Optional[List[Tuple[float, List[RunPoint]]]] = None) -> BootstrapResult:
    """Refit L(N, D) on runs resampled with replacement within each budget.

    Each refit runs L-BFGS from the ``top_k`` best of the paper's grid plus the full-data optimum
    (a resample's optimum is near it), so a few starts suffice. A refit that raises (e.g. a
    non-positive exponent) counts as failed.
    """
    groups = group_budgets(runs) if groups is None else groups
    law = fit.law
    grid = np.vstack([paper_init_grid(), [math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta]])
    data = [np.array([[r.n_params, r.effective_tokens, r.val_loss] for r in members], dtype=float)
            for _, members in groups]
    rng = np.random.default_rng([seed, 3])
    rows: List[List[float]] = []
    failures: Dict[str, int] = {}
    for _ in range(n):
        sample = np.concatenate([g[resample(rng, len(g))] for g in data])
        try:
            res = fit_loss_law(sample[:, 0], sample[:, 1], sample[:, 2], delta=fit.delta, top_k=top_k, init_grid=grid)
        except ScalingError as exc:
            key = "non-positive exponent" if "non-positive" in str(exc) else str(exc)[:80]
            failures[key] = failures.get(key, 0) + 1
            continue
        rows.append([getattr(res.law, k) for k in A3_KEYS])
    arr = np.array(rows).reshape(-1, len(A3_KEYS))
    samples = {k: arr[:, i] for i, k in enumerate(A3_KEYS)}
    ci = {k: v for k in A3_KEYS if (v := percentiles(samples[k])) is not None}
    return BootstrapResult(n_resamples=n, n_failed=n - len(rows), seed=seed, ci=ci, failures=failures, samples=samples)
