"""The Chinchilla parametric loss, its published fits and frontiers, and the inference-aware optimum.

Everything here is pure numpy/scipy (no torch), so ``llama-plan compute-optimal`` answers instantly.

Conventions (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", App. F):
``N`` is the *total* parameter count including embeddings, ``D`` the number of training tokens,
and training compute is ``C = 6 N D`` FLOPs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Sequence, Tuple, Union

import numpy as np

from llama_train.errors import BadInput


class ScalingError(BadInput):
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

def _positive(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ScalingError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise ScalingError(f"{name}={value!r} must be a finite number > 0")
    return v
