"""Approach 2 (IsoFLOP parabolas), bootstrap intervals, runs CSV and ``llama-plan fit`` end to end.

Synthetic sweeps from a known law L(N, D) = E + A/N^alpha + B/D^beta with small multiplicative
noise; no training. Hoffmann et al. 2022 (arXiv:2203.15556) Sec. 3.2 (Approach 2) and App. D.2.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llama_train.metrics.plot import plot_isoflops
from llama_train.scaling import CHINCHILLA, LossLaw, ScalingError, collect_runs
from llama_train.scaling.cli import main
from llama_train.scaling.fit import (
    REFUSALS,
    RunPoint,
    analyse_runs,
    bootstrap_approach3,
    fit_approach2,
    fit_loss_law,
    load_runs,
    load_runs_csv,
    write_runs_csv,
)

# alpha == beta, so the compute-optimal a = beta / (alpha + beta) = 0.5 exactly
HALF = LossLaw(E=1.8, A=400.0, B=400.0, alpha=0.34, beta=0.34, name="a=0.5")
BUDGETS = (1e17, 1e18, 1e19, 1e20, 1e21)
# the sizes are not centred on the optimum (nor are real sweeps'): offsets in decades per budget
SHIFTS = (0.2, -0.1, 0.0, 0.15, -0.2)


def synth_runs(law, budgets=BUDGETS, sizes=7, noise=0.005, seed=0, span=0.9, shifts=SHIFTS):
    """``sizes`` models per budget over +-``span`` decades around the true optimum (shifted), D = C/(6N)."""
    rng = np.random.default_rng(seed)
    runs = []
    for j, c in enumerate(budgets):
        n0 = law.optimal(c)[0]
        for n in n0 * np.logspace(-span + shifts[j], span + shifts[j], sizes):
            d = c / (6 * n)
            loss = float(law.loss(n, d)) * math.exp(rng.normal(0.0, noise))
            runs.append(RunPoint(run=f"c{j}/n{n:.4g}", n_params=float(n), tokens=float(d), flops=c, val_loss=loss,
                                 budget=c, total_params=float(n), non_embedding_params=0.8 * float(n),
                                 command=f"llama-train experiment=isoflop scaling.flops={c:g} scaling.params={n:.4g}"))
    return runs


def write_sweep_dir(root, runs):
    """The layout the trainer leaves: one dir per run with metrics.jsonl and run_info.json."""
    for r in runs:
        d = root / r.run
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n"
                                         + json.dumps({"step": 2, "val_loss": r.val_loss}) + "\n")
        info = {"params": {"total": r.total_params, "non_embedding": r.non_embedding_params}, "tokens": r.tokens,
                "flops": 6 * r.n_params * r.tokens, "flop_budget": r.budget, "command": r.command}
        (d / "run_info.json").write_text(json.dumps(info))


@pytest.fixture(scope="module")
def half_analysis():
    runs = synth_runs(HALF)
    return analyse_runs(runs, top_k=16, bootstrap=200, bootstrap_a3=30, bootstrap_top_k=4, seed=0)


# ------------------------------------------------------------------------------------------
# Approach 2 and Approach 3 recover a known exponent
# ------------------------------------------------------------------------------------------

def test_approach2_recovers_a_within_its_interval(half_analysis):
    a2 = half_analysis.approach2
    assert a2.error is None and len(a2.used) == 5
    a, (lo, hi) = a2.n_opt_law.exponent, a2.bootstrap.ci["a"]
    assert abs(a - 0.5) < 0.05 and lo <= 0.5 <= hi and hi - lo < 0.15, (a, lo, hi)
    # D_opt = C / (6 N_opt), so the two exponents add to 1, resample by resample
    assert a2.d_opt_law.exponent == pytest.approx(1 - a, abs=1e-12)
    assert a2.bootstrap.ci["b"] == pytest.approx((1 - hi, 1 - lo), abs=1e-12)
    # every budget's minimum sits near the true optimum and inside its bootstrap interval's ballpark
    for p in a2.parabolas:
        assert p.n_opt == pytest.approx(HALF.optimal(p.flops)[0], rel=0.3)
        assert p.n_opt_ci[0] <= p.n_opt <= p.n_opt_ci[1]
        assert p.d_opt == pytest.approx(p.flops / (6 * p.n_opt))
    # failed resamples are counted with their reasons, and left out of the interval
    boot = a2.bootstrap
    assert boot.n_failed < 0.1 * boot.n_resamples and (boot.n_failed > 0) == bool(boot.failures)
    assert boot.samples["a"].size == boot.n_resamples - boot.n_failed


def test_approach3_recovers_a_within_its_interval(half_analysis):
    law, boot = half_analysis.approach3.law, half_analysis.approach3_bootstrap
    assert abs(law.a - 0.5) < 0.05
    for k in ("a", "alpha", "beta"):
        lo, hi = boot.ci[k]
        assert lo <= getattr(HALF, k) <= hi, (k, lo, hi)
    assert boot.ci["b"][0] <= 0.5 <= boot.ci["b"][1]
    assert set(boot.ci) == {"E", "A", "B", "alpha", "beta", "a", "b"} and boot.n_failed == 0


def test_approach2_on_chinchillas_asymmetric_law():
    """alpha != beta: the IsoFLOP slice is not a parabola in ln N, yet a comes out right."""
    a2 = fit_approach2(synth_runs(CHINCHILLA, seed=1), bootstrap=200, seed=0)
    lo, hi = a2.bootstrap.ci["a"]
    assert abs(a2.n_opt_law.exponent - CHINCHILLA.a) < 0.05 and lo <= CHINCHILLA.a <= hi


# ------------------------------------------------------------------------------------------
# Refusals: a budget whose parabola gives no trustworthy minimum is flagged and not used
# ------------------------------------------------------------------------------------------

def test_budget_with_its_minimum_at_the_edge_is_flagged_and_left_out():
    # budget 3 samples only sizes above its optimum (1 to 2 decades up): loss rises monotonically
    runs = synth_runs(HALF, shifts=(0.0, 0.0, 1.5, 0.0, 0.0), span=0.5, sizes=5, noise=0.001)
    a2 = fit_approach2(runs)
    assert [p.flags for p in a2.parabolas] == [[], [], ["min_below_range"], [], []]
    assert not a2.parabolas[2].used and a2.parabolas[2].flops == pytest.approx(1e19)
    assert a2.parabolas[2].n_opt < a2.parabolas[2].n_min  # where it lies is still reported
    assert len(a2.used) == 4 and abs(a2.n_opt_law.exponent - 0.5) < 0.02
    # a downward parabola, and a 2-run budget, are refused too
    concave = [RunPoint(run=f"x{i}", n_params=n, tokens=1e22 / (6 * n), flops=1e22, val_loss=l, budget=1e22)
               for i, (n, l) in enumerate([(1e9, 2.0), (3e9, 2.2), (1e10, 2.0)])]
    pair = [RunPoint(run=f"y{i}", n_params=n, tokens=1e23 / (6 * n), flops=1e23, val_loss=2.0, budget=1e23)
            for i, n in enumerate([1e9, 1e10])]
    a2 = fit_approach2(runs + concave + pair)
    assert [p.flags for p in a2.parabolas[-2:]] == [["opens_downward"], ["too_few_runs"]]
    assert len(a2.used) == 4 and set(REFUSALS) >= {"opens_downward", "too_few_runs"}


def test_fewer_than_two_usable_budgets_is_an_error_not_a_fit():
    runs = synth_runs(HALF, budgets=(1e18, 1e19), shifts=(0.0, 1.5), span=0.5, sizes=5)
    a2 = fit_approach2(runs, bootstrap=20)
    assert a2.n_opt_law is None and "1 usable IsoFLOP budget(s) of 2" in a2.error and "1e+19" in a2.error


# ------------------------------------------------------------------------------------------
# Bootstrap determinism
# ------------------------------------------------------------------------------------------

def test_bootstrap_is_deterministic_for_a_seed():
    runs = synth_runs(HALF, budgets=BUDGETS[:3], sizes=5, seed=2)
    one, two, other = (fit_approach2(runs, bootstrap=60, seed=s).bootstrap for s in (7, 7, 8))
    assert one.ci == two.ci and np.array_equal(one.samples["a"], two.samples["a"])
    assert one.ci["a"] != other.ci["a"]
    fit = fit_loss_law([r.n_params for r in runs], [r.tokens for r in runs], [r.val_loss for r in runs], top_k=8)
    b1, b2 = (bootstrap_approach3(runs, fit, n=10, seed=7, top_k=2) for _ in range(2))
    assert b1.ci == b2.ci and b1.ci  # 10 refits: just enough for an interval


# ------------------------------------------------------------------------------------------
# CSV input and output
# ------------------------------------------------------------------------------------------

def test_csv_round_trip_gives_identical_runs_and_fits(tmp_path, capsys):
    runs = synth_runs(HALF, budgets=BUDGETS[:4], sizes=5, seed=3)
    write_sweep_dir(tmp_path / "sweep", runs)
    csv_path = tmp_path / "runs.csv"
    opts = ["--top-k", "8", "--bootstrap", "50", "--bootstrap-a3", "10", "--bootstrap-top-k", "2", "--json"]
    assert main(["fit", str(tmp_path / "sweep"), "--csv", str(csv_path), *opts]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert main(["fit", str(csv_path), *opts]) == 0
    from_csv = json.loads(capsys.readouterr().out)
    for key in ("approach2", "approach3", "budgets", "runs", "objective", "n_starts"):
        assert from_csv[key] == from_dir[key], key
    name = {"sweep", "runs"}  # the fit is named after its source
    assert {from_csv["fit"].pop("name"), from_dir["fit"].pop("name")} == name and from_csv["fit"] == from_dir["fit"]
    assert from_dir["csv"] == str(csv_path) and from_dir["approach2"]["bootstrap"]["resamples"] == 50
    # the runs themselves, both conventions, and the command column
    for params in ("total", "non_embedding"):
        assert ([vars(r) for r in load_runs_csv(csv_path, params=params)[0]]
                == [vars(r) for r in collect_runs(tmp_path / "sweep", params=params)[0]])
    header, first = csv_path.read_text().splitlines()[:2]
    assert header.startswith("flops,params,non_embedding_params,tokens,val_loss,command")
    assert "llama-train experiment=isoflop" in first


def test_csv_reader_checks_columns_and_skips_bad_rows(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("flops,params,tokens,val_loss,note\n"
                    "1e18,1e8,1.6e9,2.9,ok\n"
                    "1e18,2e8,,2.8,no tokens\n"
                    "1e18,4e8,4e8,nan,diverged\n")
    runs, skipped = load_runs_csv(path)
    assert len(runs) == 1 and runs[0].budget == 1e18 and runs[0].command == ""
    assert [s["reason"] for s in skipped] == ["line 3: tokens missing, not a number or <= 0",
                                              "line 4: val_loss missing, not a number or <= 0"]
    with pytest.raises(ScalingError, match="non_embedding_params"):
        load_runs_csv(path, params="non_embedding")
    with pytest.raises(ScalingError, match="neither a sweep directory nor a CSV"):
        load_runs(tmp_path / "missing.csv")


# ------------------------------------------------------------------------------------------
# The CLI end to end, and the plot
# ------------------------------------------------------------------------------------------

def test_cli_fit_on_a_csv_prints_both_approaches_and_writes_a_png(tmp_path, capsys):
    runs = synth_runs(HALF, shifts=(0.2, -0.1, 1.5, 0.15, -0.2), seed=4)  # budget 1e19 refused
    write_runs_csv(runs, tmp_path / "runs.csv")
    png = tmp_path / "plots" / "iso.png"
    assert main(["fit", str(tmp_path / "runs.csv"), "--out", str(png), "--top-k", "8", "--bootstrap", "100",
                 "--bootstrap-a3", "10", "--bootstrap-top-k", "2", "--seed", "1", "--window", "0"]) == 0
    out = capsys.readouterr().out
    assert "(N = total parameters)" in out and "min_below_range: minimum below the smallest sampled N" in out
    assert "power laws over 4 of 5 budgets" in out and "N_opt = k_N C^a: a = 0." in out
    assert "a = beta/(alpha+beta)" in out and "bootstrap: 100 resamples" in out and "failed" in out
    assert ("reproduce: llama-plan fit " + str(tmp_path / "runs.csv") + " --params total --window 0 --top-k 8 --bootstrap 100 "
            "--bootstrap-a3 10 --bootstrap-top-k 2 --seed 1") in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_cli_fit_params_both_reports_each_convention(tmp_path, capsys):
    write_runs_csv(synth_runs(HALF, budgets=BUDGETS[:3], sizes=5), tmp_path / "runs.csv")
    assert main(["fit", str(tmp_path / "runs.csv"), "--params", "both", "--top-k", "8", "--bootstrap", "30",
                 "--bootstrap-a3", "0", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["params_convention"] == "both" and set(res["by_params"]) == {"total", "non_embedding"}
    assert res["by_params"]["non_embedding"]["params_convention"] == "non_embedding"
    # N_ne = 0.8 N here: the same exponent, a prefactor 0.8 smaller
    tot, ne = res["by_params"]["total"]["approach2"], res["by_params"]["non_embedding"]["approach2"]
    assert ne["a"] == pytest.approx(tot["a"], abs=1e-9) and ne["k_N"] == pytest.approx(0.8 * tot["k_N"], rel=1e-9)
    assert res["comparison"]["total"]["approach3_a_ci"] is None  # --bootstrap-a3 0: no interval claimed
    assert res["by_params"]["total"]["approach3"]["bootstrap"] is None


def test_plot_isoflops_keeps_its_three_argument_form(tmp_path):
    runs = synth_runs(HALF, budgets=BUDGETS[:3], sizes=5)
    out = plot_isoflops(runs, HALF, tmp_path / "iso.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_isoflops(runs, None, tmp_path / "no_law.png").is_file()  # Approach 2 alone


def test_window_fits_each_parabola_near_its_best_run(tmp_path, capsys):
    """--window K: each budget's parabola over the runs within K sizes of its best run, the same
    in the fit and in every bootstrap resample; a wide, asymmetric sweep is where it matters."""
    from llama_train.scaling.fit import fit_approach2, fit_isoflop_parabola

    runs = synth_runs(HALF, sizes=9, span=1.2, noise=0.0)
    members = [r for r in runs if r.budget == BUDGETS[4]]  # sizes shifted off the optimum
    near = fit_isoflop_parabola(BUDGETS[4], members, window=1)
    best = min(range(len(members)), key=lambda i: members[i].val_loss)
    three = members[best - 1:best + 2]  # the synthetic sizes are in increasing order
    x = np.log([r.n_params for r in three])
    c2, c1, _ = np.polyfit(x, [r.val_loss for r in three], 2)
    assert near.n_opt == pytest.approx(math.exp(-c1 / (2 * c2)), rel=1e-9)
    # near the minimum a parabola is closer to the true optimum than over 2.4 decades
    true_n = HALF.optimal(BUDGETS[4])[0]
    wide = fit_isoflop_parabola(BUDGETS[4], members)
    assert abs(math.log(near.n_opt / true_n)) < abs(math.log(wide.n_opt / true_n))
    res = fit_approach2(runs, window=2, bootstrap=20)
    assert res.n_opt_law.exponent == pytest.approx(0.5, abs=0.03) and res.bootstrap.n_resamples == 20
    write_sweep_dir(tmp_path / "sweep", runs)
    assert main(["fit", str(tmp_path / "sweep"), "--window", "-1"]) == 2
    assert "--window=-1 must be >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Repeated tokens (Muennighoff et al. 2023) and the defaults of `llama-plan fit`
# ------------------------------------------------------------------------------------------

def test_repeated_tokens_are_worth_less_and_the_fit_says_so():
    """D' = U + U R* (1 - exp(-R/R*)): D itself within an epoch, a little less at 2 epochs.
    Runs whose losses follow L(N, D') with some of them repeating data: Approach 3 on D'
    recovers the law's exponent; on the raw token counts it does not."""
    from llama_train.scaling.runs import REPEAT_HALF_LIFE, effective_tokens

    assert effective_tokens(5e6, 1e7) == 5e6 and effective_tokens(3e7, None) == 3e7
    assert effective_tokens(2e7, 1e7) == pytest.approx(1e7 * (1 + REPEAT_HALF_LIFE * (1 - math.exp(-1 / 15.4))))
    assert 1.96e7 < effective_tokens(2e7, 1e7) < 2e7 and effective_tokens(4e7, 1e7) < 3.9e7
    runs = synth_runs(HALF, noise=0.0)
    unique = sorted(r.tokens for r in runs)[len(runs) // 2]  # half the runs read more than one epoch
    for r in runs:
        r.unique_tokens = unique
        r.val_loss = float(HALF.loss(r.n_params, r.effective_tokens))
    assert sum(r.tokens > 3 * unique for r in runs) >= 5
    fit = analyse_runs(runs, top_k=16, bootstrap=0, bootstrap_a3=0).approach3
    a_fit = fit.law.beta / (fit.law.alpha + fit.law.beta)
    for r in runs:
        r.unique_tokens = None  # the same losses read as fresh tokens
    raw = analyse_runs(runs, top_k=16, bootstrap=0, bootstrap_a3=0).approach3
    a_raw = raw.law.beta / (raw.law.alpha + raw.law.beta)
    assert fit.rms_log_residual < 1e-3 < raw.rms_log_residual  # the law fits D', not D
    assert abs(a_fit - 0.5) < 0.005 < abs(a_raw - 0.5), (a_fit, a_raw)


def test_the_repetition_discount_is_a_flag_of_fit(tmp_path, capsys):
    """Runs whose repeats are worth little (R* = 1, not Muennighoff et al.'s 15.4): fitted with
    --repeat-half-life 1 the law is exact; with the default it is not. R* <= 0 is exit 2."""
    runs = synth_runs(HALF, noise=0.0)
    unique = sorted(r.tokens for r in runs)[len(runs) // 2]
    for r in runs:
        r.unique_tokens = unique
        r.repeat_half_life = 1.0
        r.val_loss = float(HALF.loss(r.n_params, r.effective_tokens))
    write_runs_csv(runs, tmp_path / "runs.csv")
    fits = {}
    for rstar in ("1", "15.4"):
        assert main(["fit", str(tmp_path / "runs.csv"), "--bootstrap", "0", "--bootstrap-a3", "0", "--top-k", "16",
                     "--repeat-half-life", rstar, "--json"]) == 0
        fits[rstar] = json.loads(capsys.readouterr().out)
    assert fits["1"]["approach3"]["repeat_half_life"] == 1.0 and "--repeat-half-life 1" in fits["1"]["command"]
    assert fits["1"]["rms_log_residual"] < 1e-3 < fits["15.4"]["rms_log_residual"]
    assert fits["1"]["approach3"]["a"] == pytest.approx(0.5, abs=0.005)
    assert main(["fit", str(tmp_path / "runs.csv"), "--repeat-half-life", "0"]) == 2
    assert "--repeat-half-life=0 must be a finite number > 0" in capsys.readouterr().err


def test_min_flops_fits_only_the_budgets_the_law_is_for(tmp_path, capsys):
    """A smallest budget whose tiny models the form misses (here 6% above the law) pulls the
    whole fit; --min-flops leaves it out of both approaches, says which runs it skipped and
    keeps itself in the reproduce command."""
    runs = synth_runs(HALF, noise=0.0)
    for r in runs:
        if r.budget == BUDGETS[0]:
            r.val_loss *= 1.06
    write_runs_csv(runs, tmp_path / "runs.csv")
    opts = ["--bootstrap", "0", "--bootstrap-a3", "0", "--top-k", "16", "--json"]
    fits = {}
    for extra in ([], ["--min-flops", f"{BUDGETS[1]:g}"]):
        assert main(["fit", str(tmp_path / "runs.csv"), *opts, *extra]) == 0
        fits[bool(extra)] = json.loads(capsys.readouterr().out)
    assert fits[True]["rms_log_residual"] < 1e-3 < fits[False]["rms_log_residual"]
    assert fits[True]["approach3"]["a"] == pytest.approx(0.5, abs=0.005)
    assert len(fits[True]["runs"]) == len(runs) - 7
    assert {s["run"] for s in fits[True]["skipped"]} == {r.run for r in runs if r.budget == BUDGETS[0]}
    assert f"--min-flops {BUDGETS[1]:g}" in fits[True]["command"] and "--min-flops" not in fits[False]["command"]


def test_fit_defaults_to_the_count_the_runs_were_planned_on(tmp_path, capsys):
    """A runs CSV (or sweep) whose runs recorded scaling.count=non_embedding is fitted on that
    count without flags, Approach 2 over the runs within DEFAULT_WINDOW sizes of each best; the
    CSV keeps unique_tokens and count through a write and a read."""
    from llama_train.scaling.approach2 import DEFAULT_WINDOW
    from llama_train.scaling.runs import load_runs_csv

    runs = synth_runs(HALF, budgets=BUDGETS[:4], sizes=7)
    for r in runs:
        r.count, r.unique_tokens = "non_embedding", 1e12
    write_runs_csv(runs, tmp_path / "runs.csv")
    back, _ = load_runs_csv(tmp_path / "runs.csv")
    assert [(r.count, r.unique_tokens) for r in back] == [("non_embedding", 1e12)] * len(runs)
    assert main(["fit", str(tmp_path / "runs.csv"), "--bootstrap", "0", "--bootstrap-a3", "0", "--top-k", "8",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["params_convention"] == "non_embedding"
    assert f"--params non_embedding --window {DEFAULT_WINDOW} " in res["command"]
    runs[0].count = "total"  # runs that disagree: Chinchilla's total count
    write_runs_csv(runs, tmp_path / "mixed.csv")
    assert main(["fit", str(tmp_path / "mixed.csv"), "--bootstrap", "0", "--bootstrap-a3", "0", "--top-k", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params_convention"] == "total"


def test_a_sweep_older_than_the_count_field_reads_it_from_config_yaml(tmp_path):
    """run_info.json written before it recorded "count": the run's config.yaml says scaling.count."""
    runs = synth_runs(HALF, budgets=BUDGETS[:2], sizes=3)
    write_sweep_dir(tmp_path / "sweep", runs)
    for i, r in enumerate(runs):
        mode = "none" if i == 0 else "fixed"
        (tmp_path / "sweep" / r.run / "config.yaml").write_text(f"scaling:\n  mode: {mode}\n  count: non_embedding\n")
    got, _ = collect_runs(tmp_path / "sweep")
    assert sorted(str(r.count) for r in got) == ["None"] + ["non_embedding"] * (len(runs) - 1)


def test_misfit_is_told_apart_from_the_seeds_noise(tmp_path, capsys):
    """Runs exactly on the law but for one point run twice, its seeds e either side: the seeds'
    pure error is e*sqrt(2) (1 dof), the law's rms residual only that point's share, and every
    budget's mean residual 0. The CLI says so, and warns when the law misses by more than the
    seeds differ."""
    from llama_train.scaling.approach3 import noise_and_misfit
    from llama_train.scaling.runs import group_budgets

    e = 0.001
    runs = synth_runs(HALF, noise=0.0)
    twin = runs[3]
    runs[3:4] = [RunPoint(**{**vars(twin), "run": twin.run + s, "val_loss": twin.val_loss * math.exp(k * e)})
                 for s, k in (("", 1), ("-seed7", -1))]
    nm = noise_and_misfit(HALF, group_budgets(runs))
    assert (nm.repeated_points, nm.dof) == (1, 1)
    assert nm.seed_sd == pytest.approx(e * math.sqrt(2))
    assert nm.rms_residual == pytest.approx(e * math.sqrt(2 / len(runs)))
    assert [c for c, _ in nm.budget_residual] == list(BUDGETS)
    assert all(abs(m) < 1e-12 for _, m in nm.budget_residual)
    # one budget 3% above the law: refitted, the law misses it (and so the others) by more than the
    # seeds differ
    off = [RunPoint(**{**vars(r), "val_loss": r.val_loss * (1.03 if r.budget == BUDGETS[0] else 1.0)}) for r in runs]
    write_runs_csv(off, tmp_path / "runs.csv")
    assert main(["fit", str(tmp_path / "runs.csv"), "--top-k", "8", "--bootstrap", "0", "--bootstrap-a3", "0"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "misfit:" in ln][0]
    assert "(law over runs) 1e+17 -" in line and "pooled over 1 points run with 2+ seeds, 1 dof" in line
    assert "the law misses by more than the seeds differ there" in line
    assert main(["fit", str(tmp_path / "runs.csv"), "--top-k", "8", "--bootstrap", "0", "--bootstrap-a3", "0",
                 "--json"]) == 0
    noise = json.loads(capsys.readouterr().out)["approach3"]["noise"]
    assert noise["repeated_points"] == 1 and noise["budget_mean_log_residual"][0]["flops"] == BUDGETS[0]


def test_without_repeated_points_the_seeds_share_is_unknown(capsys, tmp_path):
    write_runs_csv(synth_runs(HALF), tmp_path / "runs.csv")
    assert main(["fit", str(tmp_path / "runs.csv"), "--top-k", "8", "--bootstrap", "0", "--bootstrap-a3", "0"]) == 0
    assert "no point was run with two seeds" in capsys.readouterr().out
