"""Scaling-law math: the Chinchilla parametric loss, its published fits, and a fitter for our sweeps.

Everything here is pure numpy/scipy (no torch), so ``llama-plan compute-optimal`` answers instantly.
The planner CLI and the model-facing parts (memory, shapes) live in :mod:`llama_train.scaling`.

Conventions (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", App. F):
``N`` is the *total* parameter count including embeddings, ``D`` the number of training tokens,
and training compute is ``C = 6 N D`` FLOPs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np


class ScalingError(ValueError):
    """Bad input to the planner; the message names the argument/key/path and the fix."""


# ---------------------------------------------------------------------------------------------
# The parametric loss L(N, D) = E + A / N^alpha + B / D^beta
# ---------------------------------------------------------------------------------------------

_LAW_KEYS = ("E", "A", "B", "alpha", "beta")


@dataclass(frozen=True)
class LossLaw:
    """Chinchilla Approach-3 loss surface. ``N`` = total params, ``D`` = training tokens."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        for key in _LAW_KEYS:
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ScalingError(
                    f"loss law {self.name!r}: {key}={v!r} must be a finite number > 0 "
                    f"(L(N,D) = E + A/N^alpha + B/D^beta)"
                )

    # -- the surface ----------------------------------------------------------------------
    def loss(self, n: Any, d: Any) -> Any:
        """Predicted loss; works on scalars and numpy arrays (broadcasting)."""
        n = np.asarray(n, dtype=float)
        d = np.asarray(d, dtype=float)
        out = self.E + self.A / n**self.alpha + self.B / d**self.beta
        return float(out) if out.ndim == 0 else out

    # -- the compute-optimal frontier (Hoffmann et al. Eq. 4) ------------------------------
    @property
    def a(self) -> float:
        """Exponent of N_opt ∝ C^a."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt ∝ C^b."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    def optimal(self, flops: float) -> Tuple[float, float]:
        """(N_opt, D_opt) minimising L subject to 6 N D = flops (closed form)."""
        flops = _positive("flops", flops)
        n = self.G * (flops / 6.0) ** self.a
        d = (flops / 6.0) ** self.b / self.G
        return n, d

    def flops_where_optimal(self, n_params: float) -> float:
        """The budget C at which ``n_params`` is the compute-optimal size."""
        n_params = _positive("n_params", n_params)
        return 6.0 * (n_params / self.G) ** (1.0 / self.a)

    def optimal_for_loss(self, loss: float) -> Tuple[float, float]:
        """The cheapest (N, D) reaching ``loss`` when only training is paid for.

        At the optimum the two reducible terms are in ratio beta:alpha, so
        A/N^alpha = (loss-E) beta/(alpha+beta) and B/D^beta = (loss-E) alpha/(alpha+beta).
        """
        excess = self._excess(loss)
        n = (self.A / (excess * self.a)) ** (1.0 / self.alpha)
        d = (self.B / (excess * self.b)) ** (1.0 / self.beta)
        return n, d

    # -- the iso-loss curve ----------------------------------------------------------------
    def min_params_for_loss(self, loss: float) -> float:
        """Below this size the target loss needs infinite data."""
        return (self.A / self._excess(loss)) ** (1.0 / self.alpha)

    def tokens_for_loss(self, n_params: Any, loss: float) -> Any:
        """D(N) on the iso-loss curve L(N, D) = loss (inf where unreachable)."""
        excess = self._excess(loss)
        n = np.asarray(n_params, dtype=float)
        rest = excess - self.A / n**self.alpha
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.where(rest > 0, (self.B / np.where(rest > 0, rest, 1.0)) ** (1.0 / self.beta), np.inf)
        return float(d) if d.ndim == 0 else d

    def _excess(self, loss: float) -> float:
        loss = float(loss)
        if not math.isfinite(loss) or loss <= self.E:
            raise ScalingError(
                f"target loss {loss!r} is not above the irreducible loss E={self.E} of fit "
                f"{self.name!r}: no finite model reaches it; pick a loss > E"
            )
        return loss - self.E

    def constants(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in _LAW_KEYS}

    def to_dict(self) -> Dict[str, Any]:
        return {**self.constants(), "name": self.name, "source": self.source}


# Hoffmann et al. 2022, App. D.2, Eq. (10), as printed (two significant digits on the exponents).
CHINCHILLA = LossLaw(
    E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, name="chinchilla",
    source="Hoffmann et al. 2022 (arXiv:2203.15556), App. D.2 Eq. (10), as printed",
)
# Same E, A, B with the less-rounded exponents that Sardana et al. 2024 use throughout their
# analysis (defaults of their released code, github.com/nikhilsardana/beyond-chinchilla utils.py).
# They reproduce Hoffmann's Table A3 (Approach 3) within ~4% and Fig. 4's 40B at Gopher's budget,
# which the printed 0.34/0.28 do not (they give 32B; see docs/scaling.md).
SARDANA = LossLaw(
    E=1.69, A=406.4, B=410.7, alpha=0.336, beta=0.283, name="sardana",
    source="Hoffmann et al. 2022 A, B, E with alpha=0.336, beta=0.283 as used by Sardana et al. 2024 "
    "(arXiv:2401.00448, code defaults)",
)
# Besiroglu, Erdil, Barnett, You 2024, "Chinchilla Scaling: A replication attempt" (Epoch AI),
# refit of Approach 3 on data digitised from Hoffmann et al. Fig. 4.
EPOCH = LossLaw(
    E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, name="epoch",
    source="Besiroglu et al. 2024 (arXiv:2404.10102), Epoch AI replication of Approach 3",
)

FITS: Dict[str, LossLaw] = {"chinchilla": CHINCHILLA, "sardana": SARDANA, "epoch": EPOCH}
_FIT_ALIASES = {"hoffmann": "chinchilla", "besiroglu": "epoch", "epoch-ai": "epoch"}


def load_fit(fit: Union[str, Path, LossLaw, Mapping[str, Any]] = "chinchilla") -> LossLaw:
    """A built-in fit name, a YAML/JSON file with E, A, B, alpha, beta, a mapping, or a LossLaw."""
    if isinstance(fit, LossLaw):
        return fit
    if isinstance(fit, Mapping):
        return _law_from_mapping(dict(fit), where="fit mapping")
    if not isinstance(fit, (str, Path)):
        raise ScalingError(f"fit={fit!r}: expected one of {sorted(FITS)} or a path to a YAML file")
    key = str(fit).strip()
    low = key.lower()
    if low in FITS or low in _FIT_ALIASES:
        return FITS[_FIT_ALIASES.get(low, low)]
    path = Path(key).expanduser()
    if not path.is_file():
        raise ScalingError(
            f"fit={key!r} is neither a built-in fit ({', '.join(sorted(FITS))}) nor an existing "
            f"YAML file; write one with keys E, A, B, alpha, beta (e.g. `llama-plan fit SWEEP --save-fit fit.yaml`)"
        )
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - any parse error becomes a message naming the file
        raise ScalingError(f"fit file {path}: cannot parse ({exc})") from exc
    if not isinstance(data, dict):
        raise ScalingError(f"fit file {path}: expected a mapping with keys E, A, B, alpha, beta")
    if "fit" in data and isinstance(data["fit"], dict):  # the output of `llama-plan fit --save-fit`
        data = data["fit"]
    data.setdefault("name", path.stem)
    data.setdefault("source", str(path))
    return _law_from_mapping(data, where=f"fit file {path}")


def _law_from_mapping(data: Dict[str, Any], where: str) -> LossLaw:
    missing = [k for k in _LAW_KEYS if k not in data]
    if missing:
        raise ScalingError(f"{where}: missing key(s) {missing}; a fit needs E, A, B, alpha, beta")
    unknown = sorted(set(data) - set(_LAW_KEYS) - {"name", "source"})
    if unknown:
        raise ScalingError(f"{where}: unknown key(s) {unknown}; allowed: E, A, B, alpha, beta, name, source")
    vals = {}
    for k in _LAW_KEYS:
        try:
            vals[k] = float(data[k])
        except (TypeError, ValueError):
            raise ScalingError(f"{where}: {k}={data[k]!r} is not a number") from None
    return LossLaw(**vals, name=str(data.get("name", "custom")), source=str(data.get("source", "")))


# ---------------------------------------------------------------------------------------------
# Approaches 1 and 2: power laws N_opt = k C^a anchored to the paper's own tables
# ---------------------------------------------------------------------------------------------

# (parameters, training FLOPs, training tokens) as printed.
# Hoffmann et al. 2022, Table 3 (Approach 1).
HOFFMANN_TABLE3_APPROACH1 = (
    (400e6, 1.92e19, 8.0e9), (1e9, 1.21e20, 20.2e9), (10e9, 1.23e22, 205.1e9),
    (67e9, 5.76e23, 1.5e12), (175e9, 3.85e24, 3.7e12), (280e9, 9.90e24, 5.9e12),
    (520e9, 3.43e25, 11.0e12), (1e12, 1.27e26, 21.2e12), (10e12, 1.30e28, 216.2e12),
)
# Hoffmann et al. 2022, Table A3, Approach 2 columns.
HOFFMANN_TABLEA3_APPROACH2 = (
    (400e6, 1.84e19, 7.7e9), (1e9, 1.20e20, 20.0e9), (10e9, 1.32e22, 219.5e9),
    (67e9, 6.88e23, 1.7e12), (175e9, 4.54e24, 4.3e12), (280e9, 1.18e25, 7.1e12),
    (520e9, 4.19e25, 13.4e12), (1e12, 1.59e26, 26.5e12), (10e12, 1.75e28, 292.0e12),
)
# Hoffmann et al. 2022, Table A3, Approach 3 columns. The 175B row's FLOPs appear as 1.26e+24 in
# the text we could read; that contradicts its own 12.0T tokens (6*175e9*12e12 = 1.26e25) and the
# monotone column, so the e+25 reading is used.
HOFFMANN_TABLEA3_APPROACH3 = (
    (400e6, 2.21e19, 9.2e9), (1e9, 1.62e20, 27.1e9), (10e9, 2.46e22, 410.1e9),
    (67e9, 1.71e24, 4.1e12), (175e9, 1.26e25, 12.0e12), (280e9, 3.52e25, 20.1e12),
    (520e9, 1.36e26, 43.5e12), (1e12, 5.65e26, 94.1e12), (10e12, 8.55e28, 1425.5e12),
)
GOPHER_FLOPS = 5.76e23  # Hoffmann et al. 2022: Gopher's (and Chinchilla's) training budget


@dataclass(frozen=True)
class PowerLawFrontier:
    """N_opt = k C^a with D_opt = C / (6 N_opt); k anchored to a published table."""

    name: str
    a: float
    k: float
    source: str

    def optimal(self, flops: float) -> Tuple[float, float]:
        flops = _positive("flops", flops)
        n = self.k * flops**self.a
        return n, flops / (6.0 * n)


def _anchored(name: str, a: float, table: Sequence[Tuple[float, float, float]], source: str) -> PowerLawFrontier:
    """Least squares in log space for the coefficient, with the paper's exponent held fixed."""
    logs = [math.log(n) - a * math.log(c) for n, c, _ in table]
    return PowerLawFrontier(name=name, a=a, k=math.exp(sum(logs) / len(logs)), source=source)


