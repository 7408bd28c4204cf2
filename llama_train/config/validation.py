"""Semantic validation: the checks that need several groups at once (batch arithmetic against
the world size, sequence length against the model, precision and float8 against the device,
ZeRO++ and MiCS against the ranks per node, the sequence-parallel layout), run before any
process group starts. Each group checks its own fields when it is built (its ``__post_init__``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from llama_train.config.groups import TrainerConfig
from llama_train.config.schema import Config
from llama_train.errors import ConfigError
from llama_train.layout import ParallelLayout


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
             ranks_per_node: Optional[int] = None, fp8_device: bool = True) -> BatchPlan:
    """Checks across groups (each group checks its own fields when it is built). Raises
    ConfigError naming the key and the fix; returns the batch resolved for ``world_size``.
    ``ranks_per_node``: the launcher's ranks on this node (``Runtime.local_world_size``); by
    default read as ``engine.detect_runtime`` reads it (LOCAL_SIZE, LOCAL_WORLD_SIZE, else the
    world: one node). ``fp8_device=False``: float8 is not judged against ``device`` (a preview
    on another machine than the job's: :func:`check_float8` with no device)."""
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
    check_float8(cfg, device if fp8_device else None)
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


def check_float8(cfg: Config, device: Optional[str]) -> None:
    """float8.enabled needs bf16 and, unless emulated, a device with FP8 matmuls (the compute
    capability of a GPU is llama_train.engine.float8.check_device's, in preflight: it needs
    torch). ``device`` None: the job's device is not this machine's (the dry run's preview), so
    only what holds on any device is judged: an explicit precision other than bf16."""
    f8 = cfg.float8
    if not f8.enabled:
        return
    if device is None:
        if cfg.deepspeed.precision not in ("bf16", "auto"):  # auto: bf16 on CUDA
            device = "cuda"  # refused below by its precision alone, on any device
        else:
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
