"""Scaling laws for our trainer: how big a model, how many tokens, and will it fit.

Two regimes (see docs/scaling.md):

* **compute-optimal** (Hoffmann et al. 2022, "Chinchilla"): for a training budget C = 6 N D,
  the (N, D) with the lowest predicted loss. Closed form from the Approach-3 fit, shown beside
  the paper's Approach-1/2 power laws.
* **inference-optimal** (Sardana et al. 2024, "Beyond Chinchilla-Optimal"): for the same
  predicted loss, the (N, D) with the lowest *lifetime* cost 6 N D_train + 2 N D_inf. A smaller
  model trained longer wins once inference tokens are comparable to training tokens.

Plus the practical side for our trainer: parameter/FLOP counts of a preset, model-state memory per
GPU under each ZeRO stage, activation memory per micro-batch, a LLaMA-shaped ``ModelArgs`` for a
target parameter count, and the plan an ``experiment=...`` run trains with. ``N`` is always the
*total* parameter count (embeddings included), Chinchilla's convention (Hoffmann et al. App. F),
i.e. ``count_params(args)["total"]``.

Modules: :mod:`.laws` (the loss law, published fits and frontiers, the inference-aware optimum),
:mod:`.fit` (fitting our own sweeps), :mod:`.planners` (compute/inference-optimal, shapes,
experiment plans), :mod:`.memory` (params, FLOPs, ZeRO and activation memory), :mod:`.traffic`
(the collectives a rank runs per step), :mod:`.steptime` (a step-time model across nodes and
``--recommend``), :mod:`.cli`
(``llama-plan``; not imported here). The IsoFLOP plot is :func:`llama_train.scaling.plots.plot_isoflops`.
"""

from llama_train.scaling.fit import (FitResult, RunPoint, collect_runs, final_val_loss, fit_loss_law,
                                     group_budgets, paper_init_grid)
from llama_train.scaling.laws import (APPROACH1, APPROACH2, CHINCHILLA, EPOCH, FITS, GOPHER_FLOPS,
                                      HOFFMANN_TABLE3_APPROACH1, HOFFMANN_TABLEA3_APPROACH2,
                                      HOFFMANN_TABLEA3_APPROACH3, SARDANA, LossLaw, PowerLawFrontier,
                                      ScalingError, lifetime_optimal, load_fit)
from llama_train.scaling.memory import (ACTIVATION_FORMULA, activation_memory, model_info, model_memory,
                                        rank_peak_memory, deepspeed_estimate, fit_advice, RANK_PEAK_MECHANISMS,
                                        sequence_parallel_traffic)
from llama_train.scaling.steptime import recommend, ring_time, step_time
from llama_train.scaling.traffic import planned_traffic
from llama_train.scaling.planners import (ExperimentPlan, FitSpec, compute_optimal, inference_optimal,
                                          plan_experiment, shape_for_params, target_aspect_ratio)

__all__ = [
    # laws
    "ScalingError", "LossLaw", "FITS", "CHINCHILLA", "SARDANA", "EPOCH", "load_fit",
    "PowerLawFrontier", "APPROACH1", "APPROACH2", "GOPHER_FLOPS", "HOFFMANN_TABLE3_APPROACH1",
    "HOFFMANN_TABLEA3_APPROACH2", "HOFFMANN_TABLEA3_APPROACH3", "lifetime_optimal",
    # fit
    "fit_loss_law", "FitResult", "paper_init_grid", "RunPoint", "collect_runs", "final_val_loss",
    "group_budgets",
    # planners
    "FitSpec", "compute_optimal", "inference_optimal", "shape_for_params", "target_aspect_ratio",
    "ExperimentPlan", "plan_experiment",
    # memory
    "model_memory", "activation_memory", "model_info", "ACTIVATION_FORMULA", "rank_peak_memory",
    "deepspeed_estimate", "fit_advice", "RANK_PEAK_MECHANISMS", "sequence_parallel_traffic",
    # traffic and step time
    "planned_traffic", "step_time", "ring_time", "recommend",
]
