"""One rank of ``llama-bench memory``: build, train a few steps, record this rank's peak memory.

Run by the deepspeed launcher (``--module llama_train.bench._memory_worker``). The model is built
the way ``llama-train`` builds it: ``engine.build.build_model`` (ZeRO-3: inside
``deepspeed.zero.Init`` from the meta device; ZeRO-0/1/2: meta device, ``to_empty``,
``init_weights``), then ``engine.ds_config.build_ds_config`` + ``engine.build.initialize``. What
is counted inside DeepSpeed's engine comes through :class:`llama_train.engine.Engine`'s methods
for measurement tools (``memory_roots``, ``after_autograd``, ``persistent_params``,
``gathered_numel``); this module never imports DeepSpeed.

Peak memory, per phase (build, initialize, each step), is
:class:`llama_train.metrics.meter.PeakMeter`'s (VmHWM above the idle VmRSS on CPU, the allocator's
peaks on CUDA); the idle baseline is read after the imports, the process group's start and a
warm-up, before anything of the model exists.

After the first step (so AdamW has allocated its state), the forward and backward of the second
are also counted tensor by tensor (each storage once) into params / grads / fp32 master / Adam
moments / buckets / other, by where the storage was found.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

from llama_train.metrics.meter import PeakMeter, rss

CATEGORIES = ("params", "grads", "fp32_master", "adam_moments", "buckets", "other")


def classify(path: str) -> str:
    """Category of a storage from the attribute path it was reached by."""
    p = path.lower()
    if p.startswith("module."):
        return "grads" if p.endswith(".grad") else "params"
    if p.startswith("master["):
        return "grads" if p.endswith(".grad") else "fp32_master"
    if ".state[" in p or ".state." in p or "exp_avg" in p:
        return "adam_moments"
    if "ipg" in p or "bucket" in p:
        return "buckets"
    if p.endswith(".grad") or "grad" in p:
        return "grads"
    if "fp32" in p or "single_partition" in p or "master" in p:
        return "fp32_master"
    if "bit16" in p or "fp16" in p or "lp_param" in p or "param" in p:
        return "params"
    return "other"


class StorageCounter:
    """Walks objects, recording each distinct tensor storage once (first path wins)."""

    def __init__(self) -> None:
        self.seen_storages: set = set()
        self.seen_objects: set = set()
        self.found: List[Tuple[str, int]] = []

    def tensor(self, t, path: str) -> None:
        import torch

        if not torch.is_tensor(t) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if st.nbytes() > 0 and key not in self.seen_storages:
            self.seen_storages.add(key)
            self.found.append((path, st.nbytes()))
        if t.grad is not None:
            self.tensor(t.grad, path + ".grad")
        ds_tensor = getattr(t, "ds_tensor", None)  # ZeRO-3: this rank's partition
        if ds_tensor is not None:
            self.tensor(ds_tensor, path + ".ds_tensor")

    def walk(self, obj: Any, path: str, depth: int = 0, skip_params: bool = False) -> None:
        import torch

        if depth > 8 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        if skip_params and isinstance(obj, torch.nn.Parameter):
            return
        if torch.is_tensor(obj):
            self.tensor(obj, path)
            return
        if id(obj) in self.seen_objects or isinstance(obj, torch.nn.Module):
            return  # modules: parameters are counted from the model itself
        self.seen_objects.add(id(obj))
        if isinstance(obj, dict):
            for i, (k, v) in enumerate(obj.items()):
                key = k if isinstance(k, (str, int)) else i  # optimizer state is keyed by tensors
                self.walk(v, f"{path}[{key}]", depth + 1, skip_params)
        elif isinstance(obj, (list, tuple, set)):
            for i, v in enumerate(obj):
                self.walk(v, f"{path}[{i}]", depth + 1, skip_params)
        elif type(obj).__module__.split(".")[0] in ("deepspeed", "torch") and hasattr(obj, "__dict__"):
            if isinstance(obj, torch.distributed.ProcessGroup):
                return
            for k, v in vars(obj).items():
                self.walk(v, f"{path}.{k}", depth + 1, skip_params)

    def totals(self) -> Dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for path, n in self.found:
            out[classify(path)] += n
        return out


def count_engine_bytes(engine) -> Dict[str, Any]:
    """Per-category bytes this rank holds for the model and the optimizer, plus the largest
    storages (path, bytes) so the categories can be checked by eye. ``engine``: our
    :class:`~llama_train.engine.Engine`."""
    roots = engine.memory_roots()
    module, optimizer = roots["module"], roots["optimizer"]
    c = StorageCounter()
    # Bucket buffers first: gradients copied into a bucket are views of it, and the bytes are
    # the bucket's (its size is reduce_bucket_size, whatever the model's size).
    for k, v in vars(optimizer).items():
        if "ipg" in k.lower() or "bucket" in k.lower():
            c.walk(v, f"optimizer.{k}", skip_params=True)  # buckets list the params they serve
    for name, p in module.named_parameters():
        c.tensor(p, f"module.{name}")
    # The tensors the inner torch optimizer updates, when they are not the module's own
    # parameters, are DeepSpeed's fp32 master partitions (ZeRO 1-3).
    inner = getattr(optimizer, "optimizer", optimizer)
    for gi, group in enumerate(getattr(inner, "param_groups", [])):
        for pi, p in enumerate(group["params"]):
            c.tensor(p, f"master[{gi}][{pi}]")
    c.walk(optimizer, "optimizer")
    top = sorted(c.found, key=lambda x: -x[1])[:12]
    # ZeRO-3: parameters gathered whole right now (not persistent ones), e.g. still in use
    return {"bytes": c.totals(), "largest": [[p, n] for p, n in top],
            "zero3_gathered_numel": engine.gathered_numel()}


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="llama_train.bench._memory_worker")
    ap.add_argument("--model-json", required=True, help="ModelArgs fields as JSON")
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--offload", action="store_true", help="ZeRO-3 offload_params + offload_optimizer")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--ds-zero", default="{}", help="JSON: keys set in zero_optimization "
                    "after engine.ds_config.build_ds_config (experiments with DeepSpeed's "
                    "knobs)")
    ap.add_argument("--sequence-parallel", type=int, default=1,
                    help="ranks sharing each sequence (parallel.sequence)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return ap.parse_args(argv)


def _count_backward(engine, module, x, y) -> Dict[str, Any]:
    """One forward/backward counted twice: when autograd has finished but DeepSpeed has not yet
    reduced (ZeRO 0/1 hold every full gradient here), and after backward (ZeRO 2/3 hold their
    reduced partitions). Per category, the larger of the two is the peak."""
    snaps: List[Dict[str, Any]] = []
    with engine.after_autograd(lambda: snaps.append(count_engine_bytes(engine))):
        loss = module.micro_loss(x, y)
        engine.backward(loss)
    snaps.append(count_engine_bytes(engine))
    return {"bytes": {c: max(s["bytes"][c] for s in snaps) for c in CATEGORIES},
            "largest": max(snaps, key=lambda s: sum(s["bytes"].values()))["largest"],
            "snapshots": [s["bytes"] for s in snaps],
            "zero3_gathered_numel": max(s["zero3_gathered_numel"] for s in snaps),
            "loss": float(loss.item())}


def _train_steps(eng, engine, module, meter, x, y, steps: int, exchanges: bool):
    """Steps 1..``steps``, each a phase of ``meter``; step 2's backward counted tensor by tensor
    (:func:`_count_backward`); with sequence parallelism (``exchanges``) the all-to-alls of each
    step counted by ``engine.all_to_all_meter``. Returns (step 2's counts, the last step's
    all-to-alls)."""
    counted: Dict[str, Any] = {}
    last: Dict[str, Any] = {}
    for step in range(1, steps + 1):
        meter.start()
        with eng.all_to_all_meter() if exchanges else contextlib.nullcontext({}) as a2a:
            if step == 2:
                counted = _count_backward(engine, module, x, y)
            else:
                engine.backward(module.micro_loss(x, y))
        engine.step()  # AdamW state exists from the first step on
        meter.stop(f"step{step}")
        last = dict(a2a)
    return counted, last


def _exchanges_alone(eng, mpu, margs, args) -> Dict[str, float]:
    """Seconds of each of the planner's exchanges (q, k, v, out of a layer) timed alone, by
    size in bytes."""
    from llama_train.scaling import sequence_parallel_traffic

    traffic = sequence_parallel_traffic(margs, args.micro_batch, args.seq_len,
                                        args.sequence_parallel, args.precision)
    return {str(b): eng.all_to_all_seconds(mpu, b) for b in sorted(set(traffic["call_bytes"]))}


def _layout(args, rt):
    """The trainer's layout and batch for this worker's settings (plan_job's "layout" scope)."""
    from llama_train.config import (Config, DeepSpeedConfig, OptimConfig, ParallelConfig,
                                    TrainerConfig)
    from llama_train.job.plan import plan_job
    from llama_train.model import ModelArgs

    margs = ModelArgs(**json.loads(args.model_json))
    optim = OptimConfig()
    ds_cfg = DeepSpeedConfig(zero_stage=args.stage, precision=args.precision,
                             offload_params=args.offload, offload_optimizer=args.offload)
    # the trainer's layout and batch, from plan_job's "layout" scope: this worker's own config
    # (DeepSpeed's knobs on a model) is no training job for config.validate to judge
    job = plan_job(Config(model=margs, optim=optim, deepspeed=ds_cfg,
                          trainer=TrainerConfig(seq_len=args.seq_len, micro_batch=args.micro_batch),
                          parallel=ParallelConfig(sequence=args.sequence_parallel)),
                   rt, scope="layout")
    return margs, optim, ds_cfg, job.layout, job.batch


def _build_measured(eng, margs, optim, ds_config, rt, mpu, meter):
    """Build the model and initialize DeepSpeed the trainer's way, each a phase of ``meter``."""
    from llama_train.job.optim import param_groups

    meter.start()
    model = eng.build_model(margs, ds_config, rt.device, seed=0, mpu=mpu)  # the trainer's path
    eng.shard_attention(model, mpu)
    meter.stop("build")
    meter.start()
    engine = eng.initialize(model, param_groups(model, optim), ds_config, mpu=mpu)
    del model
    meter.stop("initialize")
    return engine


def _write_result(out_dir: str, rank: int, result: Dict[str, Any]) -> None:
    """Write this rank's ``rank<N>.json`` atomically: the parent reads only whole files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out / f"rank{rank}.json")


def main(argv=None) -> None:
    args = _parse(argv)

    import torch
    import torch.distributed as dist

    from llama_train import engine as eng
    from llama_train.comm import CommConfig
    from llama_train.job.train_module import TrainModule
    from llama_train.model import count_params
    from llama_train.proc import exit_skipping_teardown

    rt = eng.detect_runtime("cpu")
    eng.init_distributed(CommConfig(), rt.device_type)
    margs, optim, ds_cfg, layout, plan = _layout(args, rt)
    sp = layout.sequence_parallel
    mpu = eng.init_sequence_parallel(sp)  # the trainer's groups (None for 1)
    ds_config = eng.build_ds_config(ds_cfg, optim, plan, rt.device_type, model_dim=margs.dim)
    ds_config["zero_optimization"].update(json.loads(args.ds_zero))
    eng.warm_up(args.offload)
    dist.barrier()
    meter = PeakMeter(rt.device)  # idle baseline: imports, process group, warm-up; no model yet

    engine = _build_measured(eng, margs, optim, ds_config, rt, mpu, meter)
    # the trainer's micro-batch: this rank's slice of the sequences and its share of the loss
    module = TrainModule(engine, plan, rt.device, optim, args.steps, vocab_size=margs.vocab_size,
                         eos_id=0, document_mask=False, data_dir="(random tokens)",
                         sequence=(layout.sp_rank, sp))

    g = torch.Generator().manual_seed(layout.dp_rank)  # a sequence group draws the same tokens
    x = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), generator=g)
    y = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), generator=g)
    counted, exchanges = _train_steps(eng, engine, module, meter, x, y, args.steps, sp > 1)
    if sp > 1:
        exchanges["alone"] = _exchanges_alone(eng, mpu, margs, args)
    result = {
        "rank": rt.rank, "world_size": rt.world_size, "stage": args.stage,
        "sequence_parallel": sp, "all_to_all": exchanges,
        "offload": args.offload, "precision": args.precision,
        "n_params": count_params(margs)["total"],
        **meter.report(),
        **counted,
        "opt_state_bytes_engine_helper": engine.opt_state_bytes(),
        "zero3_persistent_params": engine.persistent_params(),
        "ds_config_zero": ds_config["zero_optimization"],
        "optimizer_class": type(engine.memory_roots()["optimizer"]).__name__,
        "rss_end": rss(),
    }
    _write_result(args.out, rt.rank, result)
    dist.barrier()
    dist.destroy_process_group()
    exit_skipping_teardown(0)


if __name__ == "__main__":
    main()
