"""``llama-plot <output_dir>``: a run's loss, learning rate and throughput curves from its
metrics.jsonl (records read through llama_train.records). matplotlib is imported lazily (Agg).

``llama-plan fit``'s IsoFLOP figure is :func:`llama_train.scaling.plots.plot_isoflops`, importable
from here too; this module points at scaling, never the reverse."""

from __future__ import annotations

import argparse
from pathlib import Path

from llama_train.records import METRICS_FILE, events, read_metrics, step_records
from llama_train.scaling.plots import plot_isoflops

__all__ = ["plot", "plot_isoflops", "main"]

_LLAMA_PLOT = "``llama-plot <output_dir>``: loss, learning rate and throughput curves from metrics.jsonl."


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(output_dir: str, out: str | None = None) -> Path:
    plt = _pyplot()
    run = Path(output_dir)
    metrics = run / METRICS_FILE
    if not metrics.is_file():
        raise SystemExit(f"llama-plot: {metrics} not found (is {run} a llama-train output_dir?)")
    rows = read_metrics(metrics)
    train = step_records(rows, "loss")
    val = step_records(rows, "val_loss")
    if not train:
        raise SystemExit(f"llama-plot: {metrics} has no logged training steps yet")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r.step for r in train]
    axes[0].plot(steps, [r["loss"] for r in train], label="train")
    if val:
        axes[0].plot([r.step for r in val], [r["val_loss"] for r in val], "o-", label="val")
    axes[0].set(xlabel="step", ylabel="loss", title="loss")
    axes[0].legend()
    axes[1].plot(steps, [r.get("lr", float("nan")) for r in train])
    axes[1].set(xlabel="step", ylabel="learning rate", title="learning rate")
    axes[2].plot(steps, [r.get("tokens_per_s", float("nan")) for r in train])
    axes[2].set(xlabel="step", ylabel="tokens/s", title="throughput")
    for r in events(rows, "rollback", "resume"):
        for ax in axes:
            ax.axvline(r.step, color="grey", ls=":", lw=1)
    fig.suptitle(str(run))
    fig.tight_layout()
    path = Path(out) if out else run / "curves.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="llama-plot", description=_LLAMA_PLOT)
    p.add_argument("output_dir")
    p.add_argument("--out", help="PNG path (default: <output_dir>/curves.png)")
    a = p.parse_args(argv)
    print(plot(a.output_dir, a.out))


if __name__ == "__main__":
    main()
