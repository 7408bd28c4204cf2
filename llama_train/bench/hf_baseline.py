"""The `hf` side of ``llama-bench train``: ``transformers.LlamaForCausalLM`` of the same shape
(``llama_train.hf.to_hf_config``) and the same initial weights, SDPA attention, in a plain PyTorch
loop with AdamW (``fused=True`` where torch supports it; the weight-decay groups of
``llama_train.job.optim``), the same gradient clipping and lr schedule, fed by the same
``TrainLoader`` (same batches: the step-1 losses of both sides must agree)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from llama_train.bench.lockstep import Turns

RESULT_FILE = "result.json"  # written beside the spec


def build_hf_model(model_args, seed: int):
    """LlamaForCausalLM (SDPA) with the initial weights llama-train starts from for ``seed``."""
    import torch
    import transformers

    from llama_train.hf import to_hf_config, to_hf_state_dict
    from llama_train.model import Transformer

    ours = Transformer(model_args, seed=seed)  # as llama-train builds it (engine.build_model)
    cfg = transformers.LlamaConfig(**to_hf_config(model_args))
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                                       dtype=torch.float32)
    model.load_state_dict(to_hf_state_dict(ours.state_dict(), model_args),
                          strict=not model_args.tie_embeddings)
    return model


class _OurNames:
    """An HF Llama seen through our parameter names (``llama_train.hf``'s conversion map), so
    ``llama_train.job.optim.param_groups`` applies its weight-decay rule to it unchanged."""

    def __init__(self, model, model_args) -> None:
        from llama_train.hf import _name_map

        self.model = model
        self.names = {theirs: ours for ours, theirs in _name_map(model_args).items()}

    def named_parameters(self) -> Iterator[Tuple[str, object]]:
        for name, p in self.model.named_parameters():
            if name not in self.names:
                raise ValueError(f"HF parameter {name!r} has no llama_train name "
                                 "(llama_train.hf's name map): its weight decay is unknown")
            yield self.names[name], p


def make_adamw(model, model_args, optim_cfg):
    """(AdamW over ``model``'s parameters, a description): fused where this torch supports it
    for the parameters' device, else foreach. Weight decay as llama-train decides it
    (``llama_train.job.optim.decays`` on our names)."""
    import torch

    from llama_train.job.optim import param_groups

    o = optim_cfg
    groups = param_groups(_OurNames(model, model_args), o)
    betas = (o.beta1, o.beta2)
    try:
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=betas, eps=o.eps, fused=True)
        return opt, "AdamW(fused=True)"
    except (RuntimeError, ValueError) as e:  # fused not built for this device
        return (torch.optim.AdamW(groups, lr=o.lr, betas=betas, eps=o.eps, foreach=True),
                f"AdamW(foreach=True) [fused unavailable: {str(e)[:80]}]")


def _setup(spec: dict):
    """(model, optimizer, its description, loader, device) as the spec describes them."""
    import torch

    from llama_train.config import OptimConfig
    from llama_train.data import TrainLoader
    from llama_train.model import ModelArgs

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    margs = ModelArgs(**spec["model_args"])
    model = build_hf_model(margs, spec["seed"]).to(device).train()
    if spec["compile"]:
        for layer in model.model.layers:
            layer.compile()
    opt, opt_kind = make_adamw(model, margs, OptimConfig(**spec["optim"]))
    loader = TrainLoader(spec["prepared_dir"], seq_len=spec["seq_len"],
                         global_batch=spec["micro_batch"], micro_batch=spec["micro_batch"],
                         seed=spec["data_seed"], num_workers=spec["num_workers"],
                         pin_memory=device.type == "cuda")
    return model, opt, opt_kind, loader, device


def _train(spec: dict, model, opt, loader, device) -> Dict[str, List[float]]:
    """The plain loop, one lock-step turn per step; per-step times, data waits and losses."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from llama_train.job.optim import lr_at

    o = spec["optim"]
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if spec["precision"] == "bf16" else contextlib.nullcontext())
    total = spec["warmup"] + spec["steps"]
    step_times, waits, losses = [], [], []
    it = iter(loader)
    turns = Turns()
    for step in range(1, total + 1):
        turns.begin()
        t0 = time.perf_counter()
        lr = lr_at(step, lr=o["lr"], warmup_steps=o["warmup_steps"], max_steps=total,
                   min_lr_ratio=o["min_lr_ratio"])
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(it)
        waits.append(time.perf_counter() - t0)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if o["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, o["grad_clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a host sync per step, as in llama-train's loop
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        turns.end()
    return {"step_times": step_times, "data_wait": waits, "losses": losses}


def run_hf(spec_path: str) -> None:
    """The `hf` worker: train as ``spec_path`` (JSON) says, write result.json beside it."""
    from llama_train.engine import memory_stats

    spec = json.loads(Path(spec_path).read_text())
    model, opt, opt_kind, loader, device = _setup(spec)
    result = _train(spec, model, opt, loader, device)
    loader.close()
    result.update(mem_gb=memory_stats(device)["mem_gb"], optimizer=opt_kind)  # as ours logs it
    (Path(spec_path).parent / RESULT_FILE).write_text(json.dumps(result))
