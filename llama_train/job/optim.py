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


def decays(name: str, p: torch.Tensor, cfg: OptimConfig) -> bool:
    """Whether parameter ``name`` (our module names) gets weight decay: matrices only; norms,
    biases and embeddings are exempt unless ``cfg`` asks for them.

    Decisions use module names (the model's stable API), not tensor shapes, so a tied output
    matrix is treated as the embedding it is."""
    is_embedding = name.startswith("tok_embeddings.")
    # ZeRO-3 leaves a partitioned parameter's own shape empty; ds_shape is the full one
    ndim = len(getattr(p, "ds_shape", p.shape))
    is_norm_or_bias = ndim < 2 or name.endswith(".bias") or "norm" in name.rsplit(".", 1)[0]
    exempt = (is_embedding and not cfg.decay_embeddings) or (
        is_norm_or_bias and not cfg.decay_norms_and_biases
    )
    return not exempt


def param_groups(model: torch.nn.Module, cfg: OptimConfig) -> List[Dict]:
    """AdamW groups: decayed parameters (see :func:`decays`) and the rest with weight_decay 0."""
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if decays(name, p, cfg) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
