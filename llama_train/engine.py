"""The only place that talks to DeepSpeed's engine: config translation and ``deepspeed.initialize``.

Everything DeepSpeed-specific (the JSON config, the accelerator choice, the process group) is
decided here from the Hydra sub-configs, so the model stays plain ``torch.nn`` and the training
loop only sees an engine with ``forward``/``backward``/``step``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch

from llama_train import watchdog
from llama_train.comm import CommConfig, apply_env
from llama_train.proc import ds_shm_buffer, free_port
from llama_train.config import BatchPlan, ConfigError, DeepSpeedConfig, OptimConfig


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


def detect_runtime(device: str = "auto") -> Runtime:
    """Reads the launcher's environment; a plain ``llama-train`` becomes a world of one.

    Sets ``DS_ACCELERATOR`` before DeepSpeed is imported so it never guesses the accelerator.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "torch finds no usable CUDA device")
        raise ConfigError(f"trainer.device=cuda but {why}: run on a GPU machine, or set "
                          f"trainer.device=auto (picks the GPU when there is one) or cpu.")
    os.environ.setdefault("DS_ACCELERATOR", device)
    if "RANK" not in os.environ:  # not under a launcher
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
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


def shutdown_distributed() -> None:
    """End the process group and make DeepSpeed forget the groups it cached from it, so a later
    :func:`init_distributed` in this process (a program that embeds the trainer, the tests)
    starts clean."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                 "_TENSOR_MODEL_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)


def init_distributed(comm: Optional[CommConfig] = None, device_type: str = "cpu") -> str:
    """Start the process group (the only place that does): NCCL on GPUs, its ``NCCL_*``
    variables set first from ``comm``; gloo on CPU. Expects the launcher's variables (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT); :func:`detect_runtime` sets them for a plain process.
    With several ranks, also starts the hang watchdog (:mod:`llama_train.watchdog`): a rank that
    makes no progress for ``comm.timeout_s`` stops every rank with exit code 5. Returns the
    backend name."""
    import deepspeed
    import torch.distributed as dist

    comm = comm if comm is not None else CommConfig()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variables {missing} are not set; start the program "
            "through a launcher, e.g. `deepspeed --num_gpus 2 --module <module> ...`")
    backend = apply_env(comm, device_type)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # the watchdog (started below) stops a job after comm.timeout_s without progress from a
    # rank; a collective gives up a few seconds later, as the backstop
    timeout = datetime.timedelta(seconds=int(comm.timeout_s) + watchdog.COLLECTIVE_MARGIN_S)
    with _without_shm_comm_op(device_type == "cpu"):
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=timeout)
    _default_group_timeout(timeout)
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        # Ranks reach this point seconds apart on a loaded host (imports, data checks): a skew
        # at start-up is not a hang. Past this barrier they run in step, watched.
        dist.monitored_barrier(timeout=max(timeout, STARTUP_TIMEOUT))
    if device_type == "cpu" and shm_comm_op_loaded():
        _unlink_shm_buffer(dist.get_rank())
    watchdog.start(comm.timeout_s, dist.get_rank(), dist.get_world_size())
    return backend


STARTUP_TIMEOUT = datetime.timedelta(minutes=10)


def _default_group_timeout(timeout: datetime.timedelta) -> None:
    """Every process group created from now on has the default group's timeout.

    ``init_process_group`` takes the timeout for the default group only; a group made later with
    ``new_group`` and no timeout (DeepSpeed's ZeRO data-parallel groups) gets torch's default:
    30 min on gloo, 10 min on NCCL. A collective stuck on such a group waited 30 min on CPU
    whatever ``comm.timeout_s`` said (issue 12). torch reads these module defaults at each
    ``new_group``."""
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = timeout


@contextlib.contextmanager
def _without_shm_comm_op(skip: bool) -> Iterator[None]:
    """Inside (when ``skip``): DeepSpeed starts its torch comm backend without its CPU
    shared-memory comm op (``deepspeed_shm_comm_op``).

    DeepSpeed 0.19.8's ``TorchBackend.__init__`` calls ``deepspeed.comm.torch.build_shm_op()`` on
    every start: it probes every op builder for compatibility (compiler subprocesses), JIT-loads
    the op through torch's cpp_extension (ninja; a C++ build of 30-70 s on 2 cores whenever
    ``TORCH_EXTENSIONS_DIR`` holds no build yet, e.g. a fresh container or the default
    ``~/.cache/torch_extensions``), prints "... built successfully" on every rank, and maps a
    ~66 MB /dev/shm buffer per rank. The op serves one call, ``inference_all_reduce`` (DeepSpeed
    inference's tensor-parallel layers), which without it uses ``torch.distributed.all_reduce``;
    training's collectives (gradient all-reduce, ZeRO's reduce-scatter/all-gather, barriers) all
    go through ``torch.distributed`` either way (docs/benchmarks-startup.md). ``build_shm_op`` is
    looked up at call time, so it is replaced for the duration of the call only. On GPUs
    DeepSpeed has no such op and nothing changes; a DeepSpeed without ``build_shm_op`` is left
    alone (and :func:`shm_comm_op_loaded` then says whether its buffer must be unlinked)."""
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    real = getattr(ds_torch, "build_shm_op", None)
    if not skip or real is None:
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = real


def shm_comm_op_loaded() -> bool:
    """Whether DeepSpeed's comm backend of this process holds the CPU shared-memory comm op."""
    import importlib

    cdb = getattr(importlib.import_module("deepspeed.comm.comm"), "cdb", None)
    return getattr(cdb, "shm_comm_op", None) is not None


