"""``llama-plan fit``: Approach 2 and 3 on a sweep directory or runs CSV, with bootstrap
intervals, as tables or JSON (the fits themselves: :mod:`llama_train.scaling.fit`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Dict

from llama_train.scaling.cli_format import _si, _table
from llama_train.scaling.laws import ScalingError
from llama_train.scaling.runs import REPEAT_HALF_LIFE


def _fit_each(ns: argparse.Namespace, path: Path, conventions, repro: str):
    """analyse_runs for each parameter convention: (analyses, reports, extra outputs)."""
    from llama_train.scaling.fit import analyse_runs
    from llama_train.scaling.plots import plot_isoflops
    from llama_train.scaling.runs import load_runs, write_runs_csv

    analyses, reports, extra = {}, {}, {}
    for i, conv in enumerate(conventions):
        runs, skipped = load_runs(path, params=conv)
        if ns.min_flops:
            def budget(r):  # the nominal budget it was planned on, else its own FLOPs
                return r.budget if r.budget is not None else r.flops
            skipped += [{"run": r.run, "reason": f"budget {budget(r):g} < --min-flops {ns.min_flops:g}"}
                        for r in runs if budget(r) < ns.min_flops]
            runs = [r for r in runs if budget(r) >= ns.min_flops]
        for r in runs:
            r.repeat_half_life = ns.repeat_half_life
        if i == 0 and ns.csv:  # before any check, so a sweep too small to fit can still be exported
            extra["csv"] = str(write_runs_csv(runs, ns.csv, params=conv))
        if len(runs) < 5:
            raise ScalingError(
                f"fit: {len(runs)} usable run(s) under {path} with {conv} params (need >= 5: run dirs with "
                f"metrics.jsonl holding a val_loss and run_info.json, or CSV rows); skipped: {skipped[:5]}")
        an = analyse_runs(runs, params=conv, top_k=ns.top_k, bootstrap=ns.bootstrap, bootstrap_a3=ns.bootstrap_a3,
                          bootstrap_top_k=ns.bootstrap_top_k, seed=ns.seed, window=ns.window,
                          name=(path.stem if path.is_file() else path.name) or "fitted")
        rep = {**an.to_dict(), "source": str(path), "runs": [vars(r) for r in runs], "skipped": skipped,
               "command": repro}
        if ns.out:
            out = Path(ns.out) if i == 0 else Path(ns.out).with_name(f"{Path(ns.out).stem}.{conv}{Path(ns.out).suffix}")
            rep["plot"] = str(plot_isoflops(runs, an.approach3.law if an.approach3 else None, out, an.approach2,
                                            approach3_ci=an.approach3_bootstrap, params=conv))
        analyses[conv], reports[conv] = an, rep
    return analyses, reports, extra


def _ci(v, fmt="{:.4g}"):
    return f"[{fmt.format(v[0])}, {fmt.format(v[1])}]" if v else "n/a"


def _boot_line(b, what):
    if b is None:
        return f"  bootstrap: off ({what} 0)"
    why = ", ".join(f"{k} {v}" for k, v in sorted(b.failures.items()))
    return (f"  bootstrap: {b.n_resamples} resamples of the runs within each budget, seed {b.seed}; "
            f"{b.n_failed} failed{f' ({why})' if why else ''}; intervals are the 2.5/97.5 percentiles of the "
            f"{b.n_resamples - b.n_failed} others" + ("" if b.ci else " (none: fewer than 10 succeeded)")
            + ("\n  WARNING: over 10% of the resamples failed; the interval covers only those that did, so it is "
               "too narrow (a budget with few runs or sizes is the usual cause: sample more sizes)"
               if b.n_failed > 0.1 * b.n_resamples else ""))


def _noise_line(nm) -> str:
    """Approach 3's misses against the seeds' spread: which one limits its intervals."""
    per = ", ".join(f"{c:.3g} {100 * m:+.1f}%" for c, m in nm.budget_residual)
    if nm.seed_sd is None:
        seeds = "no point was run with two seeds, so the seeds' share of it is unknown"
    else:
        seeds = (f"one run's seed sd {nm.seed_sd:.4f} (pooled over {nm.repeated_points} points run with 2+ seeds, "
                 f"{nm.dof} dof)" + ("; the law misses by more than the seeds differ there: more seeds at those points "
                                     "narrow its intervals little" if nm.rms_residual > 2 * nm.seed_sd else ""))
    return f"  misfit: rms log residual {nm.rms_residual:.4f}, mean per budget (law over runs) {per}; {seeds}"


def _print_analysis(an, rep: Dict[str, Any], path: Path, conv: str, several: bool,
                    ns: argparse.Namespace) -> None:
    """One parameter convention's fits as tables (llama-plan fit without --json)."""
    from llama_train.scaling.approach2 import FLAG_TEXT, REFUSALS

    a2, a3, law = an.approach2, an.approach3, an.approach3.law if an.approach3 else None
    if several:
        print(f"=== N = {conv} parameters ===")
    print(f"{len(an.runs)} runs from {path} (N = {conv} parameters), {len(an.groups)} IsoFLOP budget(s)")
    rows = []
    for p in a2.parabolas:
        n3 = law.optimal(p.flops) if law else None
        rows.append([f"{p.flops:.3g}", p.n_runs, f"{_si(p.n_min)}-{_si(p.n_max)}",
                     _si(p.n_opt) if p.n_opt else "-", f"[{_si(p.n_opt_ci[0])}, {_si(p.n_opt_ci[1])}]" if p.n_opt_ci else "-",
                     f"{p.loss_at_min:.4f}" if p.loss_at_min is not None else "-",
                     _si(n3[0]) if n3 else "-", f"{law.loss(*n3):.4f}" if n3 else "-",
                     "yes" if p.used else "NO", ", ".join(p.flags) or "-"])
    print(_table(rows, ["budget (FLOPs)", "runs", "N range", "A2 N_opt", "95% CI", "A2 loss@min",
                        "A3 N_opt", "A3 loss", "used", "flags"]))
    flags = sorted({f for p in a2.parabolas for f in p.flags})
    for f in flags:
        print(f"  {f}: {FLAG_TEXT[f]}" + (" (budget not used by Approach 2)" if f in REFUSALS else " (warning)"))
    near = f" over the runs within {ns.window} sizes of its best" if ns.window is not None else ""
    print(f"Approach 2 (Hoffmann et al. Sec. 3.2: parabola of loss in ln N per budget{near}, power laws over "
          f"{len(a2.used)} of {len(a2.parabolas)} budgets):")
    if a2.n_opt_law:
        bci = a2.bootstrap.ci if a2.bootstrap else {}
        print(f"  N_opt = k_N C^a: a = {a2.n_opt_law.exponent:.4f}  95% CI {_ci(bci.get('a'), '{:.4f}')}  "
              f"k_N = {a2.n_opt_law.k:.4g}")
        print(f"  D_opt = k_D C^b: b = {a2.d_opt_law.exponent:.4f}  95% CI {_ci(bci.get('b'), '{:.4f}')}  "
              f"k_D = {a2.d_opt_law.k:.4g}  (D_opt = C/(6 N_opt), so b = 1 - a)")
        print(_boot_line(a2.bootstrap, "--bootstrap"))
    else:
        print(f"  no power law: {a2.error}")
    if law:
        bci = an.approach3_bootstrap.ci if an.approach3_bootstrap else {}
        print(f"Approach 3 (App. D.2): L(N,D) = E + A/N^alpha + B/D^beta on {a3.n_points} runs, Huber "
              f"delta={a3.delta:g} on log loss, best of {a3.n_starts} L-BFGS starts; rms log residual "
              f"{a3.rms_log_residual:.4f}; repeated tokens discounted with R*={an.runs[0].repeat_half_life:g}"
              f" ({sum(r.effective_tokens < r.tokens for r in an.runs)} runs read their data more than once)")
        print(_table([[k, f"{getattr(law, k):.5g}", _ci(bci.get(k))] for k in ("E", "A", "B", "alpha", "beta")]
                     + [["a = beta/(alpha+beta)", f"{law.a:.4f}", _ci(bci.get("a"), "{:.4f}")],
                        ["b = alpha/(alpha+beta)", f"{law.b:.4f}", _ci(bci.get("b"), "{:.4f}")]],
                     ["", "value", "95% CI"]))
        print(f"  compute-optimal: N_opt ∝ C^{law.a:.4f}, D_opt ∝ C^{law.b:.4f}, G={law.G:.4g}")
        b = an.approach3_bootstrap
        print(_boot_line(b, "--bootstrap-a3") + (f"; {ns.bootstrap_top_k} L-BFGS starts per refit "
                                                f"(+ the full-data optimum)" if b else ""))
        print(_noise_line(an.noise))
    else:
        print(f"Approach 3: no fit: {an.approach3_error}")
    if rep["skipped"]:
        print(f"skipped {len(rep['skipped'])} run(s): "
              + "; ".join(f"{s['run']}: {s['reason']}" for s in rep["skipped"][:10]))
    if ns.out:
        print(f"plot: {rep['plot']}")


