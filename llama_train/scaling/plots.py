"""The IsoFLOP figure of ``llama-plan fit``: each budget's runs, parabola and minimum, and the
compute-optimal frontier of both approaches. matplotlib is imported lazily (Agg)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from llama_train.scaling.approach2 import Approach2Result, fit_approach2
from llama_train.scaling.bootstrap import BootstrapResult
from llama_train.scaling.laws import LossLaw
from llama_train.scaling.runs import RunPoint, group_budgets


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tokens_along(members: Sequence[RunPoint], budget: float):
    """D(N) along one IsoFLOP group: a log-log line through its runs' tokens (these need not be
    C/(6N): non-embedding N, or FLOPs counted with attention), else C/(6N)."""
    ln_n = np.log([r.n_params for r in members])
    if np.unique(ln_n).size >= 2:
        slope, icpt = np.polyfit(ln_n, np.log([r.tokens for r in members]), 1)
        return lambda n: np.exp(icpt + slope * np.log(n))
    return lambda n: budget / (6.0 * np.asarray(n))


def _ci_text(ci: Optional[Tuple[float, float]]) -> str:
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


def plot_isoflops(runs: Sequence[RunPoint], law: Optional[LossLaw], out: Union[str, Path],
                  approach2: Optional[Approach2Result] = None, *, approach3_ci: Optional[BootstrapResult] = None,
                  params: str = "total") -> Path:
    """Two panels, so both approaches can be checked by eye against the runs.

    Left: loss vs N per budget: runs (hollow: a budget Approach 2 refused), each budget's parabola
    and its minimum (★), and (dashed) the Approach-3 law along the budget. Right: N_opt vs C:
    Approach-2 minima with bootstrap 95% bars, their power law with its 95% band, Approach 3's
    frontier, and a slope-0.5 line (Chinchilla's a) through the minima for comparison.
    ``approach2`` defaults to :func:`fit_approach2` without a bootstrap; ``law`` may be None.
    """
    plt = _pyplot()
    groups = group_budgets(runs)
    if approach2 is None:
        approach2 = fit_approach2(runs, groups=groups)
    if len(approach2.parabolas) != len(groups):
        raise ValueError(f"approach2 has {len(approach2.parabolas)} budgets, the runs group into {len(groups)}")
    with plt.rc_context({"font.size": 11, "legend.fontsize": 9, "axes.titlesize": 12}):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 7))
        cmap = plt.get_cmap("viridis")
        _loss_panel(ax1, cmap, runs, groups, approach2.parabolas, law, params)
        _frontier_panel(ax2, cmap, approach2, law, approach3_ci, params)
        fig.tight_layout()
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
    return out


def _loss_panel(ax1, cmap, runs: Sequence[RunPoint], groups, parabolas, law: Optional[LossLaw],
                params: str) -> None:
    """Loss vs N per budget: the runs, each budget's parabola and minimum, Approach 3 dashed."""
    for i, ((budget, members), p) in enumerate(zip(groups, parabolas)):
        color = cmap(0.9 * i / max(1, len(groups) - 1))
        ns = np.array([r.n_params for r in members])
        label = f"C = {budget:.2g} ({len(members)} runs)" + (f", {', '.join(p.flags)}" if p.flags else "")
        label += "" if p.used else " (refused)"
        ax1.scatter(ns, [r.val_loss for r in members], s=36, zorder=3, label=label,
                    color=color if p.used else "none", edgecolor=color)
        grid = np.logspace(math.log10(ns.min()) - 0.15, math.log10(ns.max()) + 0.15, 200)
        if p.coeffs is not None:
            ax1.plot(grid, p.loss(grid), color=color, lw=1.6, ls="-" if p.used else ":")
        if p.used:
            ax1.scatter([p.n_opt], [p.loss_at_min], marker="*", s=220, color=color, edgecolor="k", zorder=4)
        if law is not None:
            ax1.plot(grid, law.loss(grid, _tokens_along(members, budget)(grid)), color=color, lw=1, ls="--",
                     alpha=0.8)
    ax1.set_xscale("log")
    losses = [r.val_loss for r in runs]
    if losses:  # frame the measured points; a poorly constrained fit may shoot off the chart
        span = max(losses) - min(losses) or 1.0
        ax1.set_ylim(min(losses) - 0.15 * span, max(losses) + 0.15 * span)
    ax1.set_xlabel(f"parameters N ({params.replace('_', '-')})")
    ax1.set_ylabel("final validation loss")
    ax1.set_title("IsoFLOP curves: solid = Approach 2 parabola, ★ = its minimum"
                  + (",\ndashed = Approach 3 L(N, D) along the budget" if law is not None else ""))
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)  # off the data
    ax1.grid(True, which="both", alpha=0.25)