# Exponents from Hoffmann et al. Table 2 (a = 0.50 for Approach 1, 0.49 for Approach 2).
APPROACH1 = _anchored(
    "approach1", 0.50, HOFFMANN_TABLE3_APPROACH1,
    "Hoffmann et al. 2022: a=0.50 (Table 2), coefficient fitted to Table 3",
)
APPROACH2 = _anchored(
    "approach2", 0.49, HOFFMANN_TABLEA3_APPROACH2,
    "Hoffmann et al. 2022: a=0.49 (Table 2), coefficient fitted to Table A3 (Approach 2)",
)


# ---------------------------------------------------------------------------------------------
# Inference-aware optimum (Sardana et al. 2024, Eq. 3)
# ---------------------------------------------------------------------------------------------

def lifetime_optimal(law: LossLaw, loss: float, inference_tokens: float) -> Tuple[float, float]:
    """(N, D_train) on the iso-loss curve minimising 6 N D_train + 2 N D_inf.

    One variable: x = log N, with D(N) from the iso-loss curve. The cost is infinite at
    N_min (the size that needs infinite data) and, for N beyond the training-only optimum N_c,
    both of its terms grow, so the minimiser lies in (N_min, N_c]. We find it as the root of
    d cost / d log N, whose sign is checked at both ends of that bracket:
        d cost / d log N = 6 N D (1 - alpha A N^-alpha / (beta r)) + 2 N D_inf,  r = loss - E - A N^-alpha.
    """
    from scipy.optimize import brentq

    d_inf = float(inference_tokens)
    if not math.isfinite(d_inf) or d_inf < 0:
        raise ScalingError(f"inference_tokens={inference_tokens!r} must be a finite number >= 0")
    n_c, d_c = law.optimal_for_loss(loss)
    if d_inf == 0:
        return n_c, d_c
    excess = law._excess(loss)
    n_min = law.min_params_for_loss(loss)

    def slope(x: float) -> float:  # d cost / d log N, divided by N
        n = math.exp(x)
        rest = excess - law.A * n ** (-law.alpha)
        d = (law.B / rest) ** (1.0 / law.beta)
        return 6.0 * d * (1.0 - law.alpha * law.A * n ** (-law.alpha) / (law.beta * rest)) + 2.0 * d_inf

    lo = math.log(n_min) + 1e-9
    hi = math.log(n_c)
    s_lo, s_hi = slope(lo), slope(hi)
    if not (s_lo < 0 < s_hi):
        raise ScalingError(
            f"inference-optimal solver: no sign change of d(cost)/d(log N) on the bracket "
            f"[N_min={n_min:.4g}, N_chinchilla={n_c:.4g}] (slopes {s_lo:.3g}, {s_hi:.3g}); "
            f"check the fit constants and the target loss {loss}"
        )
    x = brentq(slope, lo, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps, maxiter=500)
    n = math.exp(x)
    return n, law.tokens_for_loss(n, loss)


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


