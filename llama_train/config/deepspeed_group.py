"""The ``deepspeed`` group (ZeRO stage, precision, offload, buckets, ZeRO++ and MiCS) and the
DeepSpeed keys ``deepspeed.extra`` may not set, because engine/ds_config.py sets them from our
own settings (:data:`DEEPSPEED_OWNED`, :data:`DEEPSPEED_OWNED_WHEN_ON`). The checks against the
job (world size, ranks per node, device) are :mod:`llama_train.config.validation`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from llama_train.bounds import INT64_MAX, SIMULATE_MAX_RANKS, Range
from llama_train.config.groups import _check_choice, _check_ranges
from llama_train.errors import ConfigError
from llama_train.policy import may_change



# The DeepSpeed keys engine/ds_config.py sets, each with the setting of ours that decides it:
# ``deepspeed.extra`` may not set them (a key set twice would leave config.yaml saying one thing
# and DeepSpeed doing another), nor anything under them, nor replace a section that holds one.
# The defaults it states beside them (wall_clock_breakdown, fp16's loss scaling, pin_memory of
# an offload, stage3_gather_16bit_weights_on_model_save) are DeepSpeed's to change.
DEEPSPEED_OWNED: Dict[str, str] = {
    "train_batch_size": "set trainer.global_batch (or trainer.global_batch_tokens) instead",
    "train_micro_batch_size_per_gpu": "set trainer.micro_batch instead",
    "gradient_accumulation_steps": "set trainer.global_batch instead (accumulation is the global "
                                   "batch / (trainer.micro_batch x data-parallel ranks))",
    "gradient_clipping": "set optim.grad_clip instead",
    "steps_per_print": "set deepspeed.steps_per_print instead",
    "optimizer": "set optim.lr, optim.beta1, optim.beta2, optim.eps and optim.weight_decay "
                 "instead (the optimizer is llama_train's AdamW)",
    "scheduler": "set optim.warmup_steps and optim.min_lr_ratio instead (llama_train sets the "
                 "learning rate of every step; a DeepSpeed scheduler would fight it)",
    "zero_allow_untested_optimizer": "llama_train sets it (DeepSpeed must take torch's AdamW "
                                     "under ZeRO)",
    "bf16.enabled": "set deepspeed.precision instead",
    "fp16.enabled": "set deepspeed.precision instead",
    "checkpoint.load_universal": "llama_train sets it where a resume changes the world size "
                                 "under ZeRO",
    "zero_optimization.stage": "set deepspeed.zero_stage instead",
    "zero_optimization.contiguous_gradients": "set deepspeed.contiguous_gradients instead",
    "zero_optimization.overlap_comm": "set deepspeed.overlap_comm instead",
    **{f"zero_optimization.{k}": f"set deepspeed.{k} instead" for k in (
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_reuse_distance",
        "stage3_max_live_parameters", "sub_group_size")},
    "zero_optimization.reduce_scatter": "llama_train keeps it true (parallel.sequence's "
                                        "gradient averaging assumes the reduce-scatter path)",
    "zero_optimization.offload_optimizer.device": "set deepspeed.offload_optimizer instead",
    "zero_optimization.offload_param.device": "set deepspeed.offload_params instead",
}
# Keys of ours that engine/ds_config.py writes only while they are on (a run without them gets
# the JSON it got before they existed; DeepSpeed 0.19.8 refuses mics_shard_size even at its off
# value): refused in ``deepspeed.extra`` like DEEPSPEED_OWNED, as our checks (ZeRO-3, ranks per
# node, CUDA) would not see them there.
DEEPSPEED_OWNED_WHEN_ON: Dict[str, str] = {
    "zero_optimization.zero_hpz_partition_size": "set deepspeed.zeropp.hpz_partition_size "
                                                 "instead (checked against the ranks per node)",
    "zero_optimization.zero_quantized_weights": "set deepspeed.zeropp.quantized_weights instead",
    "zero_optimization.zero_quantized_gradients": "set deepspeed.zeropp.quantized_gradients "
                                                  "instead",
    "zero_optimization.mics_shard_size": "set deepspeed.mics_shard_size instead",
}


def _check_deepspeed_extra(extra: Dict[str, Any]) -> None:
    """Refuse a ``deepspeed.extra`` key of :data:`DEEPSPEED_OWNED` (or
    :data:`DEEPSPEED_OWNED_WHEN_ON`), naming it and our setting."""
    def leaves(d: Dict[str, Any], prefix: str = ""):  # config.flatten (load.py imports this)
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    for key, value in leaves(extra):
        for owned, fix in {**DEEPSPEED_OWNED, **DEEPSPEED_OWNED_WHEN_ON}.items():
            if key == owned or key.startswith(owned + "."):
                raise ConfigError(f"deepspeed.extra.{key}: {fix}.")
            if owned.startswith(key + ".") and not isinstance(value, dict):
                raise ConfigError(
                    f"deepspeed.extra.{key}={value!r} would replace DeepSpeed's {key} section, "
                    f"which holds {owned} ({fix}): give the keys to set under it instead, e.g. "
                    f"deepspeed.extra.{key}.<key>=<value>.")


@dataclass
class ZeroPPConfig:
    """ZeRO++ (Wang et al. 2023, DeepSpeed's ``zero_hpz_partition_size``,
    ``zero_quantized_weights``, ``zero_quantized_gradients``): three cuts of ZeRO-3's
    inter-node traffic. All off by default; each needs deepspeed.zero_stage=3."""

    hpz_partition_size: int = 1
    """hpZ: N > 1 keeps a second copy of the weights partitioned over each group of N
    consecutive ranks (one node: N must divide the ranks per node), so the all-gathers of
    backward stay inside the node. Costs 2 bytes/param (bf16) / N more per rank; numerically
    identical to ZeRO-3. 1: off."""
    quantized_weights: bool = False
    """qwZ: the forward all-gather sends int8 weights (blocks of quantized values + scales):
    half the bytes of bf16. Needs DeepSpeed's CUDA quantizer kernels (refused on CPU)."""
    quantized_gradients: bool = False
    """qgZ: the gradient reduce-scatter becomes a two-stage all-to-all of int4 gradients
    (within, then across nodes): about a quarter of the bytes. DeepSpeed applies it only when
    the job spans nodes (one node: a plain reduce-scatter). Needs CUDA kernels (refused on CPU)."""

    def __post_init__(self) -> None:
        _check_ranges("deepspeed.zeropp", self, {
            "hpz_partition_size": Range(1, SIMULATE_MAX_RANKS, integer=True,
                                        fix="ranks that share the secondary weight partition "
                                            "(the ranks of one node), or 1 for off"),
        })
        for name in ("quantized_weights", "quantized_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"deepspeed.zeropp.{name}={getattr(self, name)!r} must be "
                                  f"true or false.")

    @property
    def enabled(self) -> List[str]:
        """The ZeRO++ keys that are on (``deepspeed.zeropp.<name>``)."""
        return [f"deepspeed.zeropp.{k}" for k, on in (
            ("hpz_partition_size", self.hpz_partition_size > 1),
            ("quantized_weights", self.quantized_weights),
            ("quantized_gradients", self.quantized_gradients)) if on]


