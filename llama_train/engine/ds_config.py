"""Our sub-configs translated into DeepSpeed's JSON config: every DeepSpeed setting is decided
here, from ``DeepSpeedConfig``, ``OptimConfig`` and the batch plan, with ``deepspeed.extra``
(raw DeepSpeed keys we do not model) merged last (no DeepSpeed import: the result is a plain
dict)."""

from __future__ import annotations

import copy
from typing import Any, Dict

import torch

from llama_train.config import BatchPlan, DeepSpeedConfig, OptimConfig


def resolve_precision(ds: DeepSpeedConfig, device_type: str) -> str:
    if ds.precision != "auto":
        return ds.precision
    if device_type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def _torch_fused_adamw_on_cpu() -> bool:
    """Whether this torch build has the fused AdamW kernel for CPU tensors (torch >= 2.4)."""
    try:
        p = torch.nn.Parameter(torch.zeros(1))
        torch.optim.AdamW([p], fused=True)
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def build_ds_config(ds: DeepSpeedConfig, optim: OptimConfig, batch: BatchPlan,
                    device_type: str, universal: bool = False, *,
                    model_dim: int) -> Dict[str, Any]:
    """Translate our sub-configs into DeepSpeed's JSON config. ``universal``: the checkpoint to
    load is in DeepSpeed's universal format (resuming on another world size). ``model_dim``
    sizes the buckets our config leaves unset (:meth:`DeepSpeedConfig.zero_sizes`)."""
    precision = resolve_precision(ds, device_type)
    cfg: Dict[str, Any] = {
        "train_batch_size": batch.global_batch,
        "train_micro_batch_size_per_gpu": batch.micro_batch,
        "gradient_accumulation_steps": batch.grad_accum,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": _zero_optimization(ds, device_type, model_dim),
        "optimizer": {"type": "AdamW", "params": _adamw_params(ds, optim, device_type)},
        "steps_per_print": ds.steps_per_print,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return merge_extra(cfg, ds.extra)


def merge_extra(cfg: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``deepspeed.extra`` merged into ``cfg`` last, in a copy: dicts merge key by key, anything
    else (a number, a list) replaces. The keys we set were refused when the config was loaded
    (:data:`llama_train.config.DEEPSPEED_OWNED`)."""
    out = copy.deepcopy(cfg)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_extra(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _zero_optimization(ds: DeepSpeedConfig, device_type: str, model_dim: int) -> Dict[str, Any]:
    """DeepSpeed's ``zero_optimization`` section: the stage, its buckets, offload."""
    sizes = ds.zero_sizes(model_dim)
    zero: Dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1:
        zero.update(
            contiguous_gradients=ds.contiguous_gradients,
            overlap_comm=ds.overlap_comm,
            reduce_bucket_size=sizes["reduce_bucket_size"],
            allgather_bucket_size=sizes["allgather_bucket_size"],
        )
    if ds.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=sizes["stage3_prefetch_bucket_size"],
            stage3_param_persistence_threshold=sizes["stage3_param_persistence_threshold"],
            stage3_max_reuse_distance=sizes["stage3_max_reuse_distance"],
            stage3_max_live_parameters=sizes["stage3_max_live_parameters"],
            sub_group_size=sizes["sub_group_size"],
            stage3_gather_16bit_weights_on_model_save=False,
            # DeepSpeed's default, stated: every gradient takes the reduce-scatter path, whose
            # averaging engine.sequence.gradient_factor corrects under sequence parallelism
            reduce_scatter=True,
        )
        zero.pop("allgather_bucket_size")
        zero.update(_zeropp_mics(ds))
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    return zero


def _zeropp_mics(ds: DeepSpeedConfig) -> Dict[str, Any]:
    """ZeRO++ and MiCS keys of ``zero_optimization`` (the ZeRO++ tutorial's names), only those
    that are on: a run without them gets the same JSON as before they existed. Their checks
    against the job (stage, CUDA, group sizes per node) ran in config.validate."""
    zpp, out = ds.zeropp, {}
    if zpp.hpz_partition_size > 1:
        out["zero_hpz_partition_size"] = int(zpp.hpz_partition_size)
    if zpp.quantized_weights:
        out["zero_quantized_weights"] = True
    if zpp.quantized_gradients:
        out["zero_quantized_gradients"] = True
    if ds.mics_shard_size > 0:  # refused while DeepSpeed lacks MiCS (config.mics_unavailable)
        out["mics_shard_size"] = int(ds.mics_shard_size)
    return out


def _adamw_params(ds: DeepSpeedConfig, optim: OptimConfig, device_type: str) -> Dict[str, Any]:
    """The ``params`` of DeepSpeed's AdamW: our hyperparameters, and on CPU torch's own AdamW."""
    adam_params: Dict[str, Any] = {
        "lr": optim.lr,
        "betas": [optim.beta1, optim.beta2],
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    if device_type == "cpu" and not ds.offload_optimizer:
        # DeepSpeed's FusedAdam is a CUDA kernel; on CPU torch's AdamW is the real optimizer.
        adam_params["torch_adam"] = True
        if _torch_fused_adamw_on_cpu():
            # One fused kernel for all tensors instead of ~10 ops per tensor: 4x less optimizer
            # time on the small model (docs/performance.md). DeepSpeed passes it to torch.
            adam_params["fused"] = True
    return adam_params
