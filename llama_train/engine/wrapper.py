"""The training loop's view of a DeepSpeed engine (:class:`Engine`) and what one optimizer step
did (:class:`StepResult`)."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from llama_train import watchdog
from llama_train.engine.ds_checkpoint import restricted_loads, universal_info


def _zero3_real(param, part: torch.Tensor) -> torch.Tensor:
    """The elements of this rank's ZeRO-3 partition ``part`` of ``param`` that hold weights.
    DeepSpeed pads each parameter to a multiple of the ranks with uninitialised memory: on the
    last ranks of a large job a small parameter's whole partition is padding (a 128-element
    norm weight has none on ranks 128-511 of 512), and garbage there is not a diverged run."""
    import torch.distributed as dist

    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    return part.narrow(0, 0, max(0, min(part.numel(), param.ds_numel - rank * part.numel())))


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
    outside :mod:`llama_train.engine` reaches into DeepSpeed's engine or optimizer; measurement
    tools get the few views they need from the methods at the end of this class."""

    def __init__(self, ds, zero_stage: int, grad_factor: float = 1.0):
        self.ds = ds  # DeepSpeed's engine: used by this package only
        self.zero_stage = zero_stage
        # what backward multiplies the loss by so the reduced gradient is the one the loss
        # means (engine.sequence.gradient_factor); 1 without sequence parallelism
        self.grad_factor = grad_factor
        # host buffers of asynchronous saves, reused save after save (see save(snapshot=))
        self._staging: Dict[Tuple[str, int], torch.UntypedStorage] = {}

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
        self.ds.backward(loss if self.grad_factor == 1.0 else loss * self.grad_factor)

    def micro_step(self) -> None:
        """After a micro-batch that is not the last of the step: DeepSpeed counts it (and, at
        ZeRO>=2, reduces its gradients) without touching the weights."""
        self.ds.step()

    def step(self, nonfinite_loss: bool = False) -> StepResult:
        """The optimizer step. DeepSpeed (ZeRO>=1) skips a step whose gradients are not finite
        and counts it; ZeRO-0 has neither check nor reported norm, so both are done here, and a
        bad step leaves weights and optimizer state alone as DeepSpeed would. (The watchdog
        learns the step number from the training loop, the one counter of steps.)"""
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
    def save(self, path: str, tag: str,
             snapshot: Optional[List[Tuple[str, Any]]] = None) -> None:
        """DeepSpeed's shards of every rank. DeepSpeed's save has barriers between its writes: a
        write that raised on one rank would leave the ranks in different collectives. So the
        first I/O error is held until DeepSpeed returns (nothing is written after it), then
        raised on this rank; the caller makes the ranks agree.

        ``snapshot``: write no shard; append ``(file, state)`` for each instead, the state
        copied to host memory (:func:`host_copy`), for a background writer to ``torch.save``.
        DeepSpeed still runs its collectives and creates its directories here. The host
        buffers are kept and reused by the next snapshot (a fresh allocation costs a page fault
        per page, more than the copy itself): the caller must not take a snapshot while the
        previous one is still being written."""
        held: List[BaseException] = []

        def take(state_dict, path) -> None:
            staging = _Staging(self._staging, os.path.basename(str(path)))
            snapshot.append((str(path), host_copy(state_dict, staging)))

        with watchdog.phase("save"), \
                _hold_io_errors(self.ds, held, take if snapshot is not None else None):
            self.ds.save_checkpoint(path, tag=tag, save_latest=False,
                                    client_state=universal_info())
        if held:
            raise held[0]

    def weights_finite(self) -> bool:
        """Whether every weight this rank holds is finite: the model's parameters (under ZeRO-3
        this rank's partition, ``ds_tensor``, not the empty placeholders) and the optimizer's
        fp32 master copies (ZeRO's partitions, the 16-bit wrappers' flat groups). A save asks
        before writing: NaN weights must never become a checkpoint that vouches for them. Local
        only; the caller makes the ranks agree."""
        tensors = [_zero3_real(p, p.ds_tensor) if hasattr(p, "ds_tensor") else p.data
                   for p in self.ds.module.parameters()]
        opt = self.ds.optimizer
        for attr in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_groups_flat"):
            tensors += [t for t in getattr(opt, attr, None) or [] if torch.is_tensor(t)]
        # ZeRO-3's fp32 masters: each sub-group's flat buffer is its parameters' partitions end
        # to end, padding included; only the real elements count
        for flat, params in zip(getattr(opt, "fp32_partitioned_groups_flat", None) or [],
                                getattr(opt, "fp16_groups", None) or []):
            sizes = [p.ds_tensor.numel() for p in params]
            if not torch.is_tensor(flat) or flat.numel() != sum(sizes):
                continue  # not held here (NVMe offload keeps an empty placeholder)
            for p, part in zip(params, flat.split(sizes)):
                tensors.append(_zero3_real(p, part))
        # A sum is NaN/inf when any element is (and costs a 30th of isfinite(), which writes a
        # mask); only a non-finite sum, which an overflow could also give, is checked exactly.
        # Summed in the tensor's own dtype (torch accumulates in fp32 inside the kernel):
        # sum(dtype=float32) first made an fp32 copy of each bf16 tensor, 4 bytes x the
        # largest whole parameter under ZeRO-0/1/2 (1.9 GiB at llama3_8b's embedding).
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_device.setdefault(t.device, []).append(t)
        for ts in by_device.values():  # one sync per device
            sums = torch.stack([t.sum().float() for t in ts])
            if not bool(torch.isfinite(sums).all()) and \
                    not all(bool(torch.isfinite(t).all()) for t in ts):
                return False
        return True

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

    # -- for measurement tools (llama-bench memory, tests); the trainer uses none of these --
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

    def memory_roots(self) -> Dict[str, Any]:
        """The objects that hold this rank's model and optimizer tensors, for tools that count
        storages (``llama-bench memory``; read them, never change them): ``module``, the plain
        model (under ZeRO-3 its parameters carry this rank's partition as ``ds_tensor``), and
        ``optimizer``, DeepSpeed's optimizer (ZeRO's or the 16-bit wrapper; the torch optimizer
        it drives is its ``optimizer`` attribute, its gradient buckets and flat buffers are
        attributes too)."""
        return {"module": self.module, "optimizer": self.ds.optimizer}

    @contextlib.contextmanager
    def after_autograd(self, callback: Callable[[], None]) -> Iterator[None]:
        """Inside: each :meth:`backward` calls ``callback()`` once autograd has finished and
        before DeepSpeed reduces the gradients (ZeRO-0/1 hold every full gradient at that
        moment), through DeepSpeed's ``_backward_epilogue``. For measurement tools."""
        ds = self.ds
        epilogue = ds._backward_epilogue
        own = "_backward_epilogue" in vars(ds)

        def counted_epilogue(*a, **kw):
            callback()
            return epilogue(*a, **kw)

        ds._backward_epilogue = counted_epilogue  # an instance attribute shadows the method
        try:
            yield
        finally:
            if own:
                ds._backward_epilogue = epilogue
            else:
                del ds._backward_epilogue

    def persistent_params(self) -> Dict[str, int]:
        """ZeRO-3's persistent parameters (at most ``stage3_param_persistence_threshold``
        elements, kept whole on every rank): their ``count`` and ``numel``. Zero otherwise."""
        kept = [p for p in self.ds.module.parameters() if getattr(p, "ds_persist", False)]
        return {"count": len(kept), "numel": sum(p.ds_numel for p in kept)}

    def gathered_numel(self) -> int:
        """ZeRO-3: elements of the partitioned (not persistent) parameters gathered whole on
        this rank right now, e.g. kept from the forward for the backward. 0 at other stages."""
        return sum(p.data.numel() for p in self.ds.module.parameters()
                   if hasattr(p, "ds_numel") and not getattr(p, "ds_persist", False))


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
def _hold_io_errors(ds, held: List[BaseException],
                    save: Optional[Callable[[Any, str], None]] = None) -> Iterator[None]:
    """Around ``save_checkpoint``: DeepSpeed's file writes (its checkpoint engine's
    ``save``/``makedirs`` and the copy of its recovery scripts) record their exception in
    ``held`` instead of raising, and write nothing after the first one, while DeepSpeed's
    barriers still run on every rank. ``save``: called instead of the engine's ``save``."""
    ce = getattr(ds, "checkpoint_engine", None)
    targets = [(ce, "save"), (ce, "makedirs"), (ds, "_copy_recovery_script")]
    patched = []
    for obj, name in targets:
        fn = getattr(obj, name, None) if obj is not None else None
        if fn is None or name in vars(obj):
            continue
        if name == "save" and save is not None:
            fn = save

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