@dataclass
class DeepSpeedConfig:
    """What the engine module turns into a DeepSpeed JSON config."""

    zero_stage: int = may_change(0)
    precision: str = "auto"  # auto | bf16 | fp16 | fp32 (auto: bf16 on CUDA, fp32 on CPU)
    offload_optimizer: bool = may_change(False)
    offload_params: bool = may_change(False)
    overlap_comm: bool = may_change(False)
    contiguous_gradients: bool = may_change(True)
    # Bucket sizes and thresholds in elements. None: scaled to the model width as HF's DeepSpeed
    # integration sets "auto" (see zero_sizes), so a 270M model does not hold a 100 MB bucket per
    # rank and a 70B model still reduces and prefetches in large collectives.
    reduce_bucket_size: Optional[int] = may_change(None)  # dim^2
    allgather_bucket_size: int = may_change(50_000_000)  # ZeRO-1/2
    stage3_prefetch_bucket_size: Optional[int] = may_change(None)  # 0.9 dim^2
    stage3_param_persistence_threshold: Optional[int] = may_change(None)  # 10 dim
    # ZeRO-3 releases a parameter after use and gathers it again in backward (reuse distance 0,
    # like FSDP's default reshard-after-forward), and keeps at most dim^2 gathered elements beyond
    # what the module in use needs. DeepSpeed's defaults (1e9 each) keep every parameter of a
    # model below 1e9 gathered from forward to backward, 2 B/param more on every rank; a large
    # max_live alone (with reuse distance 0) still kept 1.9 B/param more at 268M on 8 ranks
    # (docs/benchmarks-memory.md). Raise them for more prefetch overlap where memory allows.
    stage3_max_reuse_distance: int = may_change(0)
    stage3_max_live_parameters: Optional[int] = may_change(None)  # dim^2
    sub_group_size: int = may_change(1_000_000_000)  # ZeRO-3 optimizer step granularity (DeepSpeed's default)
    steps_per_print: int = may_change(1_000_000)  # our logger prints; keep DeepSpeed's own quiet
    # Raw DeepSpeed settings we do not model, merged last into the config above (dicts merge,
    # anything else replaces): deepspeed.extra={comms_logger: {enabled: true}}, or
    # deepspeed.extra.comms_logger.enabled=true. Keys we set are refused (DEEPSPEED_OWNED).
    # May change on resume like the knobs above: a changed value is logged, never refused
    # (what defines the run's numerics, precision, batch, optimizer, is ours and refused here;
    # a key added or removed is not compared, as resume compares keys both configs have).
    extra: Dict[str, Any] = may_change(factory=dict)
    # ZeRO++ (hpZ, qwZ, qgZ): what they change is who sends what to whom, never the checkpoint
    # (hpZ's secondary copy is not saved; the saved partitions stay ZeRO-3's over all ranks), so
    # each may change on resume, like the bucket sizes (qwZ/qgZ round the communication: later
    # steps differ, as with float8)
    zeropp: ZeroPPConfig = may_change(factory=ZeroPPConfig)
    mics_shard_size: int = 0
    """MiCS (Zhang et al. 2022): N > 0 shards parameters, gradients and optimizer state over
    groups of N ranks instead of all of them (replicas across groups, their gradients
    all-reduced): per-rank model states x world/N, collectives inside the group. 0: off.
    Refused with the installed DeepSpeed (0.19.8 has no MiCS; see mics_unavailable). Defines
    the run (no may_change mark): a MiCS checkpoint holds partitions over the shard group, which
    neither plain ZeRO-3 nor DeepSpeed's universal conversion (ds_to_universal assumes one
    partition per rank of the world) reads."""

    def __post_init__(self) -> None:
        _check_choice("deepspeed.zero_stage", self.zero_stage, (0, 1, 2, 3))
        _check_choice("deepspeed.precision", self.precision, ("auto", "bf16", "fp16", "fp32"))
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError(
                f"deepspeed.offload_params=true needs deepspeed.zero_stage=3 (got "
                f"{self.zero_stage}): parameter offload only exists in ZeRO-3."
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError(
                "deepspeed.offload_optimizer=true needs deepspeed.zero_stage >= 1: the optimizer "
                "state is only partitioned (and offloadable) under ZeRO."
            )
        auto = "elements, or null to scale it with the model width"
        # DeepSpeed allocates the reduce bucket (ZeRO-2: two of them) at its full size in the
        # first backward: 2**32 elements is 8 GiB in bf16, far above any useful bucket
        bucket = Range(1, 2**32, integer=True, fix="elements per collective")
        _check_ranges("deepspeed", self, {
            "reduce_bucket_size": Range(1, 2**32, integer=True, optional=True, fix=auto),
            "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": Range(0, 2**32, integer=True, optional=True,
                                                 fix=auto),
            "stage3_param_persistence_threshold": Range(0, INT64_MAX, integer=True,
                                                        optional=True, fix=auto),
            "stage3_max_reuse_distance": Range(0, INT64_MAX, integer=True, fix="elements"),
            "stage3_max_live_parameters": Range(1, INT64_MAX, integer=True, optional=True,
                                                fix=auto),
            "sub_group_size": Range(1, INT64_MAX, integer=True, fix="elements per ZeRO-3 "
                                                                    "optimizer sub-step"),
            # DeepSpeed takes the step modulo it: 0 divides by zero at the first step
            "steps_per_print": Range(1, INT64_MAX, integer=True,
                                     fix="steps between DeepSpeed's own log lines"),
        })
        if self.allgather_bucket_size % 2:  # asserted by DeepSpeed's ZeRO-1/2 after the group
            raise ConfigError(
                f"deepspeed.allgather_bucket_size={self.allgather_bucket_size} must be even: "
                f"DeepSpeed aligns all-gather buffers to 4 bytes (2 half-precision elements); "
                f"use {self.allgather_bucket_size + 1}.")
        _check_deepspeed_extra(self.extra)
        _check_ranges("deepspeed", self, {
            "mics_shard_size": Range(0, SIMULATE_MAX_RANKS, integer=True,
                                     fix="the ranks of one MiCS shard group, or 0 for off"),
        })
        on = self.zeropp.enabled + (["deepspeed.mics_shard_size"] if self.mics_shard_size else [])
        if on and self.zero_stage != 3:
            raise ConfigError(
                f"{on[0]} needs deepspeed.zero_stage=3 (got {self.zero_stage}): ZeRO++ and MiCS "
                f"change how ZeRO-3 gathers partitioned weights; set deepspeed.zero_stage=3 (or "
                f"deepspeed=zero3), or turn {' and '.join(on)} off.")
        if self.zeropp.hpz_partition_size > 1 and self.mics_shard_size:
            raise ConfigError(
                f"deepspeed.zeropp.hpz_partition_size={self.zeropp.hpz_partition_size} with "
                f"deepspeed.mics_shard_size={self.mics_shard_size}: DeepSpeed does not combine "
                f"them (MiCS replaces the partition group that hpZ's secondary copy is cut "
                f"from); keep one: deepspeed.zeropp.hpz_partition_size=1 or "
                f"deepspeed.mics_shard_size=0.")

    def zero_sizes(self, dim: int) -> Dict[str, int]:
        """DeepSpeed's zero_optimization sizes for a model of width ``dim``, unset ones resolved
        (reduce bucket dim^2, prefetch bucket 0.9 dim^2, persistence threshold 10 dim, live
        parameters dim^2)."""
        def pick(value: Optional[int], auto: int) -> int:
            return int(value) if value is not None else auto

        return {
            "reduce_bucket_size": pick(self.reduce_bucket_size, dim * dim),
            "allgather_bucket_size": int(self.allgather_bucket_size),
            "stage3_prefetch_bucket_size": pick(self.stage3_prefetch_bucket_size,
                                                int(0.9 * dim * dim)),
            "stage3_param_persistence_threshold": pick(self.stage3_param_persistence_threshold,
                                                       10 * dim),
            "stage3_max_reuse_distance": int(self.stage3_max_reuse_distance),
            "stage3_max_live_parameters": pick(self.stage3_max_live_parameters, dim * dim),
            "sub_group_size": int(self.sub_group_size),
        }
