"""Structured Hydra configs: one dataclass per config group, registered in the ConfigStore.

Each YAML file under ``configs/<group>/`` is merged onto its dataclass, so an unknown key or a
wrong type fails while Hydra composes the config, and each dataclass checks its own values in
``__post_init__`` when :func:`load_config` builds it, with a message that names the key and the
fix. The few checks that need several groups at once (batch arithmetic against the world size,
sequence length against the model, precision against the device) are :func:`validate`. All of
it runs before any process group starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from llama_train.bounds import INT32_MAX, INT64_MAX, SEED_MAX, SIMULATE_MAX_RANKS, Range
from llama_train.comm import CommConfig
from llama_train.policy import may_change, per_launch
from llama_train.data.config import DataConfig
from llama_train.errors import ConfigError  # defined there, exported here as always
from llama_train.layout import ParallelLayout
from llama_train.model_args import ModelArgs


def _check_ranges(section: str, obj: Any, ranges: Dict[str, Range]) -> None:
    """Every numeric field of a group has a range (llama_train.bounds), checked here before
    any work starts: ``<section>.<name>=<value> must be <range>: <what it means>.``
    (tests/test_bounds.py holds a bad value for every numeric key)."""
    for name, rng in ranges.items():
        msg = rng.message(f"{section}.{name}", getattr(obj, name))
        if msg is not None:
            raise ConfigError(msg)


# Integer knobs: counts of steps, sequences, elements. Above these nothing but a run that fails
# late (an int32 kernel index, an allocation that cannot succeed) or never ends.
_COUNT = Range(1, INT32_MAX, integer=True)
_COUNT0 = Range(0, INT32_MAX, integer=True)
COMM_MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective stuck longer than a week is a hang
COMPILE_CHOICES = ("auto", "true", "false")  # trainer.compile


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} must be one of {', '.join(map(str, choices))}.")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (LLaMA defaults)."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps
    warmup_steps: int = 20
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    decay_norms_and_biases: bool = False
    decay_embeddings: bool = False

    def __post_init__(self) -> None:
        beta = "an exponential moving average's decay (LLaMA: 0.9 and 0.95)"
        _check_ranges("optim", self, {
            # above 1 AdamW moves every weight by more than 1 a step: NaN within steps
            "lr": Range(0, 1, lo_open=True, fix="AdamW's peak learning rate (LLaMA: 3e-4)"),
            "min_lr_ratio": Range(0, 1, fix="the cosine's floor as a fraction of optim.lr"),
            "warmup_steps": _COUNT0,
            "beta1": Range(0, 1, hi_open=True, fix=beta),
            "beta2": Range(0, 1, hi_open=True, fix=beta),
            "eps": Range(0, 1, lo_open=True, hi_open=True,
                         fix="AdamW's denominator guard (LLaMA: 1e-8)"),
            "weight_decay": Range(0, fix="decoupled decay per unit of learning rate (0.1)"),
            "grad_clip": Range(0, fix="the largest gradient norm, 0 for no clipping"),
        })
        if self.lr * self.weight_decay >= 1:
            raise ConfigError(
                f"optim.weight_decay={self.weight_decay} with optim.lr={self.lr}: each step "
                f"multiplies every decayed weight by 1 - lr x weight_decay = "
                f"{1 - self.lr * self.weight_decay:g} (<= 0: zeroed or flipped); lower "
                f"optim.weight_decay below 1 / optim.lr (LLaMA: 0.1).")


@dataclass
class TrainerConfig:
    """The loop: how long, how big a batch, how often to log, evaluate and save, where."""

    output_dir: str = per_launch("outputs/llama-train")
    max_steps: int = may_change(200)
    seq_len: int = 256
    micro_batch: int = may_change(8)  # sequences per rank per forward/backward
    global_batch: Optional[int] = may_change(None)  # sequences per optimizer step (default: micro_batch * world)
    global_batch_tokens: Optional[int] = may_change(None)  # alternative to global_batch, in tokens
    log_every: int = may_change(10)
    eval_every: int = may_change(50)
    # The evaluation set: the first eval_sequences windows of the val split, each evaluated once
    # (split across ranks): the same set whatever the micro-batch, world size or ZeRO stage.
    eval_sequences: int = may_change(32)
    # Packed windows hold several documents (each ends with EOS): true = a token attends only
    # to earlier tokens of its own document (LLaMA 3), false = to every earlier token.
    document_mask: bool = False
    save_every: int = may_change(100)
    keep_last: int = may_change(3)
    resume: str = per_launch("auto")  # auto | never | <checkpoint path>
    # Print the resolved plan (shape, parameters, tokens, steps, epochs, FLOPs, estimated time)
    # and exit: no process group, no data preparation.
    dry_run: bool = per_launch(False)
    # A run that starts from step 0 in an output_dir holding another history (checkpoints or
    # metrics): refuse (exit 2; exit 3 when resume=auto found only checkpoints that fail to
    # verify), archive it to <output_dir>/archive/<UTC time>/, or overwrite (delete) it.
    on_existing: str = per_launch("refuse")
    # Run-defining keys (model.*, optim.*, data.*, trainer.seed, ...: every field not marked
    # may_change/per_launch, see llama_train.policy) that may differ from the checkpoint's when
    # resuming, e.g. [optim.lr] or a whole group [optim]; docs/reliability.md.
    allow_config_change: List[str] = per_launch(factory=list)
    steps_this_run: Optional[int] = per_launch(None)  # stop (with a checkpoint) after this many steps
    # Start from weights: a HF Llama dir or a llama-import .pt. The data is tokenized with the
    # tokenizer they were trained with (the dir's tokenizer.model) unless data.tokenizer names
    # one with the same pieces; weights that carry none (a .pt) need data.tokenizer.
    init_from: Optional[str] = per_launch(None)
    seed: int = 1337
    device: str = may_change("auto")  # auto | cpu | cuda
    # torch.compile each transformer block: auto (on CUDA, where it pays: 1.28x on one H200,
    # docs/performance.md; CPU stays eager, where a cold compile costs more than a short run
    # gains), true or false. YAML booleans and the strings "true"/"false" both work.
    compile: str = may_change("auto")
    # Peak FLOP/s per device for MFU. None: the datasheet bf16 figure on known GPUs, else a matmul
    # measured once per machine and thread count, cached in $LLAMA_TRAIN_CACHE/peak_flops.json.
    peak_flops: Optional[float] = may_change(None)
    verify_checksums: bool = may_change(True)  # sha256 of checkpoint files on save and before resume
    # Save in the background: the loop waits only while the state is copied to host memory;
    # writes, fsync, checksums and the manifest go on while it trains (docs/reliability.md).
    # The copy holds one more checkpoint's worth of this rank's state in host memory while the
    # write is in flight: false where host memory is short (large CPU-offloaded states).
    async_save: bool = may_change(True)

    def __post_init__(self) -> None:
        _check_ranges("trainer", self, {
            "max_steps": _COUNT, "seq_len": _COUNT,
            # more sequences per forward than any device holds: an allocation that must fail
            "micro_batch": Range(1, 2**20, integer=True, fix="sequences per rank per forward"),
            "global_batch": Range(1, INT32_MAX, integer=True, optional=True),
            "global_batch_tokens": Range(1, 2**40, integer=True, optional=True),
            "log_every": _COUNT, "eval_every": _COUNT, "save_every": _COUNT,
            "keep_last": Range(1, INT32_MAX, integer=True, fix="checkpoints kept on disk"),
            "eval_sequences": _COUNT,
            "steps_this_run": Range(1, INT32_MAX, integer=True, optional=True),
            "seed": Range(0, SEED_MAX, integer=True, fix="numpy's and SentencePiece's seeds "
                                                          "are unsigned 32-bit"),
            # 1e18 FLOP/s is a thousand H100s' bf16 peak: a typo, and MFU would read ~0
            "peak_flops": Range(0, 1e18, lo_open=True, optional=True,
                                fix="one device's peak FLOP/s, or null to measure it"),
        })
        if self.resume not in ("auto", "never") and not os.path.exists(self.resume):
            raise ConfigError(f"trainer.resume={self.resume!r} is neither 'auto', 'never' nor an "
                              f"existing checkpoint path.")
        if self.resume not in ("auto", "never") and not os.path.isdir(self.resume):
            raise ConfigError(
                f"trainer.resume={self.resume!r} is a file, not a checkpoint: give a checkpoint "
                f"directory (<output_dir>/checkpoints/step_NNNNNNNN), or 'auto' to continue from "
                f"the newest complete one in trainer.output_dir.")
        _check_choice("trainer.on_existing", self.on_existing, ("refuse", "archive", "overwrite"))
        if self.init_from is not None and not os.path.exists(self.init_from):
            raise ConfigError(
                f"trainer.init_from={self.init_from!r} does not exist: give a Hugging Face Llama "
                f"directory or a .pt written by llama-import."
            )
        _check_choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        # OmegaConf stores a YAML boolean in this str field as "True"/"False"
        compile_ = str(self.compile).strip().lower()
        if compile_ not in COMPILE_CHOICES:
            raise ConfigError(
                f"trainer.compile={self.compile!r} must be one of {', '.join(COMPILE_CHOICES)}: "
                f"auto compiles each block on CUDA and leaves CPU eager, true always compiles, "
                f"false never does.")
        self.compile = compile_

    def compiles(self, device_type: str) -> Tuple[bool, str]:
        """Whether each block is compiled on ``device_type``, and why (for the start log)."""
        if self.compile == "auto":
            on = device_type == "cuda"
            return on, "auto: CUDA" if on else f"auto: {device_type.upper()} stays eager"
        return self.compile == "true", "as set"


@dataclass
class RecoveryConfig:
    """Fault policy: a non-finite loss or gradient skips the step; after ``max_bad_steps`` in a
    row, a loss above ``spike_factor`` x the running mean, or a non-finite step that was applied,
    roll back to the newest checkpoint of this run and skip the offending data window."""

    max_bad_steps: int = 3
    spike_factor: float = 0.0  # 0 disables spike detection
    spike_warmup_steps: int = 20
    max_rollbacks: int = 3

    def __post_init__(self) -> None:
        _check_ranges("recovery", self, {
            "max_bad_steps": _COUNT0, "spike_warmup_steps": _COUNT0, "max_rollbacks": _COUNT0,
            "spike_factor": Range(0, fix="0 turns spike detection off")})
        if 0 < self.spike_factor <= 1:  # every loss is above a fraction of its own mean
            raise ConfigError(
                f"recovery.spike_factor={self.spike_factor} would call every step a spike (a "
                f"loss above {self.spike_factor:g} x the running mean of losses) and roll back "
                f"each: give a factor > 1 (e.g. 3), or 0 to turn spike detection off.")


@dataclass
class SampleConfig:
    """The text sample generated at the end of a run."""

    prompt: str = "The"
    tokens: int = 64  # 0: no sample
    temperature: float = 0.8
    top_k: Optional[int] = 40

    def __post_init__(self) -> None:
        _check_ranges("sample", self, {
            "tokens": Range(0, INT32_MAX, integer=True, fix="tokens to sample, 0 for none"),
            # above 100 the logits of any trained model are flattened to a uniform draw
            "temperature": Range(0, 100, fix="0 is greedy, 1 the model's distribution"),
            "top_k": Range(1, INT32_MAX, integer=True, optional=True,
                           fix="the number of most likely tokens to sample from; null samples "
                               "from all of them"),
        })
        if self.tokens and not self.prompt:
            raise ConfigError("sample.prompt is empty: the sample continues a prompt; give one "
                              "(e.g. sample.prompt=The) or set sample.tokens=0 for no sample.")


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
    def leaves(d: Dict[str, Any], prefix: str = ""):  # config.flatten, defined below import time
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


@dataclass
class WandbConfig:
    mode: Optional[str] = None  # online | offline | disabled; None: online iff an API key is set
    # null: $WANDB_PROJECT, else "llama_train"; entity null: $WANDB_ENTITY, else the API key's
    # default entity (tracking.resolve_wandb_target). Given here, the config wins.
    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    dir: Optional[str] = None  # default: <output_dir>

    def __post_init__(self) -> None:
        _check_choice("tracking.wandb.mode", self.mode, (None, "online", "offline", "disabled"))


@dataclass
class TensorBoardConfig:
    """TensorBoard event files (``torch.utils.tensorboard``), written by rank 0; off by default."""

    enabled: bool = False
    dir: Optional[str] = None  # default: <output_dir>/tensorboard


@dataclass
class TrackingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    metrics_file: str = "metrics.jsonl"
    console: bool = True


@dataclass
class ScalingConfig:
    """Drives the compute-/inference-optimal experiments (see configs/experiment)."""

    mode: str = "none"  # none | compute_optimal | inference_optimal | fixed
    flops: Optional[float] = None  # training budget C = 6 N D
    inference_tokens: Optional[float] = None
    fit: str = "chinchilla"  # chinchilla | epoch | <yaml with E, A, B, alpha, beta>
    params: Optional[float] = None  # mode=fixed: train this many params on flops / (6 N) tokens
    vocab_size: Optional[int] = None  # default: model.vocab_size
    # The planned N is this count of the chosen shape: total (Chinchilla's N, embeddings
    # included) or non_embedding (Kaplan's; where a large vocabulary dominates a tiny model).
    count: str = "total"
    tolerance: float = per_launch(0.05)  # how far the chosen shape's count may be from the planned N
    # Only shapes of the planner's family (dim/n_layers within 1.6x of its target aspect ratio,
    # the shapes our IsoFLOP sweep fits its law on): where none is within tolerance, an error
    # naming the closest, rather than a deeper or shallower shape the law never saw.
    family_only: bool = False
    # The plan's tokens over the train split: above 1 warns (repeated data), above this refuses.
    max_epochs: float = per_launch(4.0)
    # The learning rate per run: optim.lr is the rate at lr_ref_params parameters (this count)
    # and lr_ref_flops training FLOPs (6 N D of the run); a run of N and C trains at
    # optim.lr * (N / lr_ref_params)^-lr_exponent * (C / lr_ref_flops)^-lr_flops_exponent.
    # A null reference leaves its factor out (both null: optim.lr as given).
    lr_ref_params: Optional[float] = None
    lr_exponent: float = 0.0
    lr_ref_flops: Optional[float] = None
    lr_flops_exponent: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("scaling.mode", self.mode,
                      ("none", "compute_optimal", "inference_optimal", "fixed"))
        _check_choice("scaling.count", self.count, ("total", "non_embedding"))
        # 1e30 FLOPs is 10^5 x the largest training runs to date: past it a plan is a typo
        flops = Range(0, 1e30, lo_open=True, optional=True, fix="FLOPs, C = 6 N D")
        exponent = Range(-2, 2, fix="a power law's exponent (published fits: 0.1 to 0.5)")
        _check_ranges("scaling", self, {
            "flops": flops,
            "inference_tokens": Range(0, 1e30, optional=True, fix="lifetime inference tokens"),
            "params": Range(1, 1e15, optional=True, fix="a parameter count"),
            "vocab_size": Range(1, 2**32, integer=True, optional=True,
                                fix="null: model.vocab_size"),
            "tolerance": Range(0, 1, lo_open=True, hi_open=True, fix="e.g. 0.05"),
            "max_epochs": Range(0, lo_open=True, fix="passes over the train split"),
            "lr_ref_params": Range(0, 1e15, lo_open=True, optional=True),
            "lr_ref_flops": flops,
            "lr_exponent": exponent, "lr_flops_exponent": exponent,
        })
        for ref, exp, what in (("lr_ref_params", "lr_exponent", "size"),
                               ("lr_ref_flops", "lr_flops_exponent", "training FLOPs")):
            value = getattr(self, ref)
            if value is not None and not value > 0:
                raise ConfigError(f"scaling.{ref}={value} must be > 0 (the {what} at which "
                                  f"optim.lr is the tuned rate), or null.")
            if getattr(self, exp) and value is None:
                raise ConfigError(f"scaling.{exp}={getattr(self, exp)} needs scaling.{ref} (the "
                                  f"{what} at which optim.lr is the tuned rate).")


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's recipe names


@dataclass
class Float8Config:
    """FP8 linear layers (torchao's float8 training, llama_train/float8.py): every ``nn.Linear``
    of the blocks computes its matmuls in float8 with dynamic scales; the parameters, optimizer
    state and checkpoints stay as they are (bf16/fp32, same keys), so turning it on or off
    between resumes only changes the numerics of the steps after it (logged, never refused)."""

    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp (torchao's recipes)
    # Modules kept in bf16, by name: an entry matches a module named so or ending in .<entry>
    # (output: the output projection, whose loss path never calls its forward; w2: every block's
    # down projection). Linears whose in/out features are not multiples of 16 (the FP8 matmul's
    # alignment) are always kept.
    skip: List[str] = field(default_factory=lambda: ["output"])
    # torchao's emulated FP8 matmul (casts to float8 and back, multiplies in high precision):
    # the numerics of FP8 on a device without FP8 matmuls (CPU tests, GPUs below sm_89), no speed
    emulate: bool = False

    def __post_init__(self) -> None:
        _check_choice("float8.recipe", self.recipe, FLOAT8_RECIPES)
        bad = [s for s in self.skip if not isinstance(s, str) or not s.strip(".")]
        if bad:
            raise ConfigError(f"float8.skip={list(self.skip)!r}: each entry is a module name "
                              f"(e.g. output, w2, layers.0.attention.wq); got {bad!r}.")


@dataclass
class ParallelConfig:
    """How ranks share the work beyond data parallelism."""

    sequence: int = may_change(1)
    """N > 1: DeepSpeed-Ulysses sequence parallelism. Each group of N consecutive ranks shares
    every sequence: a rank holds seq_len / N tokens of it, and attention trades sequence for
    heads with an all-to-all so each rank attends over the whole sequence for n_heads / N heads.
    The data-parallel size becomes ranks / N. May change on resume (the global batch may not)."""

    def __post_init__(self) -> None:
        if isinstance(self.sequence, bool) or not isinstance(self.sequence, int) or self.sequence < 1:
            raise ConfigError(f"parallel.sequence={self.sequence!r} must be a positive integer "
                              f"(1: off; N: N ranks share each sequence)")


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    recovery: RecoveryConfig = may_change(factory=RecoveryConfig)
    sample: SampleConfig = may_change(factory=SampleConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    tracking: TrackingConfig = may_change(factory=TrackingConfig)
    comm: CommConfig = may_change(factory=CommConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # may change on resume: FP8 on or off changes how the matmuls round, not the weights or state
    float8: Float8Config = may_change(factory=Float8Config)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    experiment: Optional[Any] = None

    def __post_init__(self) -> None:
        # CommConfig (llama_train.comm) refuses a zero timeout or a 1-rank simulation; the
        # upper bounds of its numbers are here, with every other group's
        _check_ranges("comm", self.comm, {
            "timeout_s": Range(1, COMM_MAX_TIMEOUT_S, integer=True,
                               fix="seconds a collective may take before the job fails"),
            "simulate_ranks": Range(0, SIMULATE_MAX_RANKS, integer=True,
                                    fix="the ranks of the job to simulate (a simulated rank "
                                        "answers every collective for all of them, so its "
                                        "saves slow with N), or 0 to run for real"),
            "simulate_rank": Range(0, SIMULATE_MAX_RANKS - 1, integer=True),
        })


def short_number(x: Any) -> str:
    """``3e14`` for 3.0e14 (the ``${sci:...}`` resolver: readable directory names)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if abs(v) < 1e4:
        return f"{v:.6g}"
    mantissa, exponent = f"{v:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def register_configs() -> None:
    if not OmegaConf.has_resolver("sci"):
        OmegaConf.register_new_resolver("sci", short_number)
    cs = ConfigStore.instance()
    # The primary config extends this schema, so every group's YAML is merged onto its typed node.
    schema = OmegaConf.structured(Config)
    # deepspeed.extra takes keys of DeepSpeed's we do not list: out of Hydra's struct mode, so
    # deepspeed.extra.comms_logger.enabled=true needs no '+' (the flag survives composition)
    OmegaConf.set_struct(schema.deepspeed.extra, False)
    cs.store(name="llama_train_schema", node=schema)


register_configs()  # on import: whoever composes configs/ (the app, tests, tools) finds the schema


# ----------------------------------------------------------------------------------------------
# Semantic validation (runs before any process group starts)


@dataclass
class BatchPlan:
    """The global batch resolved against the data-parallel world size."""

    world_size: int
    micro_batch: int
    grad_accum: int
    global_batch: int  # sequences per optimizer step
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def resolve_batch(trainer: TrainerConfig, world_size: int) -> BatchPlan:
    t = trainer
    if t.global_batch is not None and t.global_batch_tokens is not None:
        raise ConfigError(
            "trainer.global_batch and trainer.global_batch_tokens are both set: set only one "
            "(sequences or tokens per optimizer step)."
        )
    if t.global_batch_tokens is not None:
        if t.global_batch_tokens <= 0 or t.global_batch_tokens % t.seq_len:
            raise ConfigError(
                f"trainer.global_batch_tokens={t.global_batch_tokens} is not a positive multiple of "
                f"trainer.seq_len={t.seq_len}: use a multiple of {t.seq_len}."
            )
        global_batch = t.global_batch_tokens // t.seq_len
        key = "trainer.global_batch_tokens"
    elif t.global_batch is not None:
        global_batch, key = t.global_batch, "trainer.global_batch"
    else:
        global_batch, key = t.micro_batch * world_size, "trainer.micro_batch"
    if global_batch <= 0:
        raise ConfigError(f"{key} must be positive, got {global_batch}.")
    per_step = t.micro_batch * world_size
    if global_batch % per_step:
        raise ConfigError(
            f"{key} gives a global batch of {global_batch} sequences, which is not divisible by "
            f"trainer.micro_batch ({t.micro_batch}) x data-parallel world size ({world_size}) = "
            f"{per_step}: choose a global batch that is a multiple of {per_step}, or change "
            f"trainer.micro_batch or the number of ranks."
        )
    return BatchPlan(world_size, t.micro_batch, global_batch // per_step, global_batch, t.seq_len)


def validate(cfg: Config, world_size: int, device: str,
             ranks_per_node: Optional[int] = None) -> BatchPlan:
    """Checks across groups (each group checks its own fields when it is built). Raises
    ConfigError naming the key and the fix; returns the batch resolved for ``world_size``.
    ``ranks_per_node``: the launcher's ranks on this node (``Runtime.local_world_size``); by
    default read as ``engine.detect_runtime`` reads it (LOCAL_SIZE, LOCAL_WORLD_SIZE, else the
    world: one node)."""
    t = cfg.trainer
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}: "
            f"lower trainer.seq_len or raise model.max_seq_len."
        )
    if cfg.sample.tokens >= cfg.model.max_seq_len:
        raise ConfigError(
            f"sample.tokens={cfg.sample.tokens} leaves no room for the prompt in "
            f"model.max_seq_len={cfg.model.max_seq_len} (prompt + sample must fit): lower "
            f"sample.tokens, or set it to 0 for no sample.")
    if cfg.data.shard_tokens <= t.seq_len:  # every window would span two or more files
        raise ConfigError(
            f"data.shard_tokens={cfg.data.shard_tokens} is not longer than one training window "
            f"(trainer.seq_len + 1 = {t.seq_len + 1} tokens): raise data.shard_tokens (default "
            f"50000000).")
    if device == "cpu" and cfg.deepspeed.precision == "fp16":
        raise ConfigError("deepspeed.precision=fp16 is not supported on CPU: use fp32 (or bf16).")
    _check_float8(cfg, device)
    _check_zeropp_mics(cfg, world_size, device, ranks_per_node)
    return resolve_batch(t, parallel_layout(cfg, world_size).data_parallel)


