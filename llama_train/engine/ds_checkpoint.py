"""DeepSpeed's checkpoint files outside the engine's own save/load: restricted (weights-only)
unpickling of every file DeepSpeed reads, conversion to the universal format (resharding), ZeRO
shards merged into one fp32 state dict, and what a save records for that conversion."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, List

import torch


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

    cmd = [sys.executable, "-c", "from llama_train.engine.ds_checkpoint import "
           "_ds_to_universal_main; _ds_to_universal_main()", "--input_folder", str(ds_dir),
           "--output_folder", str(out_dir), "--num_extract_workers", "1",
           "--num_merge_workers", "1"]
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


def universal_info() -> Dict[str, Any]:
    """What ds_to_universal needs to re-partition our (tensor-parallel-free) model."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO,
                                                UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {UNIVERSAL_CHECKPOINT_INFO: {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
