"""Tests for the scaling package (llama_train.scaling) and its CLI, llama-plan.

Published figures are checked with tolerances that reflect how they were rounded in print.
Sources:
  [H22]  Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", arXiv:2203.15556.
  [B24]  Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt", arXiv:2404.10102.
  [S24]  Sardana, Portes, Doubov, Frankle 2024, "Beyond Chinchilla-Optimal", arXiv:2401.00448.
  [S24-code] the authors' repository github.com/nikhilsardana/beyond-chinchilla (README examples).
  [ZeRO] Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

from llama_train.config import ConfigError, ScalingConfig
from llama_train.model import ModelArgs, Transformer, count_params, load_preset
from llama_train.scaling import (
    APPROACH1,
    APPROACH2,
    CHINCHILLA,
    EPOCH,
    GOPHER_FLOPS,
    HOFFMANN_TABLE3_APPROACH1,
    HOFFMANN_TABLEA3_APPROACH3,
    SARDANA,
    LossLaw,
    ScalingError,
    activation_memory,
    collect_runs,
    compute_optimal,
    fit_loss_law,
    inference_optimal,
    load_fit,
    model_info,
    model_memory,
    plan_experiment,
    shape_for_params,
)
from llama_train.scaling.cli import main


# ------------------------------------------------------------------------------------------
# Compute-optimal closed form (Approach 3)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("law", [CHINCHILLA, SARDANA, EPOCH], ids=lambda l: l.name)
@pytest.mark.parametrize("flops", [1e18, 1e21, 5.76e23, 1e26])
def test_closed_form_spends_the_budget_and_minimises_loss(law, flops):
    res = compute_optimal(flops, fit=law.name)
    n, d = res["n_params"], res["n_tokens"]
    assert 6 * n * d == pytest.approx(flops, rel=1e-10)
    # first-order condition on the IsoFLOP curve: equal marginal gains per e-fold of N and D
    assert law.alpha * law.A / n**law.alpha == pytest.approx(law.beta * law.B / d**law.beta, rel=1e-9)
    # independent check: brute-force minimum over a fine grid of N on the IsoFLOP curve
    ns = np.exp(np.linspace(math.log(n) - 3, math.log(n) + 3, 200_001))
    n_grid = ns[np.argmin(law.loss(ns, flops / (6 * ns)))]
    assert n == pytest.approx(n_grid, rel=1e-4)
    assert res["loss"] == pytest.approx(law.loss(n, d), rel=1e-12)


def test_published_exponents():
    # [H22] Table 2: Approach 3 gives a = 0.46, b = 0.54 (two decimals). The printed constants
    # (Eq. 10: alpha 0.34, beta 0.28) give 0.4516 -- within the rounding of those constants.
    assert CHINCHILLA.a == pytest.approx(0.46, abs=0.01) and CHINCHILLA.b == pytest.approx(0.54, abs=0.01)
    assert round(SARDANA.a, 2) == 0.46 and round(SARDANA.b, 2) == 0.54
    # [B24]: the refit implies a = beta / (alpha + beta) = 0.5126
    assert EPOCH.a == pytest.approx(0.5126, abs=5e-5)


def test_approach3_at_gophers_budget_is_40b():
    # [H22] Fig. 4 caption: "We project the optimal model size given the Gopher FLOP budget to be
    # 40B parameters" (Gopher budget 5.76e23, Table 3). The less-rounded exponents (sardana fit)
    # reproduce it; the printed 0.34/0.28 land ~20% lower, which is why both fits are offered.
    n_s = compute_optimal(GOPHER_FLOPS, fit="sardana")["n_params"]
    assert n_s == pytest.approx(40e9, rel=0.05)
    n_c = compute_optimal(GOPHER_FLOPS, fit="chinchilla")["n_params"]
    assert 0.7 * 40e9 < n_c < 0.85 * 40e9


@pytest.mark.parametrize("row", HOFFMANN_TABLEA3_APPROACH3, ids=lambda r: f"{r[0]:.0e}")
def test_approach3_reproduces_hoffmann_table_a3(row):
    # [H22] Table A3, Approach 3 columns: (params, FLOPs, tokens). FLOPs are printed to 3 significant
    # digits and tokens to 2-4, and the table's own 6ND differs from its FLOPs by up to 4% (280B row),
    # hence 4% on N and 7% on D.
    n_tab, flops, d_tab = row
    res = compute_optimal(flops, fit="sardana")
    assert res["n_params"] == pytest.approx(n_tab, rel=0.04)
    assert res["n_tokens"] == pytest.approx(d_tab, rel=0.07)


def test_approach1_and_2_power_laws():
    # [H22] Table 3 (Approach 1): 67B params and 1.5T tokens at Gopher's 5.76e23 FLOPs. Our D is
    # C / (6 N) (the paper counts FLOPs in more detail, App. F), 1.43T, within 6% of the printed 1.5T.
    a1 = compute_optimal(GOPHER_FLOPS)["approaches"]["approach1"]
    assert a1["n_params"] == pytest.approx(67e9, rel=0.03)
    assert a1["n_tokens"] == pytest.approx(1.5e12, rel=0.06)
    assert a1["a"] == 0.50 and APPROACH2.a == 0.49  # [H22] Table 2
    # every Table 3 row within 5%, and the ~20 tokens per parameter rule of thumb
    for n_tab, flops, d_tab in HOFFMANN_TABLE3_APPROACH1:
        n, d = APPROACH1.optimal(flops)
        assert n == pytest.approx(n_tab, rel=0.05)
        assert 19.0 < d / n < 23.0 and 19.0 < d_tab / n_tab < 23.0
    # [H22] Fig. 3 (Approach 2): 63B parameters at the Gopher budget (green marker label)
    a2 = compute_optimal(GOPHER_FLOPS)["approaches"]["approach2"]
    assert a2["n_params"] == pytest.approx(63e9, rel=0.03)


def test_epoch_refit_is_about_20_tokens_per_param():
    # [B24]: with the refit, the compute-optimal D/N is ~20 (near-constant since alpha ~ beta)
    for c in (1e21, 1e23, 1e25):
        res = compute_optimal(c, fit="epoch")
        assert 15 < res["tokens_per_param"] < 25


def test_fit_loading_and_errors(tmp_path):
    assert load_fit("Hoffmann") is CHINCHILLA and load_fit("besiroglu") is EPOCH
    f = tmp_path / "mine.yaml"
    f.write_text("E: 2.0\nA: 100.0\nB: 300.0\nalpha: 0.3\nbeta: 0.3\n")
    law = load_fit(str(f))
    assert law.name == "mine" and law.E == 2.0
    assert compute_optimal(1e20, fit=str(f))["tokens_per_param"] == pytest.approx(3.0 ** (1 / 0.3), rel=1e-9)
    bad = tmp_path / "bad.yaml"
    bad.write_text("E: 2.0\nA: 100.0\nalpha: 0.3\nbeta: 0.3\n")
    with pytest.raises(ScalingError, match=r"missing key\(s\) \['B'\]"):
        load_fit(str(bad))
    bad.write_text("E: 2.0\nA: 100.0\nB: 1\nalpha: -0.3\nbeta: 0.3\n")
    with pytest.raises(ScalingError, match="alpha"):
        load_fit(str(bad))
    with pytest.raises(ScalingError, match="neither a built-in fit"):
        load_fit("no_such_fit")
    with pytest.raises(ScalingError, match="flops"):
        compute_optimal(-1.0)


# ------------------------------------------------------------------------------------------
# Inference-optimal (Sardana et al.)
# ------------------------------------------------------------------------------------------
# [S24] works with A=406.4, B=410.7, E=1.69, alpha=0.336, beta=0.283 (the "sardana" fit). The
# paper-text figures below were read in quotations of the paper (Fig. 1 caption, Sec. 2 text),
# the [S24-code] figures in the authors' README; all are reproduced by our solver.

def test_sardana_fig1_13b_with_2t_inference_tokens():
    # [S24] Fig. 1: "An LLM developer seeking to train a 13B model who expects 2 trillion tokens of
    # inference demand ... can reduce their total compute by 1.7 x 10^22 FLOPs (17%) by instead
    # training a 7B model on more data."
    res = inference_optimal(reference_params=13e9, inference_tokens=2e12, fit="sardana")
    assert res["baseline"]["n_params"] == pytest.approx(13e9, rel=1e-9)
    assert res["n_params"] == pytest.approx(7e9, rel=0.03)
    assert res["savings"]["flops"] == pytest.approx(1.7e22, abs=0.05e22)
    assert res["savings"]["percent"] == pytest.approx(17.0, abs=0.5)


def test_sardana_sec2_examples():
    # [S24] Sec. 2: a 7B-Chinchilla-quality model with 1e11 inference tokens -> "a 6B parameter
    # model on 1.18x the original (Chinchilla-prescribed) amount of data".
    res = inference_optimal(reference_params=7e9, inference_tokens=1e11, fit="sardana")
    assert res["n_params"] == pytest.approx(6e9, rel=0.01)
    assert res["token_ratio"] == pytest.approx(1.18, abs=0.005)
    # [S24] Sec. 2: 30B-Chinchilla-quality, 1e13 inference tokens -> "a 13.6B model on 2.84x the
    # data", 28% fewer total FLOPs.
    res = inference_optimal(reference_params=30e9, inference_tokens=1e13, fit="sardana")
    assert res["n_params"] == pytest.approx(13.6e9, abs=0.05e9)
    assert res["token_ratio"] == pytest.approx(2.84, abs=0.005)
    assert res["savings"]["percent"] == pytest.approx(28.0, abs=0.5)


def test_sardana_code_readme_examples():
    # [S24-code] README: "model_calculator.py --model 70e9 --data 1e12" -> loss 1.947, then
    # "compute_optimal.py --loss 1.947 --inference_tokens 2e12" -> 2.418e+10 params, 2.657e+12
    # tokens, 70.96% of the params and 146.77% of the tokens of the equal-quality Chinchilla-style
    # model, 95.22% of its FLOPs.
    assert SARDANA.loss(70e9, 1e12) == pytest.approx(1.947, abs=5e-4)
    res = inference_optimal(target_loss=1.947, inference_tokens=2e12, fit="sardana")
    assert res["n_params"] == pytest.approx(2.418e10, abs=0.0005e10)
    assert res["n_tokens"] == pytest.approx(2.657e12, abs=0.0005e12)
    assert 100 * res["param_ratio"] == pytest.approx(70.96, abs=0.005)
    assert 100 * res["token_ratio"] == pytest.approx(146.77, abs=0.005)
    assert 100 - res["savings"]["percent"] == pytest.approx(95.22, abs=0.005)
    # README, cost_calculator example: a 30B Chinchilla-optimal model -> 1.556e+12 tokens,
    # final loss 1.958253360475841, 2.801e+23 training FLOPs
    co = compute_optimal(SARDANA.flops_where_optimal(30e9), fit="sardana")
    assert co["n_params"] == pytest.approx(30e9, rel=1e-9)
    assert co["n_tokens"] == pytest.approx(1.556e12, abs=0.0005e12)
    assert co["loss"] == pytest.approx(1.958253360475841, abs=1e-12)
    assert co["flops"] == pytest.approx(2.801e23, abs=0.0005e23)


def test_inference_optimal_is_the_lifetime_minimum_on_the_iso_loss_curve():
    law = EPOCH
    res = inference_optimal(1e23, inference_tokens=3e12, fit="epoch")
    n, d, loss = res["n_params"], res["n_tokens"], res["loss"]
    assert law.loss(n, d) == pytest.approx(loss, rel=1e-10)  # same predicted quality
    assert loss == pytest.approx(compute_optimal(1e23, fit="epoch")["loss"], rel=1e-12)
    # independent brute force over N on the iso-loss curve
    n_min = law.min_params_for_loss(loss)
    ns = np.exp(np.linspace(math.log(n_min) + 1e-6, math.log(res["baseline"]["n_params"]) + 1, 400_001))
    cost = 6 * ns * law.tokens_for_loss(ns, loss) + 2 * ns * 3e12
    assert n == pytest.approx(ns[np.argmin(cost)], rel=1e-4)
    assert res["total_flops"] <= cost.min() * (1 + 1e-9)
    assert res["n_params"] < res["baseline"]["n_params"] and res["n_tokens"] > res["baseline"]["n_tokens"]
    assert res["savings"]["flops"] == pytest.approx(res["baseline"]["total_flops"] - res["total_flops"], rel=1e-12)


def test_inference_optimal_limits_and_monotonicity():
    base = compute_optimal(1e22, fit="chinchilla")
    zero = inference_optimal(1e22, inference_tokens=0, fit="chinchilla")
    assert zero["n_params"] == pytest.approx(base["n_params"], rel=1e-9)
    assert zero["savings"]["flops"] == pytest.approx(0.0, abs=1e-6 * base["flops"])
    prev = zero["n_params"]
    for d_inf in (1e10, 1e11, 1e12, 1e13, 1e14):
        n = inference_optimal(1e22, inference_tokens=d_inf, fit="chinchilla")["n_params"]
        assert n < prev
        prev = n
    # a given non-optimal reference model: savings are also reported against it
    res = inference_optimal(reference_params=70e9, reference_tokens=300e9, inference_tokens=1e12)
    assert res["savings_vs_reference"]["flops"] > res["savings"]["flops"] > 0


def test_inference_optimal_errors():
    with pytest.raises(ScalingError, match="exactly one"):
        inference_optimal(1e22, inference_tokens=1e12, target_loss=2.0)
    with pytest.raises(ScalingError, match="irreducible loss"):
        inference_optimal(target_loss=1.5, inference_tokens=1e12)  # below chinchilla's E = 1.69
    with pytest.raises(ScalingError, match="inference_tokens"):
        inference_optimal(1e22, inference_tokens=-1)


# ------------------------------------------------------------------------------------------
# Fitting L(N, D) (Hoffmann et al. App. D.2)
# ------------------------------------------------------------------------------------------

def _isoflop_design(law: LossLaw, budgets=(1e17, 3e17, 1e18, 3e18, 1e19), sizes=7):
    ns, ds = [], []
    for c in budgets:
        n0, _ = law.optimal(c)
        for f in np.logspace(-1, 1, sizes):
            ns.append(n0 * f)
            ds.append(c / (6 * n0 * f))
    return np.array(ns), np.array(ds)


def test_fitter_recovers_constants_exactly_without_noise():
    ns, ds = _isoflop_design(EPOCH)
    res = fit_loss_law(ns, ds, EPOCH.loss(ns, ds), top_k=4)
    for k in ("E", "A", "B", "alpha", "beta"):
        assert getattr(res.law, k) == pytest.approx(getattr(EPOCH, k), rel=5e-3), k


def test_fitter_recovers_constants_from_noisy_losses_with_outliers():
    # 0.1% multiplicative noise plus two gross outliers, which the Huber loss must shrug off
    law = LossLaw(E=2.1, A=300.0, B=900.0, alpha=0.32, beta=0.30, name="truth")
    ns, ds = _isoflop_design(law)
    rng = np.random.default_rng(1234)
    losses = law.loss(ns, ds) * np.exp(rng.normal(0.0, 1e-3, ns.size))
    losses[[3, 20]] *= 1.15
    res = fit_loss_law(ns, ds, losses, top_k=6)
    for k in ("E", "alpha", "beta"):
        assert getattr(res.law, k) == pytest.approx(getattr(law, k), rel=0.03), k
    for k in ("A", "B"):  # prefactors are far less well determined than exponents
        assert getattr(res.law, k) == pytest.approx(getattr(law, k), rel=0.15), k
    assert res.law.a == pytest.approx(law.a, abs=0.01)


def _write_sweep(root, law, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    ns, ds = _isoflop_design(law, budgets=(1e16, 1e17, 1e18), sizes=5)
    for i, (n, d) in enumerate(zip(ns, ds)):
        run = root / f"run{i:02d}"
        run.mkdir(parents=True)
        loss = float(law.loss(n, d)) * math.exp(rng.normal(0.0, noise))
        lines = [{"step": 10, "loss": 5.0}, {"step": 10, "val_loss": 9.9}, {"step": 20, "loss": 4.0},
                 {"step": 20, "val_loss": loss}, {"step": 21, "loss": 3.9}]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"step\": 22, \"lo")
        info = {"params": {"total": n, "non_embedding": 0.9 * n}, "tokens": d, "flops": 6 * n * d,
                "model_args": {"dim": 64}, "flop_budget": 6 * n * d}
        (run / "run_info.json").write_text(json.dumps(info))


def test_collect_runs_reads_final_val_loss_and_skips_incomplete(tmp_path):
    _write_sweep(tmp_path, EPOCH)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (tmp_path / "no_info").mkdir()
    (tmp_path / "no_info" / "metrics.jsonl").write_text('{"val_loss": 3.0}\n')
    (tmp_path / "broken" / "run_info.json").write_text(json.dumps({"params": {"total": 1}, "tokens": 1}))
    runs, skipped = collect_runs(tmp_path)
    assert len(runs) == 15
    r0 = next(r for r in runs if r.run == "run00")
    assert r0.val_loss == pytest.approx(EPOCH.loss(r0.n_params, r0.tokens), rel=1e-12)  # the last val_loss line
    assert {s["run"]: s["reason"] for s in skipped} == {
        "broken": "no finite val_loss in metrics.jsonl", "no_info": "no run_info.json"}
    assert collect_runs(tmp_path, params="non_embedding")[0][0].n_params == pytest.approx(0.9 * runs[0].n_params)
    with pytest.raises(ScalingError, match="not a directory"):
        collect_runs(tmp_path / "nope")


def test_cli_fit_writes_plot_and_reusable_fit(tmp_path, capsys):
    law = LossLaw(E=1.9, A=400.0, B=1500.0, alpha=0.34, beta=0.36, name="truth")
    _write_sweep(tmp_path / "sweep", law)
    png, fit_yaml = tmp_path / "iso.png", tmp_path / "fit.yaml"
    assert main(["fit", str(tmp_path / "sweep"), "--bootstrap-a3", "0", "--out", str(png),
                 "--save-fit", str(fit_yaml),
                 "--top-k", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for k in ("E", "A", "B", "alpha", "beta"):
        assert res["fit"][k] == pytest.approx(getattr(law, k), rel=0.01), k
    assert res["compute_optimal_exponents"]["a"] == pytest.approx(law.a, abs=1e-3)
    assert len(res["budgets"]) == 3 and res["n_points"] == 15
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the saved YAML is a valid --fit
    n_saved = compute_optimal(1e20, fit=str(fit_yaml))["n_params"]
    assert n_saved == pytest.approx(law.optimal(1e20)[0], rel=0.02)
    assert main(["compute-optimal", "--flops", "1e20", "--fit", str(fit_yaml), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_params"] == pytest.approx(n_saved, rel=1e-12)


def test_cli_fit_needs_runs(tmp_path, capsys):
    assert main(["fit", str(tmp_path)]) == 2
    assert "0 usable run(s)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target,vocab", [(1e6, 1024), (1e7, 4096), (1e8, 32000), (1e9, 32000),
                                          (7e9, 32000), (1e10, 32000), (1e11, 32000)])
def test_shape_hits_target(target, vocab):
    args = shape_for_params(target, vocab, max_seq_len=1024)
    n = count_params(args)["total"]
    assert n == pytest.approx(target, rel=0.02)
    assert args.head_dim in (16, 32, 64, 128) and args.dim % (16 if args.dim < 128 else 32 if args.dim < 256 else 64) == 0
    assert args.head_dim == (16 if args.dim % 32 else 32) or args.dim >= 256
    assert args.n_heads % args.kv_heads == 0 and args.vocab_size == vocab and args.max_seq_len == 1024
    if target >= 1e9:
        assert args.dim % 128 == 0 and args.head_dim == 128 and args.multiple_of == 256
        assert args.kv_heads == args.n_heads // 4  # GQA groups of 4
        assert 64 <= args.dim / args.n_layers <= 160  # LLaMA-like aspect ratio


def test_shape_non_embedding_count_and_errors():
    args = shape_for_params(5e8, 32000, count="non_embedding")
    assert count_params(args)["non_embedding"] == pytest.approx(5e8, rel=0.02)
    with pytest.raises(ScalingError, match="smaller vocab"):
        shape_for_params(1e6, 128256)
    with pytest.raises(ScalingError, match="n_params"):
        shape_for_params(0, 32000)


# ------------------------------------------------------------------------------------------
# Experiment plans (experiment=compute_optimal|inference_optimal|isoflop)
# ------------------------------------------------------------------------------------------

def _plan(model=None, seq_len=128, tokens_per_step=1024, warmup_steps=100, **scaling):
    model = model or ModelArgs(vocab_size=2048, max_seq_len=256)
    return plan_experiment(ScalingConfig(**scaling), model, seq_len, tokens_per_step, warmup_steps)


def test_plan_experiment_none_and_fixed():
    assert _plan() is None  # mode "none"
    plan = _plan(mode="fixed", flops=6e12, params=1e6)
    assert (plan.mode, plan.flops, plan.n_params) == ("fixed", 6e12, 1e6)
    m = plan.model
    n = count_params(m)["total"]
    assert n == pytest.approx(1e6, rel=0.05) and n != 1e6
    assert plan.n_tokens == pytest.approx(6e12 / (6 * n))  # D = C / (6 N), N the shape's own
    assert plan.max_steps == math.ceil(plan.n_tokens / 1024)
    assert plan.warmup_steps == min(100, plan.max_steps // 10)  # capped at a tenth of the steps
    assert plan.lr is None  # no scaling.lr_ref_params: optim.lr as given
    assert (m.vocab_size, m.max_seq_len) == (2048, 256)  # the model's vocab; max(seq_len, model's)
    assert plan.describe().startswith(f"fixed (fit none (fixed N)): C=6e+12 FLOPs -> N=1e+06 "
                                      f"-> built {n:.4g} total params (dim ")
    assert plan.describe().endswith(f"D={plan.n_tokens:.3g} tokens, {plan.max_steps} steps")
    # scaling.vocab_size wins; a longer seq_len widens max_seq_len; a short warmup is kept
    plan = _plan(seq_len=512, warmup_steps=5, mode="fixed", flops=6e12, params=1e6, vocab_size=1024)
    assert (plan.model.vocab_size, plan.model.max_seq_len, plan.warmup_steps) == (1024, 512, 5)
    # at least one step, and warmup at least 1
    plan = _plan(tokens_per_step=10**9, mode="fixed", flops=6e12, params=1e6)
    assert (plan.max_steps, plan.warmup_steps) == (1, 1)


def test_plan_experiment_learning_rate_follows_the_size_and_budget():
    """lr = optim.lr (N / lr_ref_params)^-lr_exponent (6 N D / lr_ref_flops)^-lr_flops_exponent,
    N the built shape's count."""
    small = _plan(mode="fixed", flops=6e12, params=1e5, count="non_embedding", tolerance=0.25,
                  lr_ref_params=1e5, lr_exponent=0.5)
    big = _plan(mode="fixed", flops=6e12, params=4e5, count="non_embedding", tolerance=0.25,
                lr_ref_params=1e5, lr_exponent=0.5)
    n_small, n_big = (count_params(p.model)["non_embedding"] for p in (small, big))
    assert small.lr == pytest.approx(3e-4 * (n_small / 1e5) ** -0.5)
    assert big.lr == pytest.approx(3e-4 * (n_big / 1e5) ** -0.5) and big.lr < small.lr
    assert big.describe().endswith(f", lr {big.lr:.3g}")
    flat = plan_experiment(ScalingConfig(mode="fixed", flops=6e12, params=4e5, lr_ref_params=1e5),
                           ModelArgs(vocab_size=2048, max_seq_len=256), 128, 1024, 100, base_lr=1e-3)
    assert flat.lr == 1e-3  # exponent 0: the given rate at every size
    # by the run's training FLOPs (6 N D = the budget here), and both factors together
    by_c = plan_experiment(ScalingConfig(mode="fixed", flops=6e12, params=4e5, lr_ref_flops=6e11,
                                         lr_flops_exponent=0.5), ModelArgs(vocab_size=2048, max_seq_len=256),
                           128, 1024, 100, base_lr=1e-3)
    assert by_c.lr == pytest.approx(1e-3 * 10 ** -0.5)
    both = _plan(mode="fixed", flops=6e12, params=4e5, count="non_embedding", tolerance=0.25,
                 lr_ref_params=1e5, lr_exponent=0.5, lr_ref_flops=6e11, lr_flops_exponent=0.5)
    assert both.lr == pytest.approx(big.lr * 10 ** -0.5)
    with pytest.raises(ConfigError, match=r"scaling\.lr_flops_exponent=0\.4 needs scaling\.lr_ref_flops"):
        ScalingConfig(mode="fixed", lr_flops_exponent=0.4)
    with pytest.raises(ConfigError, match=r"scaling\.lr_exponent=0\.3 needs scaling\.lr_ref_params"):
        ScalingConfig(mode="fixed", lr_exponent=0.3)
    with pytest.raises(ConfigError, match=r"scaling\.lr_ref_params=0"):
        ScalingConfig(mode="fixed", lr_ref_params=0)