def mics_unavailable() -> Optional[str]:
    """Why ``deepspeed.mics_shard_size`` cannot run here, or None. Read from DeepSpeed's files,
    without importing it (this runs before DeepSpeed is imported): DeepSpeed removed MiCS
    after 0.19.6 (0.19.8 has no ``runtime/zero/mics.py``; its config refuses
    ``zero_optimization.mics_shard_size``, DeepSpeed issue 8489). With a DeepSpeed that has it our ZeRO-3 build would still
    need ``deepspeed.zero.MiCS_Init`` in place of ``zero.Init``: MiCS's optimizer reads the
    shard groups MiCS_Init attaches to each parameter (``param.comm``)."""
    import importlib.util
    from importlib import metadata

    try:
        spec = importlib.util.find_spec("deepspeed")
        version = metadata.version("deepspeed")
    except (ImportError, ValueError, metadata.PackageNotFoundError):
        return "DeepSpeed is not installed"
    where = list(spec.submodule_search_locations or []) if spec else []
    if not any(os.path.isfile(os.path.join(d, "runtime", "zero", "mics.py")) for d in where):
        return (f"the installed DeepSpeed {version} has no MiCS (DeepSpeed removed it, issue "
                f"8489; its config refuses zero_optimization.mics_shard_size)")
    return (f"llama_train builds ZeRO-3 models with deepspeed.zero.Init, and DeepSpeed "
            f"{version}'s MiCS needs deepspeed.zero.MiCS_Init (engine/build.py)")


