"""DeepSpeed's own model-state memory estimators, for ``llama-plan model-info``
(:func:`llama_train.scaling.memory.deepspeed_estimate` shows them beside our memory model)."""

from __future__ import annotations

from typing import Any, Dict, Optional

ZERO2_ESTIMATOR = "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs"
ZERO3_ESTIMATOR = "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs"


def zero_model_states_mem_needs(zero_stage: int, n_params: int, gpus_per_node: int, *,
                                largest_layer_params: Optional[int] = None,
                                offload_optimizer: bool = False,
                                offload_params: bool = False) -> Optional[Dict[str, Any]]:
    """DeepSpeed's estimate of the model-state bytes of one node of ``gpus_per_node`` ranks:
    ``estimate_zero2_model_states_mem_needs`` for ZeRO-1/2 (what its ``..._all_cold`` uses),
    ``estimate_zero3_model_states_mem_needs`` for ZeRO-3 (with ``zero_init``; it needs
    ``largest_layer_params``, the parameters of the largest module). Returns {gpu (bytes per
    rank), cpu (bytes per node), function (the estimator's name)}, or None for ZeRO-0, which has
    no estimator. Raises ImportError where DeepSpeed lacks the estimator."""
    if zero_stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        if largest_layer_params is None:
            raise ValueError("ZeRO-3's estimator needs largest_layer_params")
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            n_params, largest_layer_params, num_gpus_per_node=gpus_per_node, num_nodes=1,
            cpu_offload=offload_optimizer, cpu_offload_params=offload_params, zero_init=True)
        return {"gpu": gpu, "cpu": cpu, "function": ZERO3_ESTIMATOR}
    if zero_stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            n_params, num_gpus_per_node=gpus_per_node, num_nodes=1,
            cpu_offload=offload_optimizer)
        return {"gpu": gpu, "cpu": cpu, "function": ZERO2_ESTIMATOR}
    return None
