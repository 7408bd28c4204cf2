"""Planners: the loss-optimal (N, D) for a training budget (Hoffmann et al. 2022), the
lifetime-cost-optimal (N, D) at a fixed loss (Sardana et al. 2024), a LLaMA shape for a
parameter count, and :func:`plan_experiment`, which turns a ``scaling:`` config into the model
and step count a run trains with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple, Union

from llama_train.scaling.laws import APPROACH1, APPROACH2, LossLaw, ScalingError, lifetime_optimal, load_fit

if TYPE_CHECKING:  # torch is imported lazily so the pure-math planners start instantly
    from llama_train.config import Config, ScalingConfig
    from llama_train.model import ModelArgs

FitSpec = Union[str, Path, LossLaw, Dict[str, Any]]


# =============================================================================================
# Compute-optimal (Hoffmann et al. 2022)
# =============================================================================================

def compute_optimal(flops: float, fit: FitSpec = "chinchilla") -> Dict[str, Any]:
    """The loss-minimising (N, D) for a training budget of ``flops`` = 6 N D.

    Keys: n_params, n_tokens, tokens_per_param, loss, flops, fit (constants + source),
    exponents (a, b, G of N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b), and approaches
    (the paper's Approach 1 and 2 power laws at the same budget).
    """
    law = load_fit(fit)
    n, d = law.optimal(flops)
    out: Dict[str, Any] = {
        "flops": float(flops),
        "n_params": n,
        "n_tokens": d,
        "tokens_per_param": d / n,
        "loss": law.loss(n, d),
        "fit": law.to_dict(),
        "exponents": {"a": law.a, "b": law.b, "G": law.G},
        "approaches": {},
    }
    for frontier in (APPROACH1, APPROACH2):
        n_k, d_k = frontier.optimal(flops)
        out["approaches"][frontier.name] = {
            "n_params": n_k, "n_tokens": d_k, "tokens_per_param": d_k / n_k,
            "a": frontier.a, "b": 1.0 - frontier.a, "coefficient": frontier.k, "source": frontier.source,
        }
    return out


# =============================================================================================
# Inference-optimal (Sardana et al. 2024)
# =============================================================================================

def _costs(n: float, d: float, d_inf: float) -> Dict[str, float]:
    train, infer = 6.0 * n * d, 2.0 * n * d_inf
    return {"n_params": n, "n_tokens": d, "tokens_per_param": d / n,
            "training_flops": train, "inference_flops": infer, "total_flops": train + infer}


def inference_optimal(
    flops: Optional[float] = None,
    inference_tokens: float = 0.0,
    fit: FitSpec = "chinchilla",
    *,
    reference_params: Optional[float] = None,
    reference_tokens: Optional[float] = None,
    target_loss: Optional[float] = None,
) -> Dict[str, Any]:
    """Cheapest (N, D_train) over the model's lifetime at a fixed predicted loss.

    The target loss comes from exactly one of: ``flops`` (the compute-optimal model of that
    budget), ``reference_params`` (+ optional ``reference_tokens``; without them the
    compute-optimal model of that size), or ``target_loss``. The answer minimises
    6 N D_train + 2 N D_inf on the iso-loss curve (Sardana et al. 2024, Eq. 3).

    Keys: n_params, n_tokens, tokens_per_param, loss, training_flops, inference_flops,
    total_flops, baseline (the compute-optimal model of the same loss, serving the same
    D_inf), savings {flops, percent} against it, param_ratio, token_ratio; and, when
    reference_tokens is given, reference + savings_vs_reference.
    """
    law = load_fit(fit)
    if reference_tokens is not None and reference_params is None:
        raise ScalingError("inference_optimal: reference_tokens needs reference_params (the model it trains)")
    given = [x is not None for x in (flops, reference_params, target_loss)]
    if sum(given) != 1:
        raise ScalingError(
            "inference_optimal: give exactly one of flops (compute-optimal reference), "
            "reference_params (+ optional reference_tokens) or target_loss"
        )
    d_inf = float(inference_tokens)
    if not math.isfinite(d_inf) or d_inf < 0:
        raise ScalingError(f"inference_tokens={inference_tokens!r} must be a finite number >= 0")

    loss, how, reference = _target(law, flops, reference_params, reference_tokens, target_loss, d_inf)
    n_base, d_base = law.optimal_for_loss(loss)
    n, d = lifetime_optimal(law, loss, d_inf)
    best = _costs(n, d, d_inf)
    base = _costs(n_base, d_base, d_inf)
    out: Dict[str, Any] = {
        **best,
        "loss": loss,
        "inference_tokens": d_inf,
        "target": how,
        "fit": law.to_dict(),
        "baseline": {**base, "description": "compute-optimal (Chinchilla-style) model of the same loss"},
        "savings": _savings(base, best),
        "param_ratio": n / n_base,
        "token_ratio": d / d_base,
    }
    if reference is not None:
        out["reference"] = {**reference, "description": how}
        out["savings_vs_reference"] = _savings(reference, best)
    return out


def _target(
    law: LossLaw,
    flops: Optional[float],
    reference_params: Optional[float],
    reference_tokens: Optional[float],
    target_loss: Optional[float],
    d_inf: float,
) -> Tuple[float, str, Optional[Dict[str, float]]]:
    """inference_optimal's target: (loss, how it was chosen, the given reference model's costs or None)."""
    if flops is not None:
        n_ref, d_ref = law.optimal(flops)
        return law.loss(n_ref, d_ref), f"compute-optimal model for C={float(flops):.3g} FLOPs", None
    if target_loss is not None:
        loss = float(target_loss)
        return loss, f"target loss {loss}", None
    n_ref = float(reference_params)
    if not math.isfinite(n_ref) or n_ref <= 0:
        raise ScalingError(f"reference_params={reference_params!r} must be a number > 0")
    if reference_tokens is None:
        d_ref = law.optimal(law.flops_where_optimal(n_ref))[1]
        return law.loss(n_ref, d_ref), f"compute-optimal model with N={n_ref:.4g} params", None
    d_ref = float(reference_tokens)
    if not math.isfinite(d_ref) or d_ref <= 0:
        raise ScalingError(f"reference_tokens={reference_tokens!r} must be a number > 0")
    how = f"given model N={n_ref:.4g} params, D={d_ref:.4g} tokens"
    return law.loss(n_ref, d_ref), how, _costs(n_ref, d_ref, d_inf)


def _savings(base: Dict[str, float], best: Dict[str, float]) -> Dict[str, float]:
    saved = base["total_flops"] - best["total_flops"]
    return {"flops": saved, "percent": 100.0 * saved / base["total_flops"]}


# =============================================================================================
# Shape search
# =============================================================================================

def _head_dim_for(dim: int) -> int:
    if dim < 32 or dim % 16:  # the tiniest widths: 8, 16, 24, 40 and 56
        return 8
    if dim < 64 or dim % 32:  # the tiny widths 32, 48, 80, 112
        return 16
    return 32 if dim < 512 else 64 if dim < 2048 else 128


def _kv_heads_for(n_heads: int) -> int:
    if n_heads >= 8 and n_heads % 4 == 0:
        return n_heads // 4
    if n_heads >= 8 and n_heads % 2 == 0:
        return n_heads // 2
    return n_heads


def target_aspect_ratio(dim: int) -> float:
    """dim / n_layers we aim for: 32 up to dim 128, 64 from 512 to 768, 128 from dim 2048,
    log-linear between.

    GPT-3 small/medium sit at 43-64, LLaMA 7B/13B and Llama-3 8B at 128, the 65-70B models at
    ~102; Kaplan et al. 2020 found loss nearly flat over aspect ratios ~20-200, so this only
    needs to be sensible, not optimal. Below dim 512 the lower target keeps tiny models from
    being a single layer (dim 64 x 2 layers, not 1): a one-layer model cannot compose attention
    heads, and in our tiny IsoFLOP sweeps it breaks the smooth loss-vs-size curve.
    """
    for lo, hi, r_lo, r_hi in ((128, 512, 32.0, 64.0), (768, 2048, 64.0, 128.0)):
        if dim <= lo:
            return r_lo
        if dim < hi:
            return r_lo * (r_hi / r_lo) ** (math.log(dim / lo) / math.log(hi / lo))
    return 128.0


# The widths of our IsoFLOP sweep's ladder (llama_train.scaling.study.ladder): steps of 8 below
# 32 (and 40), 16 below 128 and 32 below 256 (at tiny scale one layer more or less is a large
# step in N, so IsoFLOP sweeps of tiny models need the finer widths), 64 below 512, 256 up to
# 2048, 512 above (n_heads a multiple of 4 from dim 512, so GQA groups of 4 divide evenly).
SWEEP_DIMS = (list(range(8, 32, 8)) + [32, 40] + list(range(48, 128, 16)) + list(range(128, 256, 32))
              + list(range(256, 512, 64)) + list(range(512, 2048, 256)) + list(range(2048, 32768 + 1, 512)))
# The widths shape_for_params tries first: the sweep's and 56. Above 12k parameters the family's
# widest gap was 48x2 (80.1k) to 64x2 (139.6k), 1.74x: the planned 1.05e5 compute-optimal model
# of our 3e12 budget was built as 80.1k and kept a fifth of the inference-optimal saving
# (docs/scaling.md). 56x2 (107.8k, dim/n_layers 28) splits it into 1.35x and 1.29x; the study's
# other plans and the sweep's ladder are unchanged. If no depth lands within tolerance there, any
# multiple of 64 (< 1024) / 128 may be used.
NICE_DIMS = sorted(set(SWEEP_DIMS) | {56})

# The shape family: dim/n_layers within ASPECT_BAND of target_aspect_ratio(dim), a single layer
# counting as in the family however narrow (no model is shallower). Our IsoFLOP sweep uses only
# these shapes (llama_train.scaling.study.ladder), so a plan that keeps to them is a model of the
# kind the fitted law describes; docs/scaling.md, "Design".
ASPECT_BAND = 1.6


def aspect_miss(dim: int, layers: int) -> float:
    """How far (|ln|) dim/n_layers is from :func:`target_aspect_ratio`; 0 for one layer narrower than it."""
    ratio = dim / layers / target_aspect_ratio(dim)
    return 0.0 if layers == 1 and ratio < 1 else abs(math.log(ratio))


def in_family(dim: int, layers: int, band: float = ASPECT_BAND) -> bool:
    return aspect_miss(dim, layers) <= math.log(band) + 1e-12


# Outside the family, where it has no shape within tolerance: at most 4x deeper or shallower
# than target_aspect_ratio (never e.g. 10 layers of width 32 under a large vocabulary).
_LOOSE_BAND = 4.0


def shape_for_params(
    n_params: float,
    vocab_size: int = 32000,
    max_seq_len: int = 2048,
    *,
    count: str = "total",
    tie_embeddings: bool = False,
    tolerance: float = 0.02,
    family_only: bool = False,
) -> "ModelArgs":
    """A LLaMA-shaped ``ModelArgs`` whose ``count_params(...)[count]`` is within ``tolerance`` of n_params.

    Rule: dim is a multiple of 16 (or 56) below 128, of 32 below 256, of 64 below 1024 and of 128
    above; head_dim 16 (dims 32, 48, 80, 112), 32 (dim < 512),
    64 (dim < 2048) or 128; n_kv_heads = n_heads/4 when n_heads >= 8 and divisible by 4
    (else n_heads/2 if even and >= 8, else plain MHA); SwiGLU hidden by the LLaMA rule with
    multiple_of 256 (dim >= 1024), 64 (dim >= 256) or 32. For each dim the layer count that best hits the target
    is computed; among the shapes of the family (:func:`in_family`: dim/n_layers within
    ASPECT_BAND of :func:`target_aspect_ratio`) within tolerance we take the one whose
    dim/n_layers is closest (in log) to it. Where the family has none (tiny models under a large
    vocabulary, whose counts are coarse), a shape up to 4x off the target aspect ratio is taken,
    unless ``family_only``: then the family shape nearest the target within tolerance is taken
    (the family's aspect ratios are all fine; what matters then is N), and with none, the error
    names the closest. ``count="total"`` is Chinchilla's N (embeddings included); use
    "non_embedding" for Kaplan-style counts.
    """
    target = float(n_params)
    if not math.isfinite(target) or target <= 0:
        raise ScalingError(f"n_params={n_params!r} must be a number > 0")
    if count not in ("total", "non_embedding"):
        raise ScalingError(f"count={count!r}: 'total' (Chinchilla N) or 'non_embedding'")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ScalingError(f"vocab_size={vocab_size!r} must be a positive integer")
    make = partial(_make_shape, vocab_size=vocab_size, max_seq_len=max_seq_len, tie_embeddings=tie_embeddings)

    any_dims = list(range(64, 1024, 64)) + list(range(1024, 32768 + 1, 128))
    bands = (ASPECT_BAND,) if family_only else (ASPECT_BAND, _LOOSE_BAND)
    best_fit = closest = None
    for band in bands:
        for dims in (NICE_DIMS, any_dims):
            best_fit, near = _search_dims(dims, make, target, count, tolerance, band, nearest=family_only)
            if near is not None and (closest is None or near[0] < closest[0]):
                closest = near
            if best_fit is not None:
                break
        if best_fit is not None:
            break
    if best_fit is None:
        if closest is None:
            emb = vocab_size * NICE_DIMS[0] * (1 if tie_embeddings else 2)
            raise ScalingError(
                f"shape_for_params: {target:.3g} params is below the smallest model with vocab_size="
                f"{vocab_size} (embeddings alone ~{emb:.3g} at dim {NICE_DIMS[0]}); use a smaller vocab, "
                f"tie_embeddings=True, or count='non_embedding'"
            )
        which = f"of the family (dim/n_layers within {ASPECT_BAND}x of target_aspect_ratio) " if family_only else ""
        raise ScalingError(
            f"shape_for_params: no LLaMA shape {which}within {tolerance:.0%} of {target:.3g} params "
            f"(closest: dim={closest[1]}, n_layers={closest[2]}, off by {closest[0]:.1%}); "
            f"raise tolerance or change vocab_size={vocab_size}"
        )
    _, _, dim, layers = best_fit
    return make(dim, layers)


@lru_cache(maxsize=None)
def _family_depths(dim: int, band: float) -> Tuple[int, ...]:
    """The depths (1-256) of width ``dim`` within ``band`` (:func:`in_family`): the same in
    every search, and 256 calls each, so worked out once per process (a study plans hundreds
    of shapes)."""
    return tuple(d for d in range(1, 257) if in_family(dim, d, band))


def _make_shape(dim: int, layers: int, *, vocab_size: int, max_seq_len: int, tie_embeddings: bool) -> "ModelArgs":
    from llama_train.model import ModelArgs

    hd = _head_dim_for(dim)
    n_heads = dim // hd
    return ModelArgs(dim=dim, n_layers=layers, n_heads=n_heads, n_kv_heads=_kv_heads_for(n_heads),
                     vocab_size=vocab_size,
                     multiple_of=256 if dim >= 1024 else 64 if dim >= 256 else 32,
                     max_seq_len=max_seq_len, tie_embeddings=tie_embeddings)


def _search_dims(
    dims: Sequence[int], make: Callable[[int, int], "ModelArgs"], target: float, count: str, tolerance: float,
    band: float = ASPECT_BAND, nearest: bool = False,
) -> Tuple[Optional[Tuple[float, float, int, int]], Optional[Tuple[float, int, int]]]:
    """For each dim the depth within ``band`` of the target aspect ratio nearest ``target``: the
    best (aspect miss, error, dim, layers) within tolerance (``nearest``: the smallest error
    first, else the smallest aspect miss), and the closest (error, dim, layers) at all (None
    where none fits)."""
    from llama_train.model import count_params

    best: Optional[Tuple[float, float, int, int]] = None
    closest: Optional[Tuple[float, int, int]] = None
    for dim in dims:
        c1 = count_params(make(dim, 1))[count]
        per_layer = count_params(make(dim, 2))[count] - c1
        base = c1 - per_layer
        depths = _family_depths(dim, band)
        if not depths or (target - base) / per_layer < 0.5:  # none, or even one layer is too many
            continue
        layers = min(depths, key=lambda d: abs(base + d * per_layer - target))
        err = abs(base + layers * per_layer - target) / target
        if closest is None or err < closest[0]:
            closest = (err, dim, layers)
        miss = aspect_miss(dim, layers)
        if err <= tolerance:
            if best is None or ((err, miss) < best[1::-1] if nearest else (miss, err) < best[:2]):
                best = (miss, err, dim, layers)
    return best, closest


# =============================================================================================
# Experiments: a ``scaling:`` config -> the model and step count a run trains with
# =============================================================================================

@dataclass(frozen=True)
class ExperimentPlan:
    """What ``experiment=compute_optimal|inference_optimal|isoflop`` trains; see :func:`plan_experiment`."""

    mode: str  # compute_optimal | inference_optimal | fixed
    flops: float  # the training budget C (inference_optimal: the reference model's budget)
    n_params: float  # the planned N (before shape rounding)
    n_tokens: float  # D for the shape built: flops / (6 shape_params), or on the iso-loss curve
    model: "ModelArgs"  # the shape chosen for n_params
    max_steps: int
    warmup_steps: int
    fit: str = "chinchilla"  # the loss law that chose N and D (LossLaw.name)
    count: str = "total"  # which parameter count N is
    lr: Optional[float] = None  # the run's learning rate (scaling.lr_ref_*), else optim.lr
    shape_params: Optional[float] = None  # the built shape's count (``count``)
    target_loss: Optional[float] = None  # the law's loss for the plan (not for mode=fixed)

    def describe(self) -> str:
        """One line for the log."""
        m = self.model
        built = f" -> built {self.shape_params:.4g}" if self.shape_params is not None else ""
        odd = "" if in_family(m.dim, m.n_layers) else ", outside the shape family"
        return (f"{self.mode} (fit {self.fit}): C={self.flops:.3g} FLOPs -> N={self.n_params:.3g}{built} "
                f"{self.count} params (dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads{odd}), "
                f"D={self.n_tokens:.3g} tokens, {self.max_steps} steps"
                + (f", lr {self.lr:.3g}" if self.lr is not None else ""))


def _tokens_for_shape(s: "ScalingConfig", plan: Dict[str, Any], n_shape: float) -> float:
    """D for the shape actually built (its count is within scaling.tolerance of the plan's N): a
    budget is spent exactly (C = 6 N D); an inference-optimal model trains to the target loss on
    the iso-loss curve of the law that planned it."""
    if s.mode != "inference_optimal":
        return s.flops / (6 * n_shape)
    tokens = float(load_fit(s.fit).tokens_for_loss(n_shape, plan["loss"]))
    if not math.isfinite(tokens):
        from llama_train.config import ConfigError

        raise ConfigError(
            f"scaling.mode=inference_optimal: the shape built for N={plan['n_params']:.4g} has "
            f"{n_shape:.4g} params, too few to reach the target loss {plan['loss']:.4g} at any "
            f"token count: lower scaling.tolerance (now {s.tolerance}).")
    return tokens


def _run_lr(s: "ScalingConfig", base_lr: float, n: float, tokens: float) -> Optional[float]:
    """optim.lr (N / lr_ref_params)^-lr_exponent (6 N D / lr_ref_flops)^-lr_flops_exponent; None
    without a reference (the run keeps optim.lr)."""
    if s.lr_ref_params is None and s.lr_ref_flops is None:
        return None
    lr = base_lr
    if s.lr_ref_params is not None:
        lr *= (n / s.lr_ref_params) ** (-s.lr_exponent)
    if s.lr_ref_flops is not None:
        lr *= (6 * n * tokens / s.lr_ref_flops) ** (-s.lr_flops_exponent)
    return lr


def plan_experiment(
    s: "ScalingConfig", model: "ModelArgs", seq_len: int, tokens_per_step: int, warmup_steps: int,
    base_lr: float = 3e-4,
) -> Optional[ExperimentPlan]:
    """The plan for ``scaling.mode`` (None for "none"): N and D from the compute-optimal or
    inference-optimal allocation of ``s.flops`` (or ``s.params``, "fixed", a point of an IsoFLOP
    sweep), a LLaMA shape for N, and the steps that train that shape on D tokens at
    ``tokens_per_step``: D = flops / (6 N_shape), or for inference_optimal the tokens at which
    N_shape reaches the target loss, so that rounding N to a shape neither over- nor under-spends
    the budget nor misses the target. Warmup is capped at a tenth of them. With
    ``s.lr_ref_params`` / ``s.lr_ref_flops`` set, the learning rate follows the run: ``base_lr`` is the rate at that size / training compute, scaled by
    (N / lr_ref_params)^-lr_exponent (6 N D / lr_ref_flops)^-lr_flops_exponent (the tuned rate
    falls with the budget; docs/scaling.md measures it). Nothing is mutated.
    Raises ConfigError naming the missing ``scaling.*`` key.
    """
    if s.mode == "none":
        return None
    from llama_train.config import ConfigError

    if s.flops is None or s.flops <= 0:
        raise ConfigError(f"scaling.mode={s.mode} needs scaling.flops > 0 (the training budget C).")
    vocab = s.vocab_size or model.vocab_size
    fit = load_fit(s.fit).name if s.mode != "fixed" else "none (fixed N)"
    if s.mode == "compute_optimal":
        plan = compute_optimal(s.flops, fit=s.fit)
    elif s.mode == "inference_optimal":
        if not s.inference_tokens or s.inference_tokens <= 0:
            raise ConfigError("scaling.mode=inference_optimal needs scaling.inference_tokens > 0.")
        plan = inference_optimal(s.flops, s.inference_tokens, fit=s.fit)
    else:  # fixed: a point of an IsoFLOP sweep
        if not s.params or s.params <= 0:
            raise ConfigError("scaling.mode=fixed needs scaling.params > 0.")
        plan = {"n_params": s.params, "n_tokens": s.flops / (6 * s.params)}
    try:  # below ~1M parameters the shape grid (whole layers) is coarse: scaling.tolerance
        shape = shape_for_params(plan["n_params"], vocab_size=vocab,
                                 max_seq_len=max(seq_len, model.max_seq_len), count=s.count,
                                 tie_embeddings=model.tie_embeddings, tolerance=s.tolerance,
                                 family_only=s.family_only)
    except ScalingError as e:
        raise ConfigError(
            f"scaling.mode={s.mode} scaling.flops={s.flops:.3g}: {e}. As config keys: "
            f"scaling.tolerance (now {s.tolerance}), "
            + ("scaling.family_only=false (any aspect ratio), " if s.family_only else "") +
            f"scaling.count=non_embedding (N without the "
            f"embeddings), model.tie_embeddings=true, a smaller scaling.vocab_size / "
            f"model.vocab_size, or a larger scaling.flops.") from None
    from llama_train.model import count_params

    n_shape = float(count_params(shape)[s.count])
    tokens = _tokens_for_shape(s, plan, n_shape)
    max_steps = max(1, math.ceil(tokens / tokens_per_step))
    lr = _run_lr(s, base_lr, n_shape, tokens)
    return ExperimentPlan(mode=s.mode, flops=float(s.flops), n_params=float(plan["n_params"]),
                          n_tokens=tokens, model=shape, max_steps=max_steps,
                          warmup_steps=min(warmup_steps, max(1, max_steps // 10)), fit=fit,
                          count=s.count, lr=lr, shape_params=n_shape,
                          target_loss=plan.get("loss"))


def plan_config(cfg: "Config", world_size: int) -> Tuple["Config", Optional[ExperimentPlan]]:
    """The config a run of ``cfg`` trains with on ``world_size`` data-parallel ranks (model shape,
    steps, warmup and rate from the plan) and the plan; ``cfg`` itself is left alone. The one
    place a config becomes a plan: the trainer's preflight and the study's check of a finished
    run both ask here, so they cannot disagree."""
    from dataclasses import replace

    from llama_train.config import resolve_batch

    t = cfg.trainer
    tokens_per_step = resolve_batch(t, world_size).global_batch * t.seq_len
    exp = plan_experiment(cfg.scaling, cfg.model, t.seq_len, tokens_per_step, cfg.optim.warmup_steps,
                          base_lr=cfg.optim.lr)
    if exp is None:
        return cfg, None
    optim = replace(cfg.optim, warmup_steps=exp.warmup_steps, lr=exp.lr if exp.lr is not None else cfg.optim.lr)
    return replace(cfg, model=exp.model, trainer=replace(t, max_steps=exp.max_steps), optim=optim), exp