def _frontier_panel(ax2, cmap, approach2: Approach2Result, law: Optional[LossLaw],
                    approach3_ci: Optional[BootstrapResult], params: str) -> None:
    """N_opt vs C: the minima with their bars, both approaches' power laws, a slope-0.5 line."""
    parabolas = approach2.parabolas
    used = [p for p in parabolas if p.used]
    budgets = [p.flops for p in parabolas] or [1e18]
    cs = np.logspace(math.log10(min(budgets)) - 0.3, math.log10(max(budgets)) + 0.3, 100)
    refused_label = "refused budget: its best run"
    for i, p in enumerate(parabolas):
        color = cmap(0.9 * i / max(1, len(parabolas) - 1))
        if p.used:
            yerr = None
            if p.n_opt_ci:
                yerr = [[max(0.0, p.n_opt - p.n_opt_ci[0])], [max(0.0, p.n_opt_ci[1] - p.n_opt)]]
            ax2.errorbar([p.flops], [p.n_opt], yerr=yerr, fmt="o", ms=8, color=color, mec="k", capsize=4,
                         zorder=4)
        else:
            ax2.scatter([p.flops], [p.best_n_params], s=60, facecolor="none", edgecolor="grey", zorder=3,
                        label=refused_label)
            refused_label = None
    nl = approach2.n_opt_law
    boot = approach2.bootstrap
    if nl is not None:
        ci = boot.ci.get("a") if boot else None
        ax2.plot(cs, nl(cs), "k-", lw=2, label=f"Approach 2: N_opt ∝ C^{nl.exponent:.3f}{_ci_text(ci)}")
        if boot is not None and boot.samples["a"].size >= 10:
            ln = boot.samples["log_k_N"][:, None] + boot.samples["a"][:, None] * np.log(cs)[None, :]
            lo, hi = np.percentile(ln, [2.5, 97.5], axis=0)
            ax2.fill_between(cs, np.exp(lo), np.exp(hi), color="k", alpha=0.12, lw=0,
                             label=f"Approach 2: 95% band ({boot.n_resamples - boot.n_failed} bootstrap fits)")
    if law is not None:
        ci = approach3_ci.ci.get("a") if approach3_ci else None
        ax2.plot(cs, [law.optimal(c)[0] for c in cs], color="tab:blue", ls="--", lw=1.8,
                 label=f"Approach 3: N_opt ∝ C^{law.a:.3f}{_ci_text(ci)}")
    if used:
        c0 = math.exp(np.mean(np.log([p.flops for p in used])))
        n0 = math.exp(np.mean(np.log([p.n_opt for p in used])))
        ax2.plot(cs, n0 * (cs / c0) ** 0.5, color="tab:red", ls=":", lw=1.8,
                 label="slope 0.5 (Chinchilla's a), through the minima's centre")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("training FLOPs C (budget)")
    ax2.set_ylabel(f"compute-optimal N ({params.replace('_', '-')})")
    title = "Compute-optimal N: points = parabola minima, bars = bootstrap 95%"
    if nl is None and approach2.error:
        title += "\n(no Approach 2 power law: fewer than 2 usable budgets)"
    ax2.set_title(title)
    ax2.legend(loc="upper left")
    ax2.grid(True, which="both", alpha=0.25)
