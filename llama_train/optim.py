"""AdamW parameter groups and the warmup-cosine learning-rate schedule."""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from llama_train.config import OptimConfig


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer update number ``step`` (1-based; step 0 is the start).

    Linear warmup from 0 at step 0 to ``lr`` at ``warmup_steps``, then a cosine decay to
    ``lr * min_lr_ratio`` at ``max_steps``, constant after that.
    """
    min_lr = lr * min_lr_ratio
    if warmup_steps > 0 and step < warmup_steps:
        return lr * step / warmup_steps
    if step >= max_steps:
        return min_lr
    decay_steps = max_steps - warmup_steps
    if decay_steps <= 0:
        return lr
    progress = (step - warmup_steps) / decay_steps  # in [0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    """A LambdaLR whose k-th value (after k optimizer steps) is the lr of update k + 1.

    DeepSpeed steps the scheduler after each optimizer step and saves its state in the
    checkpoint; the lambda itself is a pure function of the step, so nothing else is needed.
    """

    def factor(k: int) -> float:
        return lr_at(k + 1, lr=1.0, warmup_steps=cfg.warmup_steps, max_steps=max_steps,
                     min_lr_ratio=cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def param_groups(model: torch.nn.Module, cfg: OptimConfig) -> List[Dict]:
    """Weight decay on matrices only; norms, biases and embeddings are exempt unless asked.

    Decisions use module names (the model's stable API), not tensor shapes, so a tied output
    matrix is treated as the embedding it is.
    """
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_embedding = name.startswith("tok_embeddings.")
        is_norm_or_bias = p.ndim < 2 or name.endswith(".bias") or "norm" in name.rsplit(".", 1)[0]
        exempt = (is_embedding and not cfg.decay_embeddings) or (
            is_norm_or_bias and not cfg.decay_norms_and_biases
        )
        (no_decay if exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
