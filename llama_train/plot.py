"""Every plot in one place, so matplotlib is imported here only (and lazily): ``llama-plot
<output_dir>``'s loss, learning rate and throughput curves from metrics.jsonl, and
``llama-plan fit``'s IsoFLOP curves and compute-optimal frontier."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from llama_train.scaling.fit import RunPoint, group_budgets
from llama_train.scaling.laws import LossLaw

_LLAMA_PLOT = "``llama-plot <output_dir>``: loss, learning rate and throughput curves from metrics.jsonl."


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: Path):
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return rows


def plot(output_dir: str, out: str | None = None) -> Path:
    plt = _pyplot()
    run = Path(output_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"llama-plot: {metrics} not found (is {run} a llama-train output_dir?)")
    rows = read_metrics(metrics)
    train = [r for r in rows if isinstance(r.get("loss"), (int, float))]
    val = [r for r in rows if isinstance(r.get("val_loss"), (int, float))]
    if not train:
        raise SystemExit(f"llama-plot: {metrics} has no logged training steps yet")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in train]
    axes[0].plot(steps, [r["loss"] for r in train], label="train")
    if val:
        axes[0].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    axes[0].set(xlabel="step", ylabel="loss", title="loss")
    axes[0].legend()
    axes[1].plot(steps, [r.get("lr", float("nan")) for r in train])
    axes[1].set(xlabel="step", ylabel="learning rate", title="learning rate")
    axes[2].plot(steps, [r.get("tokens_per_s", float("nan")) for r in train])
    axes[2].set(xlabel="step", ylabel="tokens/s", title="throughput")
    for r in rows:
        if r.get("event") in ("rollback", "resume"):
            for ax in axes:
                ax.axvline(r["step"], color="grey", ls=":", lw=1)
    fig.suptitle(str(run))
    fig.tight_layout()
    path = Path(out) if out else run / "curves.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_isoflops(runs: Sequence[RunPoint], law: LossLaw, out: Union[str, Path]) -> Path:
    """Left: loss vs N per budget with the fitted IsoFLOP slices; right: the fitted frontier."""
    plt = _pyplot()
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="llama-plot", description=_LLAMA_PLOT)
    p.add_argument("output_dir")
    p.add_argument("--out", help="PNG path (default: <output_dir>/curves.png)")
    a = p.parse_args(argv)
    print(plot(a.output_dir, a.out))


if __name__ == "__main__":
    main()
