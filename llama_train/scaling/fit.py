"""Fitting our own sweeps: the Huber/LSE L-BFGS fitter of Hoffmann et al. App. D.2 (Approach 3),
IsoFLOP parabolas and their power laws (Approach 2), bootstrap intervals for both, and reading a
sweep directory or a CSV into (N, D, final validation loss) points."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from llama_train.scaling.laws import LossLaw, ScalingError


# ---------------------------------------------------------------------------------------------
# Fitting L(N, D) to our own runs (Hoffmann et al. App. D.2)
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Reading a sweep directory
# ---------------------------------------------------------------------------------------------

@dataclass
class RunPoint:
    run: str
    n_params: float
    tokens: float
    flops: float
    val_loss: float
    budget: Optional[float] = None  # nominal FLOP budget if the run recorded one
    # both counts when known (n_params is one of them), so a CSV can carry either convention
    total_params: Optional[float] = None
    non_embedding_params: Optional[float] = None
    command: str = ""  # how the run was launched (run_info.json "command"), for the CSV


def final_val_loss(metrics_path: Path) -> Optional[float]:
    """The ``val_loss`` of the last line of metrics.jsonl that has one (None if none)."""
    last = None
    with open(metrics_path) as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a half-written last line of a killed run must not sink the sweep
            if isinstance(rec, dict) and rec.get("val_loss") is not None:
                last = float(rec["val_loss"])
    return last


def _opt_float(v: Any) -> Optional[float]:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def collect_runs(sweep_dir: Union[str, Path], params: str = "total") -> Tuple[List[RunPoint], List[Dict[str, str]]]:
    """Every run under ``sweep_dir`` (any depth) that has ``metrics.jsonl`` + ``run_info.json``.

    ``run_info.json`` (written by the trainer): {"params": {"total", "non_embedding"},
    "tokens": total training tokens, "flops": training FLOPs, "model_args": {...}} and optionally
    "flop_budget" (the sweep's nominal budget, used to group IsoFLOP curves) and "command" (kept
    for the CSV). Returns (usable runs, skipped runs with the reason).
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ScalingError(f"sweep_dir {root} is not a directory; pass the folder holding the sweep's run dirs")
    _check_params(params)
    runs: List[RunPoint] = []
    skipped: List[Dict[str, str]] = []
    for metrics in sorted(root.rglob("metrics.jsonl")):
        run_dir = metrics.parent
        name = str(run_dir.relative_to(root)) or "."
        info_path = run_dir / "run_info.json"
        if not info_path.is_file():
            skipped.append({"run": name, "reason": "no run_info.json"})
            continue
        try:
            info = json.loads(info_path.read_text())
        except json.JSONDecodeError as exc:
            skipped.append({"run": name, "reason": f"run_info.json is not JSON ({exc})"})
            continue
        try:
            n = float(info["params"][params])
            tokens = float(info["tokens"])
        except (KeyError, TypeError, ValueError):
            skipped.append({"run": name, "reason": f"run_info.json lacks params.{params} or tokens"})
            continue
        loss = final_val_loss(metrics)
        if loss is None or not math.isfinite(loss):
            skipped.append({"run": name, "reason": "no finite val_loss in metrics.jsonl"})
            continue
        flops = float(info.get("flops") or 6.0 * n * tokens)
        budget = info.get("flop_budget")
        counts = info["params"] if isinstance(info["params"], dict) else {}
        runs.append(RunPoint(run=name, n_params=n, tokens=tokens, flops=flops, val_loss=loss,
                             budget=float(budget) if budget is not None else None,
                             total_params=_opt_float(counts.get("total")),
                             non_embedding_params=_opt_float(counts.get("non_embedding")),
                             command=str(info.get("command") or "")))
    return runs, skipped


def _grouping_key(runs: Sequence[RunPoint]):
    """What IsoFLOP groups are made on: every run's nominal budget, or (if one lacks it) FLOPs."""
    if runs and all(r.budget is not None for r in runs):
        return lambda r: r.budget
    return lambda r: r.flops


def group_budgets(runs: Sequence[RunPoint], rel_tol: float = 0.15) -> List[Tuple[float, List[RunPoint]]]:
    """IsoFLOP groups: runs whose ``flop_budget`` (or, if any run lacks one, FLOPs) agree within rel_tol."""
    key = _grouping_key(runs)
    out: List[Tuple[float, List[RunPoint]]] = []
    cur: List[RunPoint] = []

    def close() -> None:
        keys = [key(x) for x in cur]  # one nominal budget stays exact; mixed ones: their geometric mean
        c = keys[0] if len(set(keys)) == 1 else float(np.exp(np.mean(np.log(keys))))
        out.append((float(c), list(cur)))

    for r in sorted(runs, key=key):
        if cur and key(r) > key(cur[0]) * (1 + rel_tol):
            close()
            cur = []
        cur.append(r)
    if cur:
        close()
    return out


