"""FP8 linear layers: torchao's float8 training applied to a built model (``float8.enabled``).

A converter of the built model, in ``engine/`` beside ``build.py`` that applies it (the model
package stays free of the config this reads): plain torch + torchao, no DeepSpeed, so it is
tested without an engine; ``engine.build.build_model`` calls :func:`convert` after the model is
built and initialised and before ``deepspeed.initialize``. ``convert_to_float8_training`` swaps
each chosen ``nn.Linear`` for a ``Float8Linear`` that holds the *same* ``weight`` Parameter
(``Float8Linear.from_float``: ``new.weight = old.weight``), so parameter names, dtypes and ZeRO-3's
partitioning attributes are those of the plain model: checkpoints, export, import, resume and
resharding do not know FP8 was on. ZeRO-3 registers its gather/release hooks on the module tree
in ``deepspeed.initialize``, after the swap, so the new modules get them.

Each forward casts the input and the weight to float8 (e4m3) with dynamic scales (``recipe``:
one scale per tensor, or per row), multiplies with ``torch._scaled_mm`` (an FP8 tensor core
matmul, compute capability >= 8.9) and gives bf16; the backward does the same for the gradients
(``rowwise_with_gw_hp``: the weight gradient in bf16). ``emulate``: the casts are real, the
matmul is done in high precision, so CPU tests see the FP8 rounding without FP8 hardware.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List

import torch

from llama_train.config import ConfigError, Float8Config

log = logging.getLogger("llama_train")

# torch._scaled_mm needs both dimensions of each operand divisible by 16
ALIGN = 16
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later: FP8 tensor cores


def check_device(cfg: Float8Config, device: torch.device | str) -> None:
    """Refuse FP8 where it cannot run (before any process group): torchao missing, or a GPU
    below compute capability 8.9 without ``float8.emulate``. The device-type and precision checks
    that need no torch are ``config.validate``'s."""
    if not cfg.enabled:
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"float8.enabled=true needs torchao (pip install 'torchao>=0.12'): "
                          f"{e}; or set float8.enabled=false.") from None
    device = torch.device(device)
    if device.type == "cuda" and not cfg.emulate:
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            raise ConfigError(
                f"float8.enabled=true on {torch.cuda.get_device_name(device)} (compute "
                f"capability {cap[0]}.{cap[1]}): FP8 matmuls need 8.9 or later (Ada, Hopper); "
                f"set float8.emulate=true (numerics only, no speed-up) or float8.enabled=false.")


def linear_config(cfg: Float8Config):
    """torchao's ``Float8LinearConfig`` for ``cfg.recipe``, emulated if ``cfg.emulate``."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe),
                               emulate=bool(cfg.emulate))


def skipped(cfg: Float8Config, name: str, module: torch.nn.Module) -> bool:
    """Whether the linear ``name`` stays in bf16: only a plain ``nn.Linear`` converts (the output
    head's loss path calls its weight directly, never its forward), not one named in
    ``cfg.skip`` (the name itself or its last components), not one whose dims are not multiples
    of 16."""
    if type(module) is not torch.nn.Linear:
        return True
    if any(name == s or name.endswith("." + s.strip(".")) for s in cfg.skip):
        return True
    return module.in_features % ALIGN != 0 or module.out_features % ALIGN != 0


def convert(model: torch.nn.Module, cfg: Float8Config) -> List[str]:
    """Swap the linears of ``model`` not :func:`skipped` for torchao's ``Float8Linear``, in
    place (the same parameters). Returns the converted modules' names (none if disabled)."""
    if not cfg.enabled:
        return []
    from torchao.float8 import convert_to_float8_training

    converted: List[str] = []

    def take(module: torch.nn.Module, name: str) -> bool:
        if skipped(cfg, name, module):
            return False
        converted.append(name)
        return True

    convert_to_float8_training(model, config=linear_config(cfg), module_filter_fn=take)
    kept = [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n not in converted]
    log.info("float8: %d linear layers in FP8 (%s%s), %d kept in bf16 (%s)", len(converted),
             cfg.recipe, ", emulated" if cfg.emulate else "", len(kept), _short(kept))
    return converted


def _short(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


__all__ = ["ALIGN", "MIN_CAPABILITY", "check_device", "convert", "linear_config", "skipped"]
