"""The config groups of one run, one dataclass each (``optim``, ``trainer``, ``recovery``,
``sample``, ``tracking``, ``scaling``, ``float8``, ``parallel``), and the range and choice checks
each runs on itself in ``__post_init__``. The ``deepspeed`` group is
:mod:`llama_train.config.deepspeed_group`; the ``data`` group :mod:`llama_train.data.config`;
``model`` :class:`llama_train.model.args.ModelArgs`; ``comm`` :class:`llama_train.comm.CommConfig`;
the whole tree :mod:`llama_train.config.schema`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from llama_train.bounds import INT32_MAX, SEED_MAX, Range
from llama_train.errors import ConfigError
from llama_train.policy import may_change, per_launch


def _check_ranges(section: str, obj: Any, ranges: Dict[str, Range]) -> None:
    """Every numeric field of a group has a range (llama_train.bounds), checked here before
    any work starts: ``<section>.<name>=<value> must be <range>: <what it means>.``
    (tests/system/test_bounds.py holds a bad value for every numeric key)."""
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
    """FP8 linear layers (torchao's float8 training, llama_train/engine/float8.py): every
    ``nn.Linear`` of the blocks computes its matmuls in float8 with dynamic scales; the parameters,
    optimizer state and checkpoints stay as they are (bf16/fp32, same keys), so turning it on or off
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
