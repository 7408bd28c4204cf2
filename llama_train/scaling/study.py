"""Our own scaling study on 2 CPU cores, end to end (``make scaling-demo``; docs/scaling.md).

    python -m llama_train.scaling.study                      # every stage, ~50 min on 2 cores
    python -m llama_train.scaling.study --stages fit,frontier  # from the committed runs CSV

Stages, each a set of real ``llama-train`` / ``llama-plan`` commands (printed as they start):

* ``lr``: the learning rate. Two sizes a decade apart, each at the budget where it is about
  compute-optimal, over a grid of rates (a parabola in ln(lr) gives each its best rate), then
  one size at two budgets. The rate falls with the budget, hardly with the size, so
  ``configs/study/cpu.yaml`` uses lr ∝ C^-k (``scaling.lr_ref_flops`` /
  ``scaling.lr_flops_exponent``), k from the two grids. Writes ``<docs>/data/lr_sweep.csv``.
* ``sweep``: the IsoFLOP grid, ``experiment=isoflop +study=cpu`` at each budget for the
  sizes of :func:`ladder` around a guessed optimum, each run its own ``llama-train`` command.
* ``fit``: ``llama-plan fit`` on the sweep (Approach 2 over the runs near each budget's best,
  Approach 3, bootstrap intervals, both parameter counts): ``<docs>/data/isoflop_runs.csv``, ``<docs>/img/isoflop.png`` and the
  Approach 3 law ``<docs>/data/isoflop_fit.yaml`` (non-embedding N).
* ``frontier``: with that law, ``experiment=compute_optimal`` and ``experiment=inference_optimal``
  at one budget: each one trained, its val loss against the law's target, and its lifetime
  FLOPs 6 N D + 2 N D_inf. Writes ``<docs>/data/frontier_runs.csv``.

Runs go two at a time (``--jobs``) with one thread each (on 2 cores that is ~2x one run on two
threads for these tiny models); results do not depend on the order or the pairing.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from llama_train.paths import REPO_ROOT as REPO
from llama_train.records import RUN_INFO_FILE, RunInfo

STAGES = ("lr", "sweep", "fit", "frontier")
STUDY = ["+study=cpu"]  # configs/study/cpu.yaml: vocab 512, data.source=stdlib, N non-embedding
VOCAB, TOLERANCE = 512, 0.1  # configs/study/cpu.yaml's model.vocab_size and scaling.tolerance
BUDGETS = (3e11, 1e12, 3e12, 1e13)
# The optimum the sizes are centred on: N_c(C) = GUESS_N (C / GUESS_C)^0.5, from pilot runs at
# C = 1e12 (docs/scaling.md). Sizes reach SPAN times either side, so a guess within ~2x will do.
GUESS_N, GUESS_C, SPAN = 9e4, 1e12, 4.2
# lr stage: (size, the budget where it is about compute-optimal, rates)
# lr stage: (size, budget, rates). First two: a decade apart in size, each at about its
# compute-optimal budget (the rule's exponent); then one size at two budgets (does the rate
# follow the size or the budget?).
LR_POINTS = ((52368, 3e11, (2e-3, 3e-3, 4.5e-3, 7e-3, 1e-2, 1.5e-2)),
             (531216, 1e13, (1e-3, 1.5e-3, 2e-3, 3e-3, 4.5e-3, 7e-3)),
             (139584, 1e12, (2.5e-3, 4.944e-3, 1e-2)),
             (139584, 1e13, (2.5e-3, 4.944e-3)))
FRONTIER_FLOPS, INFERENCE_TOKENS = 3e12, 3e7
# Approach 2's parabolas: the runs within WINDOW sizes of each budget's best run (llama-plan fit
# --window); far from its minimum (e.g. 120 optimizer steps for the largest size of the smallest
# budget) an IsoFLOP curve is not a parabola in ln N. docs/scaling.md shows the all-runs fit too.
WINDOW = 2


@dataclass
class Run:
    overrides: List[str]
    out: Path
    tag: str
    cost: float = 0.0  # rough wall time, to start the dearest runs first

    @property
    def args(self) -> List[str]:
        """The overrides, output dir last (relative to the repo when under it: rerunnable anywhere)."""
        return [*self.overrides, f"trainer.output_dir={_rel(self.out)}"]

    @property
    def log(self) -> Path:
        return self.out.parent / f"{self.out.name}.log"

    @property
    def command(self) -> str:
        return "llama-train " + shlex.join(self.args)


def ladder(vocab: int = VOCAB, max_n: float = 3e6, tolerance: float = TOLERANCE) -> List[int]:
    """Non-embedding counts of one family of tiny LLaMA shapes: widths 16-256 at dim/n_layers
    within 1.6x of :func:`target_aspect_ratio`, each kept only if it is the shape the planner
    itself builds for its own count at the study's ``scaling.tolerance``. Sweeping these exact
    counts keeps one depth-to-width rule across the sweep (a free choice of shape per size would
    put a 1-layer model beside a 5-layer one and break the curve) and N = the target exactly."""
    from llama_train.model import count_params
    from llama_train.scaling.planners import NICE_DIMS, _make_shape, shape_for_params, target_aspect_ratio

    out = set()
    for dim in (d for d in NICE_DIMS if d <= 256):
        for layers in range(1, 12):
            if abs(math.log(dim / layers / target_aspect_ratio(dim))) <= math.log(1.6):
                m = _make_shape(dim, layers, vocab_size=vocab, max_seq_len=256, tie_embeddings=False)
                n = count_params(m)["non_embedding"]
                built = shape_for_params(n, vocab, 256, count="non_embedding", tolerance=tolerance)
                if n <= max_n and count_params(built)["non_embedding"] == n:
                    out.add(n)
    return sorted(out)


def sizes_for(flops: float, train_tokens: float, sizes: Sequence[int], max_epochs: float = 1.0,
              min_ratio: float = 1.3) -> List[int]:
    """The ladder's sizes within SPAN of the guessed optimum at ``flops``, at least ``min_ratio``
    apart, and none reading more than ``max_epochs`` of the train split."""
    centre = GUESS_N * (flops / GUESS_C) ** 0.5
    chosen: List[int] = []
    for n in sizes:
        if not centre / SPAN <= n <= centre * SPAN or flops / (6 * n) > max_epochs * train_tokens:
            continue
        if chosen and n / chosen[-1] < min_ratio:
            continue
        chosen.append(n)
    return chosen


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_all(runs: Sequence[Run], jobs: int, bin_dir: Path) -> List[Optional[RunInfo]]:
    """Run each (skipping ones whose run_info.json has a final val_loss), ``jobs`` at a time, the
    dearest first; their run_info.json in input order (None for a run that failed)."""
    def one(r: Run) -> Optional[RunInfo]:
        info = r.out / RUN_INFO_FILE
        if info.is_file() and RunInfo.read(info).final_val_loss is not None:
            print(f"  done before: {r.tag}", flush=True)
            return RunInfo.read(info)
        r.out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with open(r.log, "w") as log:
            rc = subprocess.call([str(bin_dir / "llama-train"), *r.args],
                                 cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        ok = rc == 0 and info.is_file()
        got = RunInfo.read(info) if ok else None
        loss = got.final_val_loss if got else None
        said = f"val_loss {loss:.4f}" if loss else f"FAILED rc={rc} (log {r.log})"
        print(f"  {r.tag}: {said} in {time.time() - t0:.0f} s", flush=True)
        return got

    order = sorted(range(len(runs)), key=lambda i: -runs[i].cost)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = dict(zip(order, pool.map(one, [runs[i] for i in order])))
    return [done[i] for i in range(len(runs))]


def _cost(flops: float, n: float) -> float:
    """Rough wall time of a run: the budget, plus the per-token overhead that makes small models dear."""
    return flops / 3e10 + flops / (6 * n) / 1e5


def train_tokens() -> int:
    """The train split's token count under the study's data settings (prepared once, here)."""
    from hydra import compose, initialize_config_dir

    from llama_train.config import load_config
    from llama_train.data import prepare_data
    from llama_train.paths import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = load_config(compose("config", overrides=["experiment=isoflop", *STUDY]))
    return int(prepare_data(cfg.data, cfg.model.vocab_size).meta["splits"]["train"]["tokens"])


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------

def best_lr(lrs: Sequence[float], losses: Sequence[float]) -> Tuple[float, str]:
    """The minimum of the parabola in ln(lr) through the lowest loss and its two neighbours on
    the grid (the loss-vs-lr curve is asymmetric, steeper on the high side, so a parabola over
    the whole grid is pulled towards low rates); at an edge of the grid, that edge."""
    order = np.argsort(lrs)
    x, y = np.log(np.asarray(lrs, float)[order]), np.asarray(losses, float)[order]
    i = int(np.argmin(y))
    if i == 0 or i == len(x) - 1:
        return float(np.exp(x[i])), "at the edge of the grid: widen it"
    a, b, _ = np.polyfit(x[i - 1:i + 2], y[i - 1:i + 2], 2)
    return float(np.exp(-b / (2 * a))), f"parabola in ln lr through {np.exp(x[i - 1]):.3g}-{np.exp(x[i + 1]):.3g}"


def stage_lr(out: Path, docs: Path, jobs: int, bin_dir: Path) -> Dict[str, float]:
    specs = [(n, c, lr) for n, c, lrs in LR_POINTS for lr in lrs]
    runs = [Run(["experiment=isoflop", *STUDY, f"scaling.flops={c:g}", f"scaling.params={n}",
                 "scaling.lr_ref_flops=null", "scaling.lr_flops_exponent=0", f"optim.lr={lr:g}"],
                out / "lr" / f"C{c:g}-N{n}-lr{lr:g}", f"lr N={n} C={c:g} lr={lr:g}", _cost(c, n))
            for n, c, lr in specs]
    rows = [(n, c, lr, info.final_val_loss, info.tokens, r.command)
            for (n, c, lr), r, info in zip(specs, runs, run_all(runs, jobs, bin_dir)) if info]
    best = {}
    for n, c, lrs in LR_POINTS:
        got = sorted((lr, v) for m, cc, lr, v, _, _ in rows if (m, cc) == (n, c))
        if len(got) >= 3:
            best[(n, c)], how = best_lr([g[0] for g in got], [g[1] for g in got])
            print(f"  N={n} C={c:g}: best lr {best[(n, c)]:.3g} ({how})")
        print(f"  N={n} C={c:g}: " + ", ".join(f"lr {lr:g} -> {v:.4f}" for lr, v in got))
    (n1, c1, _), (n2, c2, _) = LR_POINTS[:2]  # the two grids, each size at about its optimal budget
    k = -math.log(best[(n2, c2)] / best[(n1, c1)]) / math.log(c2 / c1)
    print(f"  lr ∝ C^-{k:.3f}: lr(C=1e12) = {best[(n1, c1)] * (1e12 / c1) ** -k:.3g} (configs/study/cpu.yaml: "
          f"scaling.lr_ref_flops=1e12, scaling.lr_flops_exponent, optim.lr); the fixed-size rows show "
          f"the rate falls with the budget at one size")
    path = docs / "data" / "lr_sweep.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["non_embedding_params", "flops", "lr", "val_loss", "tokens", "command"])
        for n, c, lr, v, tokens, cmd in rows:
            w.writerow([n, f"{c:g}", f"{lr:g}", f"{v:.6f}", tokens, cmd])
    print(f"  wrote {path}")
    return {"flops_exponent": k}


def stage_sweep(out: Path, jobs: int, bin_dir: Path) -> List[Run]:
    tokens = train_tokens()
    lad = ladder()
    runs = []
    for c in BUDGETS:
        ns = sizes_for(c, tokens, lad)
        print(f"  C={c:g}: {len(ns)} sizes {ns}")
        runs += [Run(["experiment=isoflop", *STUDY, f"scaling.flops={c:g}", f"scaling.params={n}"],
                     out / "sweep" / f"C{c:g}-N{n}", f"C={c:g} N={n}", _cost(c, n)) for n in ns]
    run_all(runs, jobs, bin_dir)
    return runs


def _plan(args: Sequence[str], bin_dir: Path) -> None:
    cmd = [str(bin_dir / "llama-plan"), *args]
    print("$ " + shlex.join(["llama-plan", *args]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def _rel(path: Path) -> Path:
    """``path`` relative to the repo when under it (the commands run there): short, rerunnable."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def stage_fit(out: Path, docs: Path, bin_dir: Path) -> None:
    sweep, docs = _rel(out / "sweep"), _rel(docs)
    csv_path = docs / "data" / "isoflop_runs.csv"
    if (REPO / sweep).is_dir():
        _plan(["fit", str(sweep), "--params", "non_embedding", "--csv", str(csv_path), "--bootstrap", "0",
               "--bootstrap-a3", "0"], bin_dir)
    _plan(["fit", str(csv_path), "--params", "both", "--window", str(WINDOW), "--out",
           str(docs / "img" / "isoflop.png")], bin_dir)
    _plan(["fit", str(csv_path), "--params", "non_embedding", "--bootstrap", "0", "--bootstrap-a3", "0",
           "--save-fit", str(docs / "data" / "isoflop_fit.yaml")], bin_dir)