def unwrap(engine_or_model) -> torch.nn.Module:
    """The plain model (no engine or compile prefixes ever reach a checkpoint)."""
    m = getattr(engine_or_model, "module", engine_or_model)
    return getattr(m, "_orig_mod", m)


class _Staging:
    """Host buffers for one file's snapshot, by order of appearance: the n-th storage of file F
    is copied into the buffer it used last time, if it has the same size."""

    def __init__(self, pool: Dict[Tuple[str, int], torch.UntypedStorage], file: str):
        self.pool, self.file, self.n = pool, file, 0

    def copy(self, src: torch.UntypedStorage) -> torch.UntypedStorage:
        key = (self.file, self.n)
        self.n += 1
        dst = self.pool.get(key)
        if dst is None or dst.nbytes() != src.nbytes():
            pin = src.device.type == "cuda"  # pinned: a fast copy from the GPU
            dst = torch.empty(src.nbytes(), dtype=torch.uint8,
                              pin_memory=pin).untyped_storage()
            self.pool[key] = dst
        dst.copy_(src)
        return dst


def host_copy(obj: Any, staging: Optional[_Staging] = None) -> Any:
    """``obj`` with every tensor copied to host memory, for a background ``torch.save`` while
    training goes on changing the originals. Each storage is copied once, whole, and its views
    keep their offsets and strides; an object met twice is copied once (tensors that shared a
    storage, or a tuple two param groups share, still do): the file written is the file a
    ``torch.save`` of the original would have written, byte for byte. Containers are rebuilt;
    other leaves (ints, strings, configs) are deep-copied."""
    return _host_copy(obj, {}, {}, staging)


def _host_copy(obj: Any, seen: Dict[int, Any], storages: Dict[Any, Any],
               staging: Optional[_Staging]) -> Any:
    import copy

    if id(obj) in seen:
        return seen[id(obj)]
    if torch.is_tensor(obj):
        storage = obj.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key not in storages:  # on the host: clone (.cpu() would return the same storage)
            storages[key] = (staging.copy(storage) if staging is not None else
                             storage.clone() if storage.device.type == "cpu" else storage.cpu())
        out = torch.empty(0, dtype=obj.dtype).set_(storages[key], obj.storage_offset(),
                                                   obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        else:
            out.requires_grad_(obj.requires_grad)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # the same mapping type (OrderedDict, ...), its keys in order
        seen[id(obj)] = out
        for k, v in obj.items():
            out[k] = _host_copy(v, seen, storages, staging)
    elif isinstance(obj, list):
        out = []
        seen[id(obj)] = out
        out.extend(_host_copy(v, seen, storages, staging) for v in obj)
    elif isinstance(obj, tuple):
        items = [_host_copy(v, seen, storages, staging) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj, seen)  # its memo is keyed by id as well
    seen[id(obj)] = out
    return out