def _unlink_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU shared-memory all-reduce (when loaded: see :func:`_without_shm_comm_op`)
    creates a ~66 MB /dev/shm file per rank and never removes it, so every run leaks RAM until
    /dev/shm fills up. Once every rank has mapped its peers' buffers (after the barrier) the names
    are no longer needed: unlink ours, the mappings stay valid and the memory is freed when the
    job ends."""
    import torch.distributed as dist

    dist.barrier()
    try:
        os.unlink(ds_shm_buffer(os.environ.get("MASTER_ADDR", ""),
                                os.environ.get("MASTER_PORT", ""), rank))
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
                    device_type: str, universal: bool = False, *,
                    model_dim: int) -> Dict[str, Any]:
    """Translate our sub-configs into DeepSpeed's JSON config. ``universal``: the checkpoint to
    load is in DeepSpeed's universal format (resuming on another world size). ``model_dim``
    sizes the buckets our config leaves unset (:meth:`DeepSpeedConfig.zero_sizes`)."""
    precision = resolve_precision(ds, device_type)
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
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return cfg


def build_model(model_args, ds_config: Dict[str, Any], device: torch.device,
                seed: int) -> torch.nn.Module:
    """The model, allocated and initialised once, ready for :func:`initialize`.

    ZeRO-3: constructed on the meta device inside ``deepspeed.zero.Init``, which partitions each
    module as ``to_empty`` materialises it, so no rank ever holds more than one module's
    parameters whole; then each parameter is gathered alone, initialised on rank 0 by
    ``Transformer.init_param`` and scattered back. Other stages: materialised on ``device`` and
    initialised there. Either way the weights depend on ``seed`` only (not on the stage, world
    size or dtype), so every configuration starts from the same model."""
    from llama_train.model import Transformer

    if ds_config["zero_optimization"]["stage"] != 3:
        return Transformer(model_args, device=device, seed=seed)
    import deepspeed
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist

    # zero.Init replaces torch.Tensor.__new__ while it is open, and torch._dynamo, when first
    # imported (a meta-device op can trigger it), refuses a Tensor.__new__ with another signature
    # (seen with offload, where nothing else had imported it yet): import it before.
    # The dtype comes from ds_config (bf16/fp16/fp32). Not passed explicitly: DeepSpeed 0.19.8's
    # Init turns an explicit dtype into bf16 on a CPU accelerator (an operator-precedence slip in
    # Init._set_dtype), which rounded fp32 weights to bf16.
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Transformer(model_args, device="meta")
        model.to_empty(device=device)  # partitions module by module (DeepSpeed's skip_init path)
    model.tie_weights()
    first = dist.get_rank() == 0
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if first:
                model.init_param(name, p, seed)
    model.reset_rope()
    return model


def load_full_state(model: torch.nn.Module, state: Dict[str, torch.Tensor],
                    zero_stage: int) -> None:
    """``model.load_state_dict(state, strict=True)``, also for a ZeRO-3-partitioned model: each
    parameter is gathered alone, rank 0 copies its value in and DeepSpeed scatters it back."""
    if zero_stage != 3:
        model.load_state_dict(state, strict=True)
        return
    import deepspeed
    import torch.distributed as dist

    names = dict(model.named_parameters())
    missing = sorted(set(names) - set(state))
    unexpected = sorted(set(state) - set(names) - _tied_aliases(model))
    if missing or unexpected:
        raise RuntimeError(f"state dict does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    first = dist.get_rank() == 0
    with torch.no_grad():
        for name, p in names.items():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if first:
                    if tuple(state[name].shape) != tuple(p.shape):
                        raise RuntimeError(f"{name}: shape {tuple(state[name].shape)} in the "
                                           f"state dict, {tuple(p.shape)} in the model")
                    p.copy_(state[name])


def _tied_aliases(model: torch.nn.Module) -> set:
    """Names a state dict may carry for a tied parameter that ``named_parameters`` lists once."""
    return {n for n, _ in model.named_parameters(remove_duplicate=False)}


def initialize(model: torch.nn.Module, param_groups, ds_config: Dict[str, Any]) -> "Engine":
    """The one call to ``deepspeed.initialize``."""
    import deepspeed

    ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups,
                                       config=ds_config)
    if ds.dp_world_size == 1 and ds_config["zero_optimization"]["stage"] == 0:
        # Nothing to reduce: skip DeepSpeed's flatten/all-reduce/copy-back of every gradient
        # (3.5% of a `small` step on one rank, docs/performance.md).
        ds.enable_backward_allreduce = False
    return Engine(ds, ds_config["zero_optimization"]["stage"])


@dataclass
class StepResult:
    """What an optimizer step did: ``applied`` is False when it was skipped (non-finite)."""

    applied: bool
    nonfinite: bool
    _grad_norm: Any = None

    @property
    def grad_norm(self) -> Optional[float]:
        g = self._grad_norm() if callable(self._grad_norm) else self._grad_norm
        return float(g) if g is not None else None


class Engine:
    """The training loop's view of DeepSpeed: forward/backward, one optimizer step that says
    whether it was applied, the learning rate, the gradient norm, and checkpoint I/O. Nothing
    outside this module reaches into DeepSpeed's engine or optimizer."""

    def __init__(self, ds, zero_stage: int):
        self.ds = ds  # for measurement tools (llama-bench memory); the trainer never uses it
        self.zero_stage = zero_stage

    # -- the step --------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The plain model (no engine or compile prefixes ever reach a checkpoint)."""
        return unwrap(self.ds)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, **kwargs):
        return self.ds(x, y, **kwargs)  # kwargs: the model's, e.g. doc_ids

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    def set_lr(self, lr: float) -> None:
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def micro_step(self) -> None:
        """After a micro-batch that is not the last of the step: DeepSpeed counts it (and, at
        ZeRO>=2, reduces its gradients) without touching the weights."""
        self.ds.step()

    def step(self, nonfinite_loss: bool = False) -> StepResult:
        """The optimizer step. DeepSpeed (ZeRO>=1) skips a step whose gradients are not finite
        and counts it; ZeRO-0 has neither check nor reported norm, so both are done here, and a
        bad step leaves weights and optimizer state alone as DeepSpeed would."""
        watchdog.note(step=self.ds.global_steps + 1, phase="train")
        if self.zero_stage == 0:
            norms = [p.grad.detach().float().norm() for p in self.ds.module.parameters()
                     if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0
            nonfinite = nonfinite_loss or not math.isfinite(norm)
            with _optimizer_step_skipped(self.ds.optimizer, nonfinite):
                self.ds.step()  # still called: it clears the gradients and keeps counters
            return StepResult(not nonfinite, nonfinite, norm)
        skipped_before = self.ds.skipped_steps
        self.ds.step()
        applied = self.ds.skipped_steps == skipped_before
        return StepResult(applied, nonfinite_loss or not applied, self.ds.get_global_grad_norm)

    def destroy(self) -> None:
        self.ds.destroy()

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: str, tag: str) -> None:
        """DeepSpeed's shards of every rank. DeepSpeed's save has barriers between its writes: a
        write that raised on one rank would leave the ranks in different collectives. So the
        first I/O error is held until DeepSpeed returns (nothing is written after it), then
        raised on this rank; the caller makes the ranks agree."""
        held: List[BaseException] = []
        with watchdog.phase("save"), _hold_io_errors(self.ds, held):
            self.ds.save_checkpoint(path, tag=tag, save_latest=False,
                                    client_state=_universal_info())
        if held:
            raise held[0]

    def load(self, path: str, tag: str) -> bool:
        """Weights, optimizer and scheduler state. Every file is unpickled with torch's
        restricted (weights-only) loader: see :func:`restricted_loads`."""
        # ZeRO-3's universal-checkpoint load (DeepSpeed 0.19.8, stage3.py
        # load_hp_checkpoint_state_from_checkpoint_dir_stage3) (a) gives every param group the
        # first group's hyperparameters, so the no-decay group (norms, embedding) would be
        # decayed, and (b) hands every group's Adam state one shared `step` tensor, which the
        # optimizer then advances once per group per step: the bias correction drifts and the
        # losses with it (1e-3 three steps after resharding). The groups' settings come from
        # this run's config (a resume with a changed optimizer config is refused), so they are
        # put back, and each state gets its own step.
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.ds.optimizer.param_groups]
        with watchdog.phase("load"), restricted_loads():
            load_path, _ = self.ds.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        for group, settings in zip(self.ds.optimizer.param_groups, groups):
            group.update(settings)
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        for state in getattr(inner, "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return load_path is not None

    def opt_state_bytes(self) -> int:
        """Bytes of optimizer state (fp32 master copy + moments) held by this rank."""
        opt = self.ds.optimizer
        total, seen = 0, set()
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


@contextlib.contextmanager
def _optimizer_step_skipped(optimizer, skip: bool) -> Iterator[None]:
    """Make the optimizer's ``step`` a no-op for one call (an instance attribute shadows the
    method), as DeepSpeed itself does for an overflow under ZeRO>=1."""
    if not skip:
        yield
        return
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del optimizer.step


@contextlib.contextmanager
def _hold_io_errors(ds, held: List[BaseException]) -> Iterator[None]:
    """Around ``save_checkpoint``: DeepSpeed's file writes (its checkpoint engine's
    ``save``/``makedirs`` and the copy of its recovery scripts) record their exception in
    ``held`` instead of raising, and write nothing after the first one, while DeepSpeed's
    barriers still run on every rank."""
    ce = getattr(ds, "checkpoint_engine", None)
    targets = [(ce, "save"), (ce, "makedirs"), (ds, "_copy_recovery_script")]
    patched = []
    for obj, name in targets:
        fn = getattr(obj, name, None) if obj is not None else None
        if fn is None or name in vars(obj):
            continue

        def guarded(*args, _fn=fn, **kwargs):
            if held:
                return None
            try:
                return _fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - reported after DeepSpeed returns
                held.append(e)
                return None

        setattr(obj, name, guarded)  # an instance attribute shadows the method
        patched.append((obj, name))
    try:
        yield
    finally:
        for obj, name in patched:
            delattr(obj, name)


def _deepspeed_safe_globals() -> List[Any]:
    """The non-tensor classes DeepSpeed pickles into its checkpoint files (ZeRO 0-3, fp32/bf16/
    fp16, with or without offload): plain value holders, safe to rebuild."""
    out: List[Any] = []
    for module, names in (("deepspeed.runtime.zero.config", ["ZeroStageEnum"]),
                          ("deepspeed.utils.tensor_fragment", ["fragment_address"]),
                          ("deepspeed.runtime.fp16.loss_scaler",
                           ["LossScaler", "DynamicLossScaler"])):
        try:
            mod = __import__(module, fromlist=names)
        except ImportError:
            continue
        out += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return out


RESTRICTED_LOAD_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def restricted_loads() -> Iterator[None]:
    """Inside: every ``torch.load`` (DeepSpeed's included, which asks for ``weights_only=False``)
    uses torch's restricted unpickler, through torch's own switch (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``)
    and allow-list (``safe_globals``), extended only by three plain DeepSpeed value classes. A
    file that smuggles in any other object fails to load instead of running code."""
    before = os.environ.get(RESTRICTED_LOAD_ENV)
    os.environ[RESTRICTED_LOAD_ENV] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            yield
    finally:
        if before is None:
            os.environ.pop(RESTRICTED_LOAD_ENV, None)
        else:
            os.environ[RESTRICTED_LOAD_ENV] = before


def convert_to_universal(ds_dir, out_dir):
    """Run DeepSpeed's ds_to_universal on a checkpoint (in a child process, with restricted
    loads; its forked workers inherit them). Returns the CompletedProcess."""
    import subprocess
    import sys

    cmd = [sys.executable, "-c", "from llama_train.engine import _ds_to_universal_main; "
           "_ds_to_universal_main()", "--input_folder", str(ds_dir), "--output_folder",
           str(out_dir), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    return subprocess.run(cmd, capture_output=True, text=True)


def _ds_to_universal_main() -> None:
    from deepspeed.checkpoint import ds_to_universal

    with restricted_loads():
        ds_to_universal.main(ds_to_universal.parse_arguments())


def consolidate_fp32(ckpt, tag: str, zero_stage: int) -> Dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (ZeRO shards merged by zero_to_fp32), without
    a process group. Keys as DeepSpeed saved them (``module.`` prefixes possible)."""
    from pathlib import Path

    with restricted_loads():
        if zero_stage == 0:
            files = sorted((Path(ckpt) / tag).glob("mp_rank_*_model_states.pt"))
            return torch.load(files[0], map_location="cpu")["module"]
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)


def _universal_info() -> Dict[str, Any]:
    """What ds_to_universal needs to re-partition our (tensor-parallel-free) model."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO,
                                                UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {UNIVERSAL_CHECKPOINT_INFO: {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s for MFU: the datasheet dense bf16 figure on known GPUs, else a measured matmul."""
    datasheet = _datasheet_flops(device)
    if datasheet is not None:
        return datasheet
    return measure_matmul_flops(device, torch.float32 if precision == "fp32" else torch.bfloat16)


class PeakFlops:
    """The denominator of MFU for the whole job (per-device peak x world size), decided once at
    start and never changed, so MFU moves only with throughput: `trainer.peak_flops` when given,
    else the datasheet dense bf16 figure of a known GPU, else a matmul timed once at start-up
    (on a machine busy at that moment it reads low; the trainer then says so, once).
    ``source`` says which."""

    def __init__(self, device: torch.device, precision: str, world_size: int,
                 override: Optional[float] = None):
        sheet = _datasheet_flops(device)
        if override is not None:
            per_device, self.source = override, "trainer.peak_flops"
        elif sheet is not None:
            per_device = sheet
            self.source = f"datasheet bf16 dense, {torch.cuda.get_device_name(device)}"
        else:
            per_device = peak_flops(device, precision)
            self.source = f"{precision} matmul measured at start on {device.type}"
        self.value = per_device * world_size

    def mfu(self, achieved: float) -> float:
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
