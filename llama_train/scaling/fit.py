"""Fitting our own sweeps, both of Hoffmann et al.'s approaches on one set of runs
(:func:`analyse_runs`), with bootstrap intervals.

The parts, each its own module (their names are importable from here too):
:mod:`.runs` (reading a sweep directory or a CSV into points, IsoFLOP groups),
:mod:`.approach2` (IsoFLOP parabolas and their power laws), :mod:`.approach3` (the Huber/LSE
L-BFGS fit of L(N, D)), :mod:`.bootstrap` (what both bootstraps share). The IsoFLOP figure is
:mod:`llama_train.scaling.plots`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_train.scaling.approach2 import (FLAG_TEXT, REFUSALS, WARNINGS, Approach2Result, IsoFlopParabola,
                                           PowerLaw, fit_approach2, fit_isoflop_parabola, fit_power_law)
from llama_train.scaling.approach3 import (A3_KEYS, FitResult, NoiseAndMisfit, bootstrap_approach3, fit_loss_law,
                                           noise_and_misfit, paper_init_grid)
from llama_train.scaling.bootstrap import BOOTSTRAP_MIN_OK, BootstrapResult
from llama_train.scaling.laws import ScalingError
from llama_train.scaling.runs import (CSV_COLUMNS, CSV_EXTRA_COLUMNS, RunPoint, collect_runs, final_val_loss,
                                      group_budgets, load_runs, load_runs_csv, write_runs_csv)

__all__ = [
    "SweepAnalysis", "analyse_runs",
    # runs
    "RunPoint", "collect_runs", "final_val_loss", "group_budgets", "load_runs", "load_runs_csv",
    "write_runs_csv", "CSV_COLUMNS", "CSV_EXTRA_COLUMNS",
    # approach 2
    "REFUSALS", "WARNINGS", "FLAG_TEXT", "IsoFlopParabola", "fit_isoflop_parabola", "PowerLaw",
    "fit_power_law", "Approach2Result", "fit_approach2",
    # approach 3
    "paper_init_grid", "FitResult", "fit_loss_law", "A3_KEYS", "bootstrap_approach3", "NoiseAndMisfit",
    "noise_and_misfit",
    # bootstrap
    "BootstrapResult", "BOOTSTRAP_MIN_OK",
]


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
    noise: Optional[NoiseAndMisfit] = None  # Approach 3's residuals against the seeds' pure error

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
        a3["repeat_half_life"] = self.runs[0].repeat_half_life if self.runs else None
        a3["bootstrap"] = self.approach3_bootstrap.to_dict() if self.approach3_bootstrap else None
        a3["noise"] = self.noise.to_dict() if self.noise else None
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
        # repeated tokens as their fresh-token equivalent (runs.effective_tokens; D itself within one epoch)
        a3 = fit_loss_law([r.n_params for r in runs], [r.effective_tokens for r in runs], [r.val_loss for r in runs],
                          top_k=top_k, name=name)
    except ScalingError as exc:
        a3_err = str(exc)
    if a3 is not None and bootstrap_a3 > 0:
        a3_boot = bootstrap_approach3(runs, a3, n=bootstrap_a3, seed=seed, top_k=bootstrap_top_k, groups=groups)
    if a3 is None and a2.n_opt_law is None:
        raise ScalingError(f"neither approach gives an answer: Approach 2: {a2.error}; Approach 3: {a3_err}")
    return SweepAnalysis(runs=runs, params=params, groups=groups, approach2=a2, approach3=a3,
                         approach3_bootstrap=a3_boot, approach3_error=a3_err,
                         noise=noise_and_misfit(a3.law, groups) if a3 is not None else None)