def _planned_count(path: Path) -> str:
    """--params auto: the count every run's budget was planned on when they all recorded the
    same one (RunInfo.count, the CSV's count column), else total (Chinchilla's N)."""
    from llama_train.scaling.runs import load_runs

    runs, _ = load_runs(path, params="total")
    counts = {r.count for r in runs}
    return counts.pop() if len(counts) == 1 and None not in counts else "total"


def _cmd_fit(ns: argparse.Namespace) -> Dict[str, Any]:
    """Approach 2 and 3 on a sweep directory or runs CSV, with bootstrap intervals; table or JSON."""
    import shlex

    path = Path(ns.sweep_dir)
    if ns.params == "auto":
        ns.params = _planned_count(path)
    if ns.window == 0:
        ns.window = None
    conventions = ["total", "non_embedding"] if ns.params == "both" else [ns.params]
    repro = "llama-plan fit " + shlex.join([
        str(path), "--params", ns.params, "--window", str(ns.window or 0),
        "--top-k", str(ns.top_k or 0), "--bootstrap", str(ns.bootstrap),
        "--bootstrap-a3", str(ns.bootstrap_a3), "--bootstrap-top-k", str(ns.bootstrap_top_k), "--seed", str(ns.seed),
        "--repeat-half-life", f"{ns.repeat_half_life:g}", *(["--min-flops", f"{ns.min_flops:g}"] if ns.min_flops else [])])
    if not (ns.repeat_half_life > 0 and math.isfinite(ns.repeat_half_life)):
        raise ScalingError(f"--repeat-half-life={ns.repeat_half_life:g} must be a finite number > 0 "
                           f"(R* of Muennighoff et al.'s discount of repeated tokens; theirs is {REPEAT_HALF_LIFE:g})")
    if ns.window is not None and ns.window < 0:
        raise ScalingError(f"--window={ns.window} must be >= 0 (sizes either side of the best run; 0: all runs)")
    for k in ("bootstrap", "bootstrap_a3"):
        if getattr(ns, k) < 0:
            raise ScalingError(f"--{k.replace('_', '-')}={getattr(ns, k)} must be >= 0")
    analyses, reports, extra = _fit_each(ns, path, conventions, repro)
    first = analyses[conventions[0]]
    if ns.save_fit:
        if first.approach3 is None:
            raise ScalingError(f"--save-fit: Approach 3 gave no fit ({first.approach3_error})")
        import yaml

        Path(ns.save_fit).parent.mkdir(parents=True, exist_ok=True)  # configs/scaling/ is new
        Path(ns.save_fit).write_text(yaml.safe_dump(first.approach3.law.to_dict(), sort_keys=False))
        extra["saved_fit"] = ns.save_fit
    if ns.params == "both":
        res = {"params_convention": "both", "by_params": reports, "command": repro, **extra,
               "comparison": {c: {"approach2_a": r["approach2"].get("a"), "approach2_a_ci": r["approach2"].get("a_ci"),
                                  "approach3_a": r["approach3"].get("a"), "approach3_a_ci": r["approach3"].get("a_ci")}
                              for c, r in reports.items()}}
    else:
        res = {**reports[conventions[0]], **extra}
    if ns.json:
        return res

    for conv in conventions:
        _print_analysis(analyses[conv], reports[conv], path, conv, len(conventions) > 1, ns)
    if ns.params == "both":
        print("=== compare parameter counts ===")
        print(_table([[c, f"{v['approach2_a']:.4f}" if v["approach2_a"] is not None else "-",
                       _ci(v["approach2_a_ci"], "{:.4f}"),
                       f"{v['approach3_a']:.4f}" if v["approach3_a"] is not None else "-",
                       _ci(v["approach3_a_ci"], "{:.4f}")] for c, v in res["comparison"].items()],
                     ["N", "A2 a", "95% CI", "A3 a", "95% CI"]))
    if ns.csv:
        print(f"runs written to {extra['csv']} (reads back as: llama-plan fit {extra['csv']})")
    if ns.save_fit:
        print(f"Approach 3 fit ({conventions[0]} params) saved to {ns.save_fit} (use it with --fit {ns.save_fit})")
    print(f"reproduce: {repro}")
    return res