def _check_zeropp_mics(cfg: Config, world_size: int, device: str,
                       ranks_per_node: Optional[int]) -> None:
    """ZeRO++ and MiCS against the job (their stage and their pairing: DeepSpeedConfig): the
    quantized paths need CUDA; hpZ and MiCS groups are consecutive ranks, so a size must divide
    the world and the ranks of a node (a group that spans two nodes gathers over the network,
    the traffic they exist to keep inside a node); MiCS must exist in this DeepSpeed."""
    ds = cfg.deepspeed
    zpp = ds.zeropp
    for name in ("quantized_weights", "quantized_gradients"):
        if getattr(zpp, name) and device != "cuda":
            raise ConfigError(
                f"deepspeed.zeropp.{name}=true on {device}: ZeRO++'s quantized "
                f"{'all-gather' if name == 'quantized_weights' else 'reduce-scatter'} runs "
                f"DeepSpeed's CUDA quantizer kernels (QuantizerBuilder), which have no CPU "
                f"implementation ('This op had not been implemented on CPU backend'); run on "
                f"GPUs or set deepspeed.zeropp.{name}=false.")
    if ds.mics_shard_size:
        why = mics_unavailable()
        if why is not None:
            raise ConfigError(
                f"deepspeed.mics_shard_size={ds.mics_shard_size}: MiCS cannot run here: {why}. "
                f"Set deepspeed.mics_shard_size=0; deepspeed.zeropp.hpz_partition_size=<ranks "
                f"per node> keeps the weight all-gathers of backward inside a node instead.")
    sizes = [(k, v) for k, v in (("deepspeed.zeropp.hpz_partition_size", zpp.hpz_partition_size),
                                 ("deepspeed.mics_shard_size", ds.mics_shard_size)) if v > 1]
    if sizes and cfg.parallel.sequence > 1:
        raise ConfigError(
            f"{sizes[0][0]}={sizes[0][1]} with parallel.sequence={cfg.parallel.sequence}: not "
            f"verified together (DeepSpeed cuts hpZ and MiCS groups from the global ranks, "
            f"sequence parallelism from the same ranks); set parallel.sequence=1 or "
            f"{sizes[0][0]}={'1' if 'hpz' in sizes[0][0] else '0'}.")
    if ranks_per_node is None:  # as engine.detect_runtime reads it
        ranks_per_node = int(os.environ.get("LOCAL_SIZE",
                                            os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    for key, n in sizes:
        off = "1" if "hpz" in key else "0"
        if world_size % n:
            raise ConfigError(
                f"{key}={n} does not divide the {world_size} rank(s): the ranks form groups of "
                f"{n} consecutive ranks; choose a divisor of {world_size} that divides the ranks "
                f"per node, or {key}={off} for off.")
        # a simulated rank has no node: its layout is the planned job's, checked when it runs
        if not cfg.comm.simulate_ranks and ranks_per_node % n:
            raise ConfigError(
                f"{key}={n} does not fit inside a node of {ranks_per_node} rank(s) (groups of "
                f"{n} consecutive ranks would span nodes and gather over the network, the "
                f"traffic it exists to keep inside a node): choose a divisor of the ranks per "
                f"node ({ranks_per_node}), or {key}={off} for off.")


def _check_float8(cfg: Config, device: str) -> None:
    """float8.enabled needs bf16 and, unless emulated, a device with FP8 matmuls (the compute
    capability of a GPU is llama_train.float8.check_device's, in preflight: it needs torch)."""
    f8 = cfg.float8
    if not f8.enabled:
        return
    if device != "cuda" and not f8.emulate:
        raise ConfigError(
            f"float8.enabled=true on {device}, which has no FP8 matmuls: set "
            f"float8.emulate=true (the numerics of FP8, no speed-up) or float8.enabled=false.")
    precision = cfg.deepspeed.precision
    if precision == "auto":  # engine.ds_config.resolve_precision: bf16 on CUDA, fp32 elsewhere
        precision = "bf16" if device == "cuda" else "fp32"
    if precision != "bf16":
        raise ConfigError(
            f"float8.enabled=true needs deepspeed.precision=bf16 (resolved: {precision}): the "
            f"FP8 matmuls take and give bf16 activations; set deepspeed.precision=bf16, or "
            f"float8.enabled=false.")


def parallel_layout(cfg: Config, world_size: int, rank: int = 0) -> ParallelLayout:
    """How ``world_size`` ranks share the work under this config (:mod:`llama_train.layout`:
    ranks / parallel.sequence data-parallel replicas, this ``rank``'s coordinates). Raises
    ConfigError (key and fix) for a sequence-parallel layout that cannot work."""
    m = cfg.model
    why = ParallelLayout.refusal(world_size, cfg.parallel.sequence, seq_len=cfg.trainer.seq_len,
                                 n_heads=m.n_heads, kv_heads=m.kv_heads,
                                 simulated=bool(cfg.comm.simulate_ranks))
    if why is not None:
        raise ConfigError(why)
    return ParallelLayout(world_size, rank, cfg.parallel.sequence)


def config_warnings(cfg: Config) -> List[str]:
    """Settings that run but are probably not what was meant: logged at start, not refused."""
    out, t, o = [], cfg.trainer, cfg.optim
    if o.warmup_steps >= t.max_steps:
        out.append(f"optim.warmup_steps={o.warmup_steps} >= trainer.max_steps={t.max_steps}: the "
                   f"learning rate never reaches optim.lr={o.lr:g} and the cosine decay never "
                   f"runs. Lower optim.warmup_steps (usually 1-10% of the steps).")
    return out


def flatten(d: Any, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty dict stays a leaf)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v
                   else {f"{prefix}{k}": v})
    return out



# ----------------------------------------------------------------------------------------------
# Loading: Hydra's DictConfig -> the dataclasses above


def _reject_unknown_keys(node: DictConfig, prefix: str) -> None:
    """Hydra's ``+key=value`` can force a key into a typed node; we still refuse it."""
    import dataclasses

    typ = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
    for key in node.keys():
        name = f"{prefix}{key}"
        if fields is not None and key not in fields and not str(key).startswith("_"):
            raise ConfigError(unknown_key_message(name))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _reject_unknown_keys(child, f"{name}.")


def config_keys() -> List[str]:
    """Every key a user can set (``trainer.max_steps``, ``tracking.wandb.mode``, ...)."""
    return sorted(flatten(OmegaConf.to_container(OmegaConf.structured(Config))))


def unknown_key_message(key: str) -> str:
    """An unknown key, with the closest valid ones (a typo is the usual cause)."""
    import difflib

    keys = config_keys()
    near = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
    here = [k for k in keys if parent and k.startswith(parent) and "." not in k[len(parent):]]
    hint = (f"did you mean {' or '.join(near)}?" if near else
            f"valid keys under {parent[:-1]}: {', '.join(k[len(parent):] for k in here)}"
            if here else f"the groups are {', '.join(sorted({k.split('.')[0] for k in keys}))}")
    return (f"unknown config key {key!r}: {hint} (`llama-train --cfg job` prints every key with "
            f"its value).")


def _list_entry_types(node: Optional[type] = None) -> list:
    """The dataclasses that are list entries somewhere in the config (data.mixture's), found
    from the structured config's type hints."""
    import dataclasses
    import typing

    out = []
    for hint in typing.get_type_hints(node or Config).values():
        if dataclasses.is_dataclass(hint):
            out += _list_entry_types(hint)
        elif typing.get_origin(hint) is list:
            out += [t for t in typing.get_args(hint) if dataclasses.is_dataclass(t)]
    return out


def explain_composition_error(e: BaseException) -> Optional[str]:
    """Hydra's error for a command line it could not compose, as one message that names the
    key and the fix; None for anything else."""
    import difflib
    import re

    from hydra.errors import (ConfigCompositionException, MissingConfigException,
                              OverrideParseException, SearchPathException)
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cause = e.__cause__
    if isinstance(e, MissingConfigException) and e.options:
        m = re.search(r"Could not find '(?:.*/)?([^/']+)/([^/']+)'", str(e))
        if m:
            group, name = m.groups()
            near = difflib.get_close_matches(name, e.options, n=1, cutoff=0.85)
            return (f"{group}={name}: there is no such {group} config"
                    + (f"; did you mean {group}={near[0]}?" if near else ".")
                    + f" Available: {', '.join(e.options)} (configs/{group}/).")
    if isinstance(e, OverrideParseException):
        return (f"cannot parse an override on the command line (Hydra: {first.rstrip('.')}). "
                f"Overrides are key=value, e.g. trainer.max_steps=100; a sweep (with "
                f"--multirun) is key=a,b.")
    if isinstance(e, ConfigCompositionException) and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        m = re.search(r"override '([^']+)'", first)
        inner = re.search(r"Key '([^']+)' not in '(\w+)'", str(cause))
        typ = next((t for t in _list_entry_types() if inner and t.__name__ == inner.group(2)),
                   None)
        if m and typ is not None:  # a key inside an entry of a list (data.mixture)
            import dataclasses

            valid = [f.name for f in dataclasses.fields(typ)]
            near = difflib.get_close_matches(inner.group(1), valid, n=1)
            return (f"{m.group(1)}: unknown key {inner.group(1)!r} in an entry"
                    + (f"; did you mean {near[0]}?" if near else "")
                    + f" Valid keys: {', '.join(valid)}.")
        return unknown_key_message(m.group(1) if m else str(cause.full_key))
    if isinstance(e, ConfigCompositionException) and isinstance(cause, ValidationError):
        m = re.search(r"override (\S+)", first)
        said = str(cause).split("\n")[0].rstrip(".")
        return (f"{m.group(1) if m else cause.full_key}: {said}. Give {cause.full_key} a value "
                f"of its type (`llama-train --cfg job` shows each key's current value).")
    if isinstance(e, SearchPathException):  # --config-dir: e.g. a run directory not there
        return (f"{first.rstrip('.')}: give --config-dir a directory that exists (a run's "
                f"output_dir holds its config.yaml: --config-name config).")
    if isinstance(e, (ConfigCompositionException, MissingConfigException)):
        return f"the config could not be composed: {first}"
    return None


def _reject_non_finite(dcfg: DictConfig) -> None:
    """No setting means anything as NaN or infinity (``optim.lr=inf`` turned every weight NaN
    in one step): refuse them all by key, before any group is built."""
    import math

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list):  # data.mixture's entries
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number: give {key} a finite "
                              f"value (`llama-train --cfg job` shows its default).")

    try:
        container = OmegaConf.to_container(dcfg, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation error: the dataclasses report it
        return
    walk(container, "")


def load_config(dcfg: DictConfig) -> Config:
    """Hydra's composed config -> dataclasses; every group validates itself on the way."""
    dcfg = _on_the_schema(dcfg)
    _reject_unknown_keys(dcfg, "")
    _reject_non_finite(dcfg)
    try:
        return OmegaConf.to_object(dcfg)
    except Exception as e:  # OmegaConf wraps __post_init__ errors; keep the message
        cause = e.__cause__ or e
        raise ConfigError(str(cause).split("\n    full_key")[0]) from None


def _on_the_schema(dcfg: DictConfig) -> DictConfig:
    """A config file without our schema in its defaults (``--config-dir <run dir> --config-name
    config``: a run's saved config.yaml) composes to plain dicts, which failed at the first key
    read (an AttributeError); merged onto the schema, its keys and types are checked like any
    composed config's."""
    if OmegaConf.get_type(dcfg) is Config:
        return dcfg
    from omegaconf.errors import ConfigKeyError

    try:
        return OmegaConf.merge(OmegaConf.structured(Config), dcfg)
    except ConfigKeyError as e:  # a key the schema does not have
        raise ConfigError(unknown_key_message(e.full_key)) from None
    except Exception as e:  # noqa: BLE001 - a value of the wrong type: OmegaConf names the key
        raise ConfigError(f"{getattr(e, 'full_key', '')}: {str(e).splitlines()[0]}") from None


def to_container(cfg: DictConfig | Config) -> dict:
    """A plain, fully resolved dict (for saving and W&B) with secrets scrubbed."""
    if isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True)
    else:
        data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return scrub_secrets(data)