def load_runs(path: Union[str, Path], params: str = "total") -> Tuple[List[RunPoint], List[Dict[str, str]]]:
    """A sweep directory (:func:`collect_runs`) or a CSV file (:func:`load_runs_csv`)."""
    p = Path(path)
    if p.is_file():
        return load_runs_csv(p, params=params)
    if p.is_dir():
        return collect_runs(p, params=params)
    raise ScalingError(f"{p} is neither a sweep directory nor a CSV file")


# ---------------------------------------------------------------------------------------------
# CSV: one row per run
# ---------------------------------------------------------------------------------------------

CSV_COLUMNS = ("flops", "params", "non_embedding_params", "tokens", "val_loss", "command")
CSV_EXTRA_COLUMNS = ("run", "train_flops")  # written and read back, optional on input


def _num(x: Optional[float]) -> str:
    return "" if x is None else repr(float(x))  # repr round-trips a float exactly


def write_runs_csv(runs: Sequence[RunPoint], path: Union[str, Path], params: str = "total") -> Path:
    """Write runs as CSV_COLUMNS (+ run, train_flops).

    ``flops`` is the key :func:`group_budgets` groups on (the nominal budget when every run has
    one, else the measured FLOPs), so reading the file back groups, and therefore fits, identically;
    measured FLOPs go to ``train_flops``. ``params`` names the convention of ``n_params``, used only
    to fill a count a RunPoint does not carry separately.
    """
    _check_params(params)
    key = _grouping_key(runs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS + CSV_EXTRA_COLUMNS)
        for r in runs:
            total = r.total_params if r.total_params is not None else (r.n_params if params == "total" else None)
            non_emb = (r.non_embedding_params if r.non_embedding_params is not None
                       else (r.n_params if params == "non_embedding" else None))
            w.writerow([_num(key(r)), _num(total), _num(non_emb), _num(r.tokens),
                        _num(r.val_loss), r.command or "", r.run, _num(r.flops)])
    return path


def load_runs_csv(path: Union[str, Path], params: str = "total") -> Tuple[List[RunPoint], List[Dict[str, str]]]:
    """Runs from a CSV with columns flops, params, non_embedding_params, tokens, val_loss, command.

    ``flops`` is the nominal budget the runs are grouped on; ``params`` is the total count.
    Extra columns are ignored except ``run`` (a name) and ``train_flops`` (measured FLOPs).
    Rows with a missing, non-numeric or non-positive value are skipped with the reason, as
    :func:`collect_runs` skips incomplete runs.
    """
    path = Path(path)
    _check_params(params)
    if not path.is_file():
        raise ScalingError(f"{path} is not a file")
    col = "params" if params == "total" else "non_embedding_params"
    need = ("flops", col, "tokens", "val_loss")
    runs: List[RunPoint] = []
    skipped: List[Dict[str, str]] = []
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in need if c not in header]
        if missing:
            raise ScalingError(f"{path}: no column(s) {', '.join(missing)} in the header {header}; a runs CSV has "
                               f"{','.join(CSV_COLUMNS)} (extra columns allowed)")
        for lineno, cells in enumerate(reader, start=2):
            if not any(c.strip() for c in cells):
                continue
            row = {h: (cells[i].strip() if i < len(cells) else "") for i, h in enumerate(header)}
            name = row.get("run") or f"line{lineno}"
            vals = {k: _opt_float(row[k] or None) for k in need}
            bad = [k for k, v in vals.items() if v is None or not math.isfinite(v) or v <= 0]
            if bad:
                skipped.append({"run": name, "reason": f"line {lineno}: {', '.join(bad)} missing, not a number or <= 0"})
                continue
            train_flops = _opt_float(row.get("train_flops") or None)
            runs.append(RunPoint(run=name, n_params=vals[col], tokens=vals["tokens"],
                                 flops=train_flops if train_flops else vals["flops"], val_loss=vals["val_loss"],
                                 budget=vals["flops"], total_params=_opt_float(row.get("params") or None),
                                 non_embedding_params=_opt_float(row.get("non_embedding_params") or None),
                                 command=row.get("command", "")))
    return runs, skipped


def _check_params(params: str) -> None:
    if params not in ("total", "non_embedding"):
        raise ScalingError(f"params={params!r}: use 'total' (Chinchilla's convention) or 'non_embedding'")


# ---------------------------------------------------------------------------------------------
# Approach 2: IsoFLOP parabolas (Hoffmann et al. Sec. 3.2)
# ---------------------------------------------------------------------------------------------

# A budget with one of these is not used for the power laws: its minimum is not a measurement.
REFUSALS = {
    "too_few_runs": "fewer than 3 runs",
    "too_few_sizes": "fewer than 3 distinct sizes",
    "opens_downward": "parabola opens downward: no minimum",
    "min_below_range": "minimum below the smallest sampled N",
    "min_above_range": "minimum above the largest sampled N",
}
# Kept, but worth a look: the minimum is bracketed by one point only.
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