@pytest.mark.parametrize("mode", ["compute_optimal", "inference_optimal"])
def test_plan_experiment_follows_the_planners(mode):
    kw = {"inference_tokens": 1e10} if mode == "inference_optimal" else {}
    plan = _plan(mode=mode, flops=3e14, fit="epoch", **kw)
    want = (compute_optimal(3e14, fit="epoch") if mode == "compute_optimal"
            else inference_optimal(3e14, 1e10, fit="epoch"))
    n = count_params(plan.model)["total"]
    assert plan.n_params == want["n_params"] and plan.shape_params == n
    assert n == pytest.approx(want["n_params"], rel=0.05)
    if mode == "compute_optimal":  # the built shape spends the budget exactly
        assert plan.n_tokens == pytest.approx(3e14 / (6 * n))
    else:  # the built shape trains until it reaches the target loss
        law = load_fit("epoch")
        assert law.loss(n, plan.n_tokens) == pytest.approx(want["loss"], rel=1e-9)
        assert (n > want["n_params"]) == (plan.n_tokens < want["n_tokens"])
    assert plan.target_loss == want["loss"]
    assert plan.max_steps == math.ceil(plan.n_tokens / 1024)
    assert plan.describe().startswith(f"{mode} (fit epoch): C=3e+14 FLOPs")


