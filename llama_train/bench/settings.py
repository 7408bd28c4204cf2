"""What ``llama-bench train``'s options mean for both sides: device, precision, and the
llama-train config (Hydra overrides and the ``Config`` they compose to)."""

from __future__ import annotations

import argparse
import os
from typing import List


def resolve_device(args: argparse.Namespace) -> str:
    if args.device != "auto":
        return args.device
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_precision(args: argparse.Namespace, device: str) -> str:
    if args.precision != "auto":
        return args.precision
    if getattr(args, "float8", False):  # FP8 linears take and give bf16 (float8 needs it)
        return "bf16"
    return "bf16" if device == "cuda" else "fp32"


def train_overrides(args: argparse.Namespace, device: str, precision: str) -> List[str]:
    """Hydra overrides of the `ours` run (without trainer.output_dir): every step logged, no
    evaluation or checkpoint before the last step, no sample."""
    return [
        f"model={args.preset}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.micro_batch={args.micro_batch}",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.log_every=1",
        "trainer.eval_every=1000000000",
        "trainer.save_every=1000000000",
        f"trainer.eval_sequences={args.micro_batch}",
        "sample.tokens=0",
        "trainer.resume=never",
        "trainer.on_existing=overwrite",  # a benchmark's run dir is scratch: rerun in place
        f"trainer.device={device}",
        f"trainer.compile={'true' if args.compile else 'false'}",
        f"deepspeed=zero{args.zero_stage}",
        f"deepspeed.precision={precision}",
        "tracking.wandb.mode=disabled",
        "tracking.console=false",
        *(["float8.enabled=true"] if getattr(args, "float8", False) else []),
        *args.override,
    ]


def compose_config(overrides: List[str]):
    """The ``Config`` llama-train builds from these overrides (same Hydra composition).
    Raises SystemExit naming the bad option (--preset or an --override)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from llama_train.config import load_config  # registers the structured schema
    from llama_train.errors import BadInput
    from llama_train.model import list_presets
    from llama_train.paths import CONFIG_DIR

    preset = next(o.split("=", 1)[1] for o in overrides if o.startswith("model="))
    if preset not in list_presets():
        raise SystemExit(f"llama-bench train: --preset {preset!r} is not a model preset: choose one "
                         f"of {', '.join(list_presets())}")
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            dcfg = compose("config", overrides=overrides)
        return load_config(dcfg)
    except (HydraException, BadInput) as e:  # Hydra's composition; load_config: ConfigError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"llama-bench train: the llama-train config does not compose: {first} "
                         f"(check --override values; overrides: {' '.join(overrides)})") from None