def _percentiles(values: Sequence[float], level: float = 0.95) -> Optional[Tuple[float, float]]:
    if len(values) < BOOTSTRAP_MIN_OK:
        return None
    lo, hi = np.percentile(np.asarray(values, dtype=float), [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def _resample(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.integers(0, size, size)


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
            idx = _resample(rng, x.size)
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
    ci = {k: v for k, v in (("a", _percentiles(arr[:, 0])), ("b", _percentiles(arr[:, 2])),
                            ("k_N", _percentiles(np.exp(arr[:, 1]))), ("k_D", _percentiles(np.exp(arr[:, 3]))))
          if v is not None}
    for p, vals in zip(used, per_budget):
        p.n_opt_ci = _percentiles(vals)
    return BootstrapResult(n_resamples=n, n_failed=n - len(rows), seed=seed, ci=ci, failures=failures, samples=samples)


# ---------------------------------------------------------------------------------------------
# Approach 3's bootstrap, and both approaches on one set of runs
# ---------------------------------------------------------------------------------------------

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
    data = [np.array([[r.n_params, r.tokens, r.val_loss] for r in members], dtype=float) for _, members in groups]
    rng = np.random.default_rng([seed, 3])
    rows: List[List[float]] = []
    failures: Dict[str, int] = {}
    for _ in range(n):
        sample = np.concatenate([g[_resample(rng, len(g))] for g in data])
        try:
            res = fit_loss_law(sample[:, 0], sample[:, 1], sample[:, 2], delta=fit.delta, top_k=top_k, init_grid=grid)
        except ScalingError as exc:
            key = "non-positive exponent" if "non-positive" in str(exc) else str(exc)[:80]
            failures[key] = failures.get(key, 0) + 1
            continue
        rows.append([getattr(res.law, k) for k in A3_KEYS])
    arr = np.array(rows).reshape(-1, len(A3_KEYS))
    samples = {k: arr[:, i] for i, k in enumerate(A3_KEYS)}
    ci = {k: v for k in A3_KEYS if (v := _percentiles(samples[k])) is not None}
    return BootstrapResult(n_resamples=n, n_failed=n - len(rows), seed=seed, ci=ci, failures=failures, samples=samples)


@dataclass
class SweepAnalysis:
    """Approach 2 and Approach 3 on the same runs, with their bootstraps."""

    runs: List[RunPoint]
    params: str
    groups: List[Tuple[float, List[RunPoint]]]
    approach2: Approach2Result
    approach3: Optional[FitResult]
    approach3_bootstrap: Optional[BootstrapResult] = None
    approach3_error: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """Approach 3's FitResult keys at the top (as ``llama-plan fit --json`` always had), per
        budget both approaches, then ``approach2`` and ``approach3`` with intervals."""
        out: Dict[str, Any] = self.approach3.to_dict() if self.approach3 else {}
        law = self.approach3.law if self.approach3 else None
        budgets = []
        for p, (budget, members) in zip(self.approach2.parabolas, self.groups):
            row: Dict[str, Any] = {"flops": budget, "runs": len(members), "best_run": p.best_run,
                                   "best_n_params": p.best_n_params, "best_val_loss": p.best_val_loss}
            if law:
                n_opt, d_opt = law.optimal(budget)
                row.update({"fitted_n_opt": n_opt, "fitted_d_opt": d_opt, "fitted_loss": law.loss(n_opt, d_opt)})
            row["approach2"] = p.to_dict()
            budgets.append(row)
        out["budgets"] = budgets
        out["approach2"] = self.approach2.to_dict()
        a3: Dict[str, Any] = {"error": self.approach3_error}
        if law:
            ci = self.approach3_bootstrap.ci if self.approach3_bootstrap else {}
            for k in A3_KEYS:
                a3[k] = getattr(law, k)
                a3[f"{k}_ci"] = ci.get(k)
        a3["bootstrap"] = self.approach3_bootstrap.to_dict() if self.approach3_bootstrap else None
        out["approach3"] = a3
        out["params_convention"] = self.params
        return out


def analyse_runs(runs: Sequence[RunPoint], *, params: str = "total", top_k: Optional[int] = 64,
                 bootstrap: int = 200, bootstrap_a3: int = 100, bootstrap_top_k: int = 10, seed: int = 0,
                 name: str = "fitted", window: Optional[int] = None) -> SweepAnalysis:
    """Both approaches with bootstrap intervals; either may fail (its error is kept), not both."""
    runs = list(runs)
    groups = group_budgets(runs)
    a2 = fit_approach2(runs, groups=groups, bootstrap=bootstrap, seed=seed, window=window)
    a3 = a3_boot = a3_err = None
    try:
        a3 = fit_loss_law([r.n_params for r in runs], [r.tokens for r in runs], [r.val_loss for r in runs],
                          top_k=top_k, name=name)
    except ScalingError as exc:
        a3_err = str(exc)
    if a3 is not None and bootstrap_a3 > 0:
        a3_boot = bootstrap_approach3(runs, a3, n=bootstrap_a3, seed=seed, top_k=bootstrap_top_k, groups=groups)
    if a3 is None and a2.n_opt_law is None:
        raise ScalingError(f"neither approach gives an answer: Approach 2: {a2.error}; Approach 3: {a3_err}")
    return SweepAnalysis(runs=runs, params=params, groups=groups, approach2=a2, approach3=a3,
                         approach3_bootstrap=a3_boot, approach3_error=a3_err)