# Whole key names, not substrings: "token" must not hide data.tokenizer (a path) or
# trainer.global_batch_tokens. Case-insensitive; '-' counts as '_'.
_SECRET_NAMES = ("api_key", "apikey", "token", "secret", "password")
_SECRET_SUFFIXES = ("_token", "_key", "_apikey", "_secret", "_password")


def is_secret_key(key: Any) -> bool:
    """Whether a config key names a credential: one of _SECRET_NAMES, or ending in one of
    _SECRET_SUFFIXES (hf_token, aws_secret_key, db_password)."""
    k = str(key).lower().replace("-", "_")
    return k in _SECRET_NAMES or k.endswith(_SECRET_SUFFIXES)


def scrub_secrets(obj: Any) -> Any:
    """``obj`` with every string value under a secret key (is_secret_key) replaced by '***',
    and every credential of the environment inside any other string by ``$NAME``
    (scrub_secret_values), through nested dicts and lists (what config.yaml, checkpoints,
    run_info.json and W&B get). docs/reliability.md: secrets in saved files."""
    def by_key(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: ("***" if is_secret_key(k) and isinstance(v, str) else by_key(v))
                    for k, v in o.items()}
        if isinstance(o, list):
            return [by_key(v) for v in o]
        return o

    from llama_train.records import scrub_secret_values

    return scrub_secret_values(by_key(obj))


__all__ = [
    "BatchPlan", "Config", "ConfigError", "DeepSpeedConfig", "Float8Config", "OptimConfig",
    "RecoveryConfig", "SampleConfig", "ScalingConfig", "TensorBoardConfig", "TrackingConfig",
    "TrainerConfig", "WandbConfig", "MISSING",
    "load_config", "register_configs", "resolve_batch", "to_container", "validate",
]