def stage_frontier(out: Path, docs: Path, jobs: int, bin_dir: Path) -> List[Dict[str, object]]:
    from llama_train.scaling.laws import load_fit

    fit = docs / "data" / "isoflop_fit.yaml"
    law = load_fit(fit)
    common = [*STUDY, f"scaling.fit={_rel(fit)}",
              f"scaling.flops={FRONTIER_FLOPS:g}"]
    runs = [Run(["experiment=compute_optimal", *common], out / "frontier" / "compute_optimal", "compute-optimal"),
            Run(["experiment=inference_optimal", *common, f"scaling.inference_tokens={INFERENCE_TOKENS:g}"],
                out / "frontier" / "inference_optimal", "inference-optimal")]
    infos = run_all(runs, jobs, bin_dir)
    target = law.loss(*law.optimal(FRONTIER_FLOPS))
    rows = []
    for r, i in zip(runs, infos):
        if i is None:
            raise SystemExit(f"frontier: {r.tag} failed: {r.log}")
        n, d = i.params["non_embedding"], i.tokens
        train, infer = 6 * n * d, 2 * n * INFERENCE_TOKENS
        rows.append({"model": r.tag, "non_embedding_params": n, "tokens": d, "tokens_per_param": d / n,
                     "target_loss": target, "predicted_loss": law.loss(n, d), "val_loss": i.final_val_loss,
                     "off_target_pct": 100 * (i.final_val_loss / target - 1), "training_flops": train,
                     "inference_flops": infer, "lifetime_flops": train + infer, "command": r.command})
    path = docs / "data" / "frontier_runs.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"  law {fit.name}: target loss {target:.4f} (the compute-optimal model of C={FRONTIER_FLOPS:g}); "
          f"D_inf = {INFERENCE_TOKENS:g} tokens")
    for row in rows:
        print(f"  {row['model']}: N={row['non_embedding_params']:,} D={row['tokens']:,} "
              f"val_loss {row['val_loss']:.4f} ({row['off_target_pct']:+.2f}% vs target), lifetime "
              f"{row['lifetime_flops']:.4g} FLOPs")
    co, io = rows
    print(f"  inference-optimal / compute-optimal: N x{io['non_embedding_params'] / co['non_embedding_params']:.3f}, "
          f"D x{io['tokens'] / co['tokens']:.3f}, lifetime FLOPs x{io['lifetime_flops'] / co['lifetime_flops']:.3f}")
    print(f"  wrote {path}")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_train.scaling.study", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    p.add_argument("--out", default="outputs/study", help="where the runs go (rerun: finished runs are kept)")
    p.add_argument("--docs", default=str(REPO / "docs"), help="where the CSVs, the fit and the plot go")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    ns = p.parse_args(argv)
    stages = [s.strip() for s in ns.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        p.error(f"--stages: unknown {bad}; choose from {', '.join(STAGES)}")
    out, docs = Path(ns.out).absolute(), Path(ns.docs).absolute()
    bin_dir = Path(sys.executable).parent
    t0 = time.time()
    for stage in stages:
        print(f"== {stage} ==", flush=True)
        if stage == "lr":
            stage_lr(out, docs, ns.jobs, bin_dir)
        elif stage == "sweep":
            stage_sweep(out, ns.jobs, bin_dir)
        elif stage == "fit":
            stage_fit(out, docs, bin_dir)
        else:
            stage_frontier(out, docs, ns.jobs, bin_dir)
    print(f"study: {', '.join(stages)} in {(time.time() - t0) / 60:.1f} min; reproduce: "
          f"python -m llama_train.scaling.study --stages {','.join(stages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
