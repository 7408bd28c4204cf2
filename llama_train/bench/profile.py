"""``llama-bench train --profile [N]``: torch.profiler over 3 steps (after 3 warm-up steps) of our
engine step and of the HF step on the same random tokens, top N ops by self CPU time."""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

from llama_train.bench.hf_baseline import build_hf_model, make_adamw
from llama_train.bench.settings import (compose_config, resolve_device, resolve_precision,
                                        train_overrides)


def _ours_step(cfg, rt, x, y) -> Callable[[], None]:
    """One optimizer step of the DeepSpeed engine llama-train builds (one rank)."""
    from llama_train import engine as eng
    from llama_train.config import resolve_batch
    from llama_train.job.optim import param_groups

    eng.init_distributed(cfg.comm, rt.device_type)
    ds_config = eng.build_ds_config(cfg.deepspeed, cfg.optim, resolve_batch(cfg.trainer, 1),
                                    rt.device_type, model_dim=cfg.model.dim)
    model = eng.build_model(cfg.model, ds_config, rt.device, cfg.trainer.seed)
    engine = eng.initialize(model, param_groups(model, cfg.optim), ds_config)

    def step() -> None:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss.item()

    return step


def _hf_step(cfg, rt, x, y) -> Callable[[], None]:
    """One step of the `hf` side's plain loop."""
    import torch
    import torch.nn.functional as F

    hf = build_hf_model(cfg.model, cfg.trainer.seed).to(rt.device).train()
    opt, _ = make_adamw(hf, cfg.model, cfg.optim)

    def step() -> None:
        logits = hf(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.optim.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def profile(args: argparse.Namespace, top: int) -> str:
    """The two tables (top ``top`` ops by self CPU time), each headed by its seconds per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    from llama_train import engine as eng

    device_name = resolve_device(args)
    precision = resolve_precision(args, device_name)
    cfg = compose_config(train_overrides(args, device_name, precision) + ["trainer.output_dir=."])
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    rt = eng.detect_runtime(device_name)
    g = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, args.seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(rt.device)
    y = torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(rt.device)
    text = []
    for name, fn in (("ours (DeepSpeed engine step)", _ours_step(cfg, rt, x, y)),
                     ("hf (plain loop)", _hf_step(cfg, rt, x, y))):
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
        wall = (time.perf_counter() - t0) / 3
        text.append(f"== {name}: {wall:.3f} s/step under the profiler, {args.micro_batch}x"
                    f"{args.seq_len}, {args.threads} threads, {precision}\n")
        text.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                              max_name_column_width=48))
    return "\n".join(text)