@pytest.mark.parametrize("scaling,key", [
    ({"mode": "compute_optimal"}, "scaling.flops"),
    ({"mode": "fixed", "flops": -1.0, "params": 1e6}, "scaling.flops"),
    ({"mode": "inference_optimal", "flops": 1e14}, "scaling.inference_tokens"),
    ({"mode": "fixed", "flops": 1e14}, "scaling.params"),
])
def test_plan_experiment_errors_name_the_key(scaling, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _plan(**scaling)


def test_small_budget_errors_name_config_keys_that_exist():
    """The advice of a failed shape search is in Hydra keys, and each key it names is real."""
    from llama_train.config import config_keys

    with pytest.raises(ConfigError) as err:
        _plan(mode="compute_optimal", flops=3e11)  # N = 9.1e4: below the 2048-vocab embeddings
    msg = str(err.value)
    named = set(re.findall(r"\b((?:scaling|model)\.[a-z_]+)", msg))
    assert {"scaling.tolerance", "scaling.count", "model.tie_embeddings"} <= named, msg
    assert named <= set(config_keys()), named - set(config_keys())
    # and following it works: non-embedding counts, or a wider tolerance
    plan = _plan(mode="compute_optimal", flops=3e11, count="non_embedding", tolerance=0.1)
    n = count_params(plan.model)["non_embedding"]
    assert n == pytest.approx(plan.n_params, rel=0.1)
    assert plan.describe().startswith("compute_optimal (fit chinchilla): C=3e+11 FLOPs -> "
                                      f"N=9.13e+04 -> built {n:.4g} non_embedding params")
    plan = _plan(mode="compute_optimal", flops=1e13, tolerance=0.06)
    assert count_params(plan.model)["total"] == pytest.approx(plan.n_params, rel=0.06)
    with pytest.raises(ConfigError, match="scaling.count"):
        ScalingConfig(count="embedding")
    with pytest.raises(ConfigError, match="scaling.tolerance"):
        ScalingConfig(tolerance=0)


def test_experiment_directories_have_readable_names():
    """C3e14, not C300000000000000.0."""
    from hydra import compose, initialize_config_dir

    from llama_train.config import short_number
    from llama_train.paths import CONFIG_DIR

    assert [short_number(x) for x in (3e14, 1e10, 1.5e12, 3.0e7, 100, 2.5)] == \
        ["3e14", "1e10", "1.5e12", "3e7", "100", "2.5"]
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        co = compose("config", overrides=["experiment=compute_optimal", "scaling.flops=3e14"])
        io = compose("config", overrides=["experiment=inference_optimal", "scaling.flops=1e13",
                                          "scaling.inference_tokens=3e7"])
    assert co.trainer.output_dir == "outputs/compute_optimal/C3e14"
    assert io.trainer.output_dir == "outputs/inference_optimal/C1e13-I3e7"


def test_inference_optimal_cli_reproduces_sardana_without_flags(capsys):
    """[S24] Sec. 2 (7B quality, 1e11 inference tokens -> 6B on 1.18x the data) from the plain
    command: its default fit is the paper's, and the output says which fit it used."""
    main(["inference-optimal", "--reference-params", "7e9", "--inference-tokens", "1e11",
          "--json"])
    res = json.loads(capsys.readouterr().out)
    assert res["fit"]["name"] == "sardana"
    assert res["n_params"] == pytest.approx(6e9, rel=0.01)
    assert res["token_ratio"] == pytest.approx(1.18, abs=0.005)
    main(["inference-optimal", "--reference-params", "7e9", "--inference-tokens", "1e11"])
    assert "fit: sardana  E=1.69" in capsys.readouterr().out


def test_plan_experiment_leaves_its_inputs_alone():
    model = ModelArgs(dim=256, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=64, activation_checkpointing=True)
    s = ScalingConfig(mode="compute_optimal", flops=3e14)
    before = (asdict(model), asdict(s))
    plan = plan_experiment(s, model, 128, 1024, 100)
    assert (asdict(model), asdict(s)) == before
    assert plan.model is not model and plan.model.max_seq_len == 128
    with pytest.raises(AttributeError):
        plan.max_steps = 1  # frozen


def test_import_is_light():
    # llama-plan compute-optimal must start instantly: no torch, matplotlib or CLI code on import
    code = ("import sys, llama_train.scaling; "
            "print([m for m in ('torch', 'matplotlib', 'llama_train.scaling.cli', "
            "'llama_train.metrics.plot') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------

def test_zero_memory_matches_zero_paper_figure1():
    # [ZeRO] Fig. 1: Psi = 7.5B, N_d = 64, mixed-precision Adam (K = 12): 120 GB, 31.4 GB,
    # 16.6 GB and 1.9 GB per device for baseline, P_os, P_os+g, P_os+g+p (GB = 1e9 bytes).
    args = load_preset("llama2_7b")
    psi = count_params(args)["total"]
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        mem = model_memory(args, zero_stage=stage, world_size=64, dtype="bf16")
        assert mem["n_params"] == psi
        assert mem["total"] / psi * 7.5e9 / 1e9 == pytest.approx(gb, abs=0.05)
        assert mem["total"] == pytest.approx(mem["params"] + mem["grads"] + mem["optimizer_states"])
        b = mem["breakdown"]
        assert mem["optimizer_states"] == pytest.approx(b["master_params"] + b["exp_avg"] + b["exp_avg_sq"])


def test_fp32_memory_and_offload():
    args = load_preset("tiny")
    psi = count_params(args)["total"]
    # plain fp32 Adam: 4 B params + 4 B grads + 8 B moments, partitioned like the ZeRO paper
    for stage, per_param in {0: 16, 1: 4 + 4 + 8 / 4, 2: 4 + 12 / 4, 3: 16 / 4}.items():
        mem = model_memory(args, zero_stage=stage, world_size=4, dtype="fp32", master_copy=False)
        assert mem["total"] == pytest.approx(per_param * psi)
        assert mem["breakdown"]["master_params"] == 0 and mem["breakdown"]["exp_avg"] == 4 * psi / (4 if stage else 1)
    # default = DeepSpeed's behaviour: its ZeRO optimizers clone an fp32 master partition even for
    # an fp32 model (stages 1-3), stage 0 keeps none
    for stage, per_param in {0: 16, 1: 4 + 4 + 12 / 4, 2: 4 + 16 / 4, 3: 20 / 4}.items():
        mem = model_memory(args, zero_stage=stage, world_size=4, dtype="fp32")
        assert mem["total"] == pytest.approx(per_param * psi)
        assert mem["master_copy"] is (stage >= 1)
    off = model_memory(args, zero_stage=2, world_size=2, dtype="bf16", offload_optimizer=True)
    assert off["optimizer_states"] == 0 and off["cpu_optimizer_states"] == pytest.approx(12 * psi / 2)
    with pytest.raises(ScalingError, match="stage 1, 2 or 3"):
        model_memory(args, zero_stage=0, offload_optimizer=True)
    with pytest.raises(ScalingError, match="dtype"):
        model_memory(args, dtype="int8")
    with pytest.raises(ScalingError, match="world_size"):
        model_memory(args, world_size=0)


@pytest.mark.parametrize("dtype,ckpt,kv,chunk", [
    ("fp32", False, 2, 0), ("fp32", True, 4, 0), ("bf16", False, 2, 0), ("bf16", True, 2, 0),
    ("fp32", False, 2, 48), ("bf16", True, 2, 48), ("bf16", False, 4, 1000)])
def test_activation_estimate_equals_saved_tensors(dtype, ckpt, kv, chunk):
    """The formula counts exactly the tensors autograd saves in this model's forward, with the
    loss over the whole logits (chunk 0) or in chunks (model.loss_chunk_tokens)."""
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=kv, vocab_size=512, multiple_of=32,
                     max_seq_len=64, activation_checkpointing=ckpt, loss_chunk_tokens=chunk)
    model = Transformer(args).to(torch.bfloat16 if dtype == "bf16" else torch.float32).train()
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    tokens, targets = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(tokens, targets)
    est = activation_memory(args, micro_batch=2, seq_len=64, dtype=dtype)
    assert est["checkpointing"] is ckpt
    # everything but the 0-d loss scalar (4 bytes); "recompute" is the backward-time peak on top.
    # The formula counts the activations; the faster RoPE (a complex multiply, which also saves
    # its (T, hd/2) complex factor per call) and the fused loss (its (N,) mask) add a few KB that
    # do not grow with width, so allow 1.5%.
    measured = sum(saved.values()) - (0 if chunk else 4)  # the chunked loss saves no scalar
    expected = est["layers"] + est["head"]
    assert est["loss_chunk_tokens"] == chunk
    assert expected <= measured <= expected * 1.015, (measured, expected)
    assert est["total"] == est["layers"] + est["recompute"] + est["head"]


def test_activation_checkpointing_and_eager_attention():
    args = load_preset("llama2_7b")
    full = activation_memory(args, micro_batch=1, seq_len=4096, dtype="bf16", checkpointing=False)
    ckpt = activation_memory(args, micro_batch=1, seq_len=4096, dtype="bf16", checkpointing=True)
    assert ckpt["layers"] == args.n_layers * 2 * 4096 * args.dim  # 2 s b h per layer (Korthikanti et al.)
    assert ckpt["total"] < full["total"] / 10
    eager = activation_memory(args, 1, 4096, "bf16", False, attention="eager")
    assert eager["per_layer"] - full["per_layer"] == 2 * args.n_heads * 4096**2


def test_sequence_parallel_activations_are_the_ranks_share():
    """N ranks sharing each sequence: every term of s/N tokens, but k and v of the whole
    sequence for n_kv_heads / N heads (at least one); the logits' gradient of s/N tokens."""
    args = load_preset("llama3_1_8b")  # 8 kv heads of 128
    one = activation_memory(args, 1, 32768, "bf16", sequence_parallel=1, loss_chunk_tokens=0)
    chunked = activation_memory(args, 1, 32768, "bf16", sequence_parallel=1)  # 2048 by default
    grad_w = 2 * args.vocab_size * args.dim  # the output weight's gradient, whatever the tokens
    for n in (2, 8, 16):
        part = activation_memory(args, 1, 32768, "bf16", sequence_parallel=n, loss_chunk_tokens=0)
        kv_one = 2 * 2 * 32768 * 8 * 128
        kv_part = 2 * 2 * 32768 * max(8 // n, 1) * 128
        assert part["per_layer"] == (one["per_layer"] - kv_one) / n + kv_part
        assert part["head"] == one["head"] / n and part["sequence_parallel"] == n
        assert part["backward_transient"] == 4 * (32768 // n) * args.vocab_size
        # chunked: a chunk of 2048 tokens (or all of the rank's, if fewer) at a time
        part = activation_memory(args, 1, 32768, "bf16", sequence_parallel=n)
        assert part["head"] - grad_w == (chunked["head"] - grad_w) / n
        assert part["backward_transient"] == min(2048, 32768 // n) * args.vocab_size * (4 + 2)
    with pytest.raises(ScalingError, match="sequence_parallel=3"):
        activation_memory(args, 1, 32768, "bf16", sequence_parallel=3)


def test_sequence_parallel_traffic_counts_each_layers_four_exchanges():
    from llama_train.scaling import sequence_parallel_traffic

    args = load_preset("llama3_1_8b")  # 32 layers, 32 heads, 8 kv heads of 128
    t = sequence_parallel_traffic(args, 1, 32768, 4, "bf16", checkpointing=False)
    q, kv = 2 * (32768 // 4) * 32 * 128, 2 * (32768 // 4) * 8 * 128
    assert t["call_bytes"] == [q, kv, kv, q] and t["calls"] == 4 * 32 * 2
    assert t["bytes"] == 2 * 32 * (2 * q + 2 * kv) and t["bytes_sent"] == t["bytes"] * 3 / 4
    # a recomputed forward exchanges again; fewer kv heads than ranks are copied up to N
    assert sequence_parallel_traffic(args, 1, 32768, 4, "bf16", True)["calls"] == 4 * 32 * 3
    wide = sequence_parallel_traffic(args, 1, 32768, 16, "bf16", False)
    assert wide["call_bytes"][1] == 2 * (32768 // 16) * 16 * 128
    assert sequence_parallel_traffic(args, 1, 32768, 1)["calls"] == 0


# ------------------------------------------------------------------------------------------
# model-info and CLI
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["llama2_70b", "llama3_70b"])
def test_model_info_70b_is_instant_and_counts_agree(preset):
    t0 = time.perf_counter()
    info = model_info(preset, zero_stage=3, world_size=64, micro_batch=1, seq_len=4096)
    assert time.perf_counter() - t0 < 10.0  # counted from the shape, no model is built
    counts = count_params(load_preset(preset))
    assert info["params"] == counts
    assert 68e9 < counts["total"] < 72e9
    if preset == "llama3_70b":  # Meta-Llama-3-70B's published parameter count
        assert counts["total"] == 70_553_706_496
    assert info["model_state"]["bf16"]["total"] == pytest.approx(16 * counts["total"] / 64)


@pytest.mark.parametrize("tied", [False, True])
def test_param_shapes_equal_a_meta_device_build_of_every_preset(tied):
    """What model-info needs of a model (each parameter's size; the largest module's, for
    DeepSpeed's ZeRO-3 estimator) is computed from the shape: it must be what a build gives."""
    from llama_train.model import list_presets
    from llama_train.model.args import param_shapes

    for name in list_presets():
        args = replace(load_preset(name), tie_embeddings=tied)
        with torch.device("meta"):
            net = Transformer(args)
        built = [(n, tuple(p.shape)) for n, p in net.named_parameters()]
        assert param_shapes(args) == built, name
        largest_module = max(sum(p.numel() for p in m.parameters(recurse=False))
                             for m in net.modules())
        assert max(math.prod(s) for _, s in param_shapes(args)) == largest_module, name


def test_model_info_terms_equal_the_built_models():
    """The figures model-info took from a meta-device build (the largest parameter, the
    persistent ones, DeepSpeed's largest module) are the same without one (small preset)."""
    from llama_train.config import DeepSpeedConfig
    from llama_train.engine.estimates import zero_model_states_mem_needs
    from llama_train.scaling.memory import _rank_terms, deepspeed_estimate

    args = load_preset("small")
    with torch.device("meta"):
        net = Transformer(args)
    numels = [p.numel() for p in net.parameters()]
    sizes = DeepSpeedConfig().zero_sizes(args.dim)
    t = _rank_terms(args, 2, 8, sizes, 0.0, False, False, False)
    assert t.psi == sum(numels) and t.largest == max(numels)
    assert t.persistent == sum(k for k in numels if k <= sizes["stage3_param_persistence_threshold"])
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules())
    want = zero_model_states_mem_needs(3, sum(numels), 8, largest_layer_params=largest_module)
    got = deepspeed_estimate(args, 3, 8)
    assert (got["gpu"], got["cpu"]) == (want["gpu"], want["cpu"])


def test_cli_model_info_of_8b_builds_no_model(monkeypatch, capsys):
    """Issue 53: model-info of llama3_8b took 206 s on a busy 2-core machine, 57 s of it
    building the model on the meta device (three times). It builds none now, and prints the
    figures it printed then."""
    import llama_train.model

    def no_build(*a, **k):
        raise AssertionError("model-info built a model")

    monkeypatch.setattr(llama_train.model.Transformer, "__init__", no_build)
    t0 = time.perf_counter()
    assert main(["model-info", "--model", "llama3_8b", "--zero-stage", "3", "--world-size", "64",
                 "--seq-len", "4096"]) == 0
    assert time.perf_counter() - t0 < 5.0  # ~0.3 s here once DeepSpeed is imported
    out = capsys.readouterr().out
    for figure in ("total          8,030,261,248", "ZeRO-3                    1.87 GiB    2.34 GiB",
                   # 32.57 GiB = 4.35 B/param with whole logits; the chunked loss (2048 tokens)
                   # keeps 4096 * (4 * 128256 + 8) B less in the head but the output weight's
                   # gradient (2 * 128256 * 4096 B) more, and its transient is 2048 * 128256 * 6 B,
                   # not 4096 * 128256 * 4: 1.47 GiB less
                   "31.10 GiB = 4.16 B/param", "loss in chunks of 2048 tokens",
                   "persistent params       520.0 KiB",
                   "gathered params          1.01 GiB", "4.06 GiB per GPU + 187.88 GiB CPU"):
        assert figure in out, figure
    assert "meta-device build" not in out


def test_cli_json_outputs_parse(capsys):
    cases = [
        (["compute-optimal", "--flops", "1e21", "--json"], "n_params"),
        (["compute-optimal", "--flops", "5.76e23", "--fit", "epoch", "--json"], "approaches"),
        (["inference-optimal", "--flops", "1e22", "--inference-tokens", "2T", "--json"], "savings"),
        (["inference-optimal", "--reference-params", "7B", "--inference-tokens", "1e11", "--fit", "sardana",
          "--json"], "token_ratio"),
        (["model-info", "--model", "tiny", "--zero-stage", "2", "--world-size", "2", "--json"], "model_state"),
        (["shape", "--params", "2e7", "--vocab", "8192", "--json"], "model_args"),
    ]
    for argv, key in cases:
        assert main(argv) == 0, argv
        assert key in json.loads(capsys.readouterr().out)
    # the readable tables print too
    assert main(["inference-optimal", "--reference-params", "13B", "--inference-tokens", "2T", "--fit", "sardana"]) == 0
    out = capsys.readouterr().out
    assert "inference-optimal" in out and "17.4%" in out


def test_cli_errors_name_the_problem(capsys):
    assert main(["inference-optimal", "--inference-tokens", "1e12"]) == 2
    assert "--flops C, or --reference-params" in capsys.readouterr().err
    assert main(["model-info", "--model", "no_such_preset"]) == 2
    assert "unknown model preset 'no_such_preset'" in capsys.readouterr().err
    assert main(["compute-optimal", "--flops", "1e21", "--fit", "missing.yaml"]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compute-optimal", "--flops", "lots"])
    capsys.readouterr()
    # a wrong flag gets the usage of its own subcommand, not the top-level list of subcommands
    with pytest.raises(SystemExit) as e:
        main(["model-info", "--model", "tiny", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: llama-plan model-info")
    assert "--gpu-mem" in err and "llama-plan model-info: error: unrecognized arguments: --bogus" in err


# ------------------------------------------------------------------------------------------
# Per-rank peak (rank_peak_memory) and the --gpu-mem advice
# ------------------------------------------------------------------------------------------

def test_rank_peak_zero3_terms_follow_deepspeeds_buffers():
    from llama_train.config import DeepSpeedConfig
    from llama_train.scaling import rank_peak_memory

    args = load_preset("small")
    psi = count_params(args)["total"]
    sizes = DeepSpeedConfig().zero_sizes(args.dim)  # unset buckets scale with the width
    assert sizes["reduce_bucket_size"] == args.dim ** 2
    for n in (1, 2, 8):
        r = rank_peak_memory(args, zero_stage=3, world_size=n, seq_len=64, device="cpu")
        b = r["phases"]
        bucket = 2 * min(sizes["reduce_bucket_size"], psi)  # bf16 ipg bucket, touched pages only on CPU
        persistent = r["breakdown"]["persistent params"]
        # step: 16 B/param of partitioned states + the flat bf16 and fp32 copies of the gradient
        # partition (_prepare_fp32_grad_for_sub_group) = 22 Psi/N, plus the ipg bucket
        assert b["step"] == pytest.approx(22 * psi / n + bucket + persistent)
        assert r["total"] == max(b.values()) and r["peak_phase"] in b
    # on CUDA the whole bucket is allocated; offload moves optimizer states and params to the host
    cu = rank_peak_memory(args, zero_stage=3, world_size=8, seq_len=64, offload_optimizer=True,
                          offload_params=True)
    assert cu["breakdown"]["ipg bucket"] == 2 * sizes["reduce_bucket_size"]
    assert cu["host"] > 0 and cu["device"] == pytest.approx(cu["total"] - cu["host"])
    # DeepSpeed's defaults (reuse distance and live parameters 1e9) keep the whole model gathered
    # into backward; ours (0, dim^2) release each parameter after use
    big = ModelArgs(dim=1024, n_layers=16, n_heads=16, vocab_size=32000, max_seq_len=64)  # 268M
    keep = rank_peak_memory(big, 3, 8, seq_len=64, device="cpu",
                            zero_overrides={"stage3_max_reuse_distance": 10**9,
                                            "stage3_max_live_parameters": 10**9})
    drop = rank_peak_memory(big, 3, 8, seq_len=64, device="cpu")
    psi_big = count_params(big)["total"]
    assert keep["breakdown"]["gathered params"] == 2 * psi_big  # 268M < 1e9 / 2
    prefetch = DeepSpeedConfig().zero_sizes(big.dim)["stage3_prefetch_bucket_size"]
    assert drop["breakdown"]["gathered params"] == 2 * (32000 * 1024 + prefetch)
    with pytest.raises(ScalingError, match="offload_params"):
        rank_peak_memory(args, zero_stage=2, offload_params=True)
    with pytest.raises(ScalingError, match="unknown key"):
        rank_peak_memory(args, zero_stage=3, zero_overrides={"nope": 1})


def test_fit_advice_tries_the_cheapest_change_first():
    from llama_train.scaling import fit_advice, rank_peak_memory

    args = load_preset("llama2_7b")
    cfg = dict(zero_stage=0, world_size=8, micro_batch=4, seq_len=4096)
    z = {s: rank_peak_memory(args, **dict(cfg, zero_stage=s))["device"] for s in range(4)}
    assert z[0] > z[1] > z[3]
    fits = fit_advice(args, z[0] * 1.01, **cfg)
    assert fits["fits"] and fits["suggestion"] is None
    a = fit_advice(args, (z[0] + z[1]) / 2, **cfg)  # ZeRO-1 is the first change that fits
    assert not a["fits"] and a["suggestion"]["change"] == "higher ZeRO stage (ZeRO-1)"
    assert a["suggestion"]["predicted"] == pytest.approx(z[1])
    tiny_limit = fit_advice(args, 1.0, **cfg)  # nothing fits one byte
    assert tiny_limit["suggestion"] is None and tiny_limit["closest"]["settings"]["offload_params"]


def test_cli_model_info_prints_the_peak_and_the_advice(capsys):
    assert main(["model-info", "--model", "small", "--zero-stage", "0", "--world-size", "2",
                 "--seq-len", "256", "--gpu-mem", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "per-rank PEAK (bf16, cuda ranks" in out and "DeepSpeed's estimator: none for ZeRO-0" in out
    assert "does not fit" in out and "cheapest change that fits:" in out
    assert main(["model-info", "--model", "small", "--zero-stage", "3", "--world-size", "8",
                 "--seq-len", "256", "--gpu-mem", "80", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fit"]["fits"] and res["rank_peak"]["zero_stage"] == 3
    assert res["deepspeed_estimate"]["function"].endswith("estimate_zero3_model_states_mem_needs")


def test_compute_and_inference_optimal_each_name_the_others_default_fit(capsys):
    """Issue 28, item 5: the two subcommands default to different loss laws, so they gave
    different compute-optimal models for one budget without saying so. Each now prints what
    the other's default gives; with one --fit for both, the baseline is the same model."""
    main(["compute-optimal", "--flops", "3e20"])
    out = capsys.readouterr().out
    sardana = compute_optimal(3e20, "sardana")
    assert "`llama-plan inference-optimal` defaults to --fit sardana" in out
    assert f"{sardana['loss']:.4f}" in out
    main(["inference-optimal", "--flops", "3e20", "--inference-tokens", "1e12"])
    assert "`llama-plan compute-optimal` defaults to --fit chinchilla" in capsys.readouterr().out
    assert main(["inference-optimal", "--flops", "3e20", "--inference-tokens", "1e12",
                 "--fit", "chinchilla", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert "other_default_fit" not in res
    chinchilla = compute_optimal(3e20, "chinchilla")
    assert res["baseline"]["n_params"] == pytest.approx(chinchilla["n_params"], rel=1e-6)