def collect_runs(sweep_dir: Union[str, Path], params: str = "total") -> Tuple[List[RunPoint], List[Dict[str, str]]]:
    """Every run under ``sweep_dir`` (any depth) that has ``metrics.jsonl`` + ``run_info.json``.

    ``run_info.json`` (written by the trainer): {"params": {"total", "non_embedding"},
    "tokens": total training tokens, "flops": training FLOPs, "model_args": {...}} and optionally
    "flop_budget" (the sweep's nominal budget, used to group IsoFLOP curves).
    Returns (usable runs, skipped runs with the reason).
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ScalingError(f"sweep_dir {root} is not a directory; pass the folder holding the sweep's run dirs")
    if params not in ("total", "non_embedding"):
        raise ScalingError(f"params={params!r}: use 'total' (Chinchilla's convention) or 'non_embedding'")
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
        runs.append(RunPoint(run=name, n_params=n, tokens=tokens, flops=flops, val_loss=loss,
                             budget=float(budget) if budget is not None else None))
    return runs, skipped


def group_budgets(runs: Sequence[RunPoint], rel_tol: float = 0.15) -> List[Tuple[float, List[RunPoint]]]:
    """IsoFLOP groups: runs whose ``flop_budget`` (or, if any run lacks one, FLOPs) agree within rel_tol."""
    use_budget = bool(runs) and all(r.budget is not None for r in runs)
    key = (lambda r: r.budget) if use_budget else (lambda r: r.flops)
    out: List[Tuple[float, List[RunPoint]]] = []
    cur: List[RunPoint] = []

    def close() -> None:
        out.append((float(np.exp(np.mean([math.log(key(x)) for x in cur]))), list(cur)))

    for r in sorted(runs, key=key):
        if cur and key(r) > key(cur[0]) * (1 + rel_tol):
            close()
            cur = []
        cur.append(r)
    if cur:
        close()
    return out


def plot_isoflops(runs: Sequence[RunPoint], law: LossLaw, out: Union[str, Path]) -> Path:
    """Left: loss vs N per budget with the fitted IsoFLOP slices; right: the fitted frontier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_budgets(runs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    cmap = plt.get_cmap("viridis")
    for i, (budget, members) in enumerate(groups):
        color = cmap(i / max(1, len(groups) - 1))
        ns = np.array([r.n_params for r in members])
        ax1.scatter(ns, [r.val_loss for r in members], color=color, zorder=3, label=f"{budget:.2g} FLOPs")
        grid = np.logspace(math.log10(ns.min()) - 0.3, math.log10(ns.max()) + 0.3, 200)
        ax1.plot(grid, law.loss(grid, budget / (6 * grid)), color=color, lw=1)
        n_opt, d_opt = law.optimal(budget)
        ax1.scatter([n_opt], [law.loss(n_opt, d_opt)], marker="*", s=140, color=color, edgecolor="k", zorder=4)
        best = min(members, key=lambda r: r.val_loss)
        ax2.scatter([budget], [best.n_params], color=color, zorder=3)
    ax1.set_xscale("log")
    losses = [r.val_loss for r in runs]
    if losses:  # frame the measured points; a poorly constrained fit may shoot off the chart
        span = max(losses) - min(losses) or 1.0
        ax1.set_ylim(min(losses) - 0.5 * span, max(losses) + 0.5 * span)
    ax1.set_xlabel("parameters N")
    ax1.set_ylabel("final validation loss")
    ax1.set_title("IsoFLOP curves (points: runs, lines: fit, *: fitted optimum)")
    ax1.legend(fontsize=8)
    budgets = [b for b, _ in groups] or [1e18]
    cs = np.logspace(math.log10(min(budgets)) - 1, math.log10(max(budgets)) + 2, 100)
    ax2.plot(cs, [law.optimal(c)[0] for c in cs], "k-", label=f"fit: N_opt ∝ C^{law.a:.3f}")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("training FLOPs C")
    ax2.set_ylabel("compute-optimal N")
    ax2.set_title("Compute-optimal frontier (points: best run per budget)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------

def _positive(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ScalingError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise ScalingError(f"{name}={value!r} must be a finite number > 0")
    return v
