"""The only place that talks to DeepSpeed's engine: config translation and ``deepspeed.initialize``.

Everything DeepSpeed-specific (the JSON config, the accelerator choice, the process group) is
decided here from the Hydra sub-configs, so the model stays plain ``torch.nn`` and the training
loop only sees an engine with ``forward``/``backward``/``step``.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from llama_train.comm import CommConfig, apply_env
from llama_train.config import BatchPlan, DeepSpeedConfig, OptimConfig


@dataclass
class Runtime:
    """Where this process runs, known before the process group starts (from launcher env)."""

    device_type: str  # "cpu" | "cuda"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_runtime(device: str = "auto") -> Runtime:
    """Reads the launcher's environment; a plain ``llama-train`` becomes a world of one.

    Sets ``DS_ACCELERATOR`` before DeepSpeed is imported so it never guesses the accelerator.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("DS_ACCELERATOR", device)
    if "RANK" not in os.environ:  # not under a launcher
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world)))
    rt = Runtime(device, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), world,
                 local_world)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one host share its cores; oversubscribing them costs more than it gains.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if device == "cuda":
        torch.cuda.set_device(rt.local_rank)
    return rt


def init_distributed(rt: Runtime, comm: CommConfig) -> None:
    """NCCL on GPUs (NCCL_* env set first, from ``comm``), gloo on CPU."""
    import deepspeed

    backend = apply_env(comm, rt.device_type)
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        timeout=datetime.timedelta(seconds=comm.timeout_s),
    )
    if rt.device_type == "cpu":
        _unlink_shm_buffer(rt.rank)


def _unlink_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU shared-memory all-reduce creates a ~66 MB /dev/shm file per rank and never
    removes it, so every run leaks RAM until /dev/shm fills up. Once every rank has mapped its
    peers' buffers (after the barrier) the names are no longer needed: unlink ours, the mappings
    stay valid and the memory is freed when the job ends."""
    import torch.distributed as dist

    dist.barrier()
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_"
            f"{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


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
                    device_type: str) -> Dict[str, Any]:
    """Translate our sub-configs into DeepSpeed's JSON config."""
    precision = resolve_precision(ds, device_type)
    zero: Dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1:
        zero.update(
            contiguous_gradients=ds.contiguous_gradients,
            overlap_comm=ds.overlap_comm,
            reduce_bucket_size=ds.reduce_bucket_size,
            allgather_bucket_size=ds.allgather_bucket_size,
        )
    if ds.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=ds.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=ds.stage3_param_persistence_threshold,
            stage3_gather_16bit_weights_on_model_save=False,
        )
        zero.pop("allgather_bucket_size")
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device_type == "cuda"}

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
    cfg: Dict[str, Any] = {
        "train_batch_size": batch.global_batch,
        "train_micro_batch_size_per_gpu": batch.micro_batch,
        "gradient_accumulation_steps": batch.grad_accum,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": adam_params},
        "steps_per_print": ds.steps_per_print,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return cfg


def initialize(model: torch.nn.Module, param_groups, ds_config: Dict[str, Any],
               lr_scheduler_factory):
    """The one call to ``deepspeed.initialize``. Returns the engine."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups,
        config=ds_config,
        lr_scheduler=lr_scheduler_factory,
    )
    if engine.dp_world_size == 1 and ds_config["zero_optimization"]["stage"] == 0:
        # Nothing to reduce: skip DeepSpeed's flatten/all-reduce/copy-back of every gradient
        # (3.5% of a `small` step on one rank, docs/performance.md).
        engine.enable_backward_allreduce = False
    return engine


def zero3_init_context(ds_config: Dict[str, Any]):
    """Under ZeRO-3, build the model already partitioned (never whole on one rank)."""
    import contextlib

    if ds_config["zero_optimization"]["stage"] != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=ds_config)


def gathered_params(engine, stage: int):
    """Context in which every rank sees full parameters (ZeRO-3 gathers; others are no-ops)."""
    import contextlib

    if stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s for MFU: the datasheet dense bf16 figure on known GPUs, else a measured matmul."""
    datasheet = _datasheet_flops(device)
    if datasheet is not None:
        return datasheet
    return measure_matmul_flops(device, torch.float32 if precision == "fp32" else torch.bfloat16)


class PeakFlops:
    """The denominator of MFU, for the whole job (per-rank peak x world size).

    A measured peak (CPU, unknown GPUs) is a matmul timed at start-up; on a machine that was busy
    at that moment it reads low, and MFU comes out above 100%. So when the run beats a measured
    peak, the matmul is timed again and the higher reading kept. Datasheet figures and
    `trainer.peak_flops` are taken as given."""

    def __init__(self, device: torch.device, precision: str, world_size: int,
                 override: Optional[float] = None):
        self.device, self.precision, self.world_size = device, precision, world_size
        self.measured = override is None and _datasheet_flops(device) is None
        self.value = (override or peak_flops(device, precision)) * world_size

    def mfu(self, achieved: float) -> float:
        if self.measured and achieved > self.value:
            self.value = max(self.value, peak_flops(self.device, self.precision) * self.world_size)
        return achieved / self.value


def _datasheet_flops(device: torch.device) -> Optional[float]:
    """Dense bf16 datasheet peak of a known GPU, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
             "4090": 165e12, "V100": 125e12}
    return next((v for k, v in table.items() if k in name), None)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                         n: int = 1024, repeats: int = 5) -> float:
    """Best-of-N throughput of an n x n x n matmul on this process's threads."""
    import time

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def memory_stats(device: torch.device) -> Dict[str, float]:
    if device.type == "cuda":
        return {"mem_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    import psutil

    return {"mem_gb": psutil.Process().memory_info().rss / 2**30}


def unwrap(engine_or_model) -> torch.nn.Module:
    """The plain model (no engine or compile prefixes ever reach a checkpoint)."""
    m = getattr(engine_or_model, "module", engine_or_model)
    return getattr(m, "_orig_mod", m)


def opt_state_bytes(engine) -> Optional[int]:
    """Bytes of optimizer state (fp32 master copy + moments) held by this rank."""
    opt = engine.optimizer
    total = 0
    seen = set()
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        for v in state.values():
            if torch.is_tensor(v) and id(v) not in seen and v.numel() > 1:
                seen.add(id(v))
                total += v.numel() * v.element_size()
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for t in getattr(opt, attr, []) or []:
            if torch.is_tensor(t) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
