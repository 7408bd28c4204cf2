"""DeepSpeed's checkpoint files outside the engine's own save/load: restricted (weights-only)
unpickling of every file DeepSpeed reads, conversion to the universal format (resharding), ZeRO
shards merged into one fp32 state dict, and what a save records for that conversion."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, List, Optional

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
    file that smuggles in any other object fails to load instead of running code. A load that
    fails says which file it was reading (:func:`failed_file`): DeepSpeed's errors do not."""
    before, real_load = os.environ.get(RESTRICTED_LOAD_ENV), torch.load
    os.environ[RESTRICTED_LOAD_ENV] = "1"
    torch.load = _naming_load(real_load)  # DeepSpeed calls torch.load by attribute
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            yield
    finally:
        torch.load = real_load
        if before is None:
            os.environ.pop(RESTRICTED_LOAD_ENV, None)
        else:
            os.environ[RESTRICTED_LOAD_ENV] = before


_FILE_ATTR = "llama_train_file"


def _naming_load(real_load):
    """``torch.load`` that marks the exception of a failed load with the file it was reading
    (the exception itself is unchanged, for DeepSpeed's own handling)."""
    def load(f, *args, **kwargs):
        try:
            return real_load(f, *args, **kwargs)
        except Exception as e:
            if isinstance(f, (str, os.PathLike)) and not hasattr(e, _FILE_ATTR):
                try:
                    setattr(e, _FILE_ATTR, os.fspath(f))
                except AttributeError:  # an exception type without a __dict__
                    pass
            raise

    return load


def failed_file(e: BaseException) -> Optional[str]:
    """The checkpoint file whose load raised ``e`` (or an exception in its chain), if a load
    inside :func:`restricted_loads` did."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, _FILE_ATTR, None):
            return getattr(e, _FILE_ATTR)
        e = e.__cause__ or e.__context__
    return None


def load_error_cause(e: BaseException) -> str:
    """One line for why a checkpoint file did not load: the restricted unpickler's finding
    (``unsupported GLOBAL posix.system``) without torch's advice to load it unrestricted."""
    text = str(e).strip()
    if "Weights only load failed" in text:
        keep = []
        for line in text.splitlines()[1:]:
            line = line.split("WeightsUnpickler error:", 1)[-1].strip().rstrip(".")
            if line and not line.startswith(("Check the documentation", "Please file an issue")):
                keep.append(line)
        return (f"{type(e).__name__}: refused by the restricted (weights-only) unpickler: "
                f"{'; '.join(keep) or 'a non-tensor object'}")[:400]
    first = next((line.strip() for line in text.splitlines() if line.strip()), "").rstrip(".")
    return f"{type(e).__name__}: {first}"[:400] if first else type(e).__name__


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

    code = _injected_convert_errno()
    if code is not None:
        _fail_first_save(code)
    with restricted_loads():
        ds_to_universal.main(ds_to_universal.parse_arguments())


def _injected_convert_errno() -> Optional[int]:
    """``LLAMA_TRAIN_FAULTS``' ``convert_error:errno=NAME`` item, read in the conversion's child
    from the environment it inherits (llama_train.job.faults parses and checks the whole plan in
    preflight; the engine does not import it)."""
    import errno

    for item in os.environ.get("LLAMA_TRAIN_FAULTS", "").split(";"):
        kind, _, rest = item.strip().partition(":")
        if kind == "convert_error":
            kv = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
            return getattr(errno, kv.get("errno", "ENOSPC"), errno.ENOSPC)
    return None


def _fail_first_save(code: int) -> None:
    """The first ``torch.save`` to a file writes half its bytes and raises ``OSError(code)``,
    like a disk that fills up in the middle of the conversion."""
    import io

    real_save = torch.save

    def save(obj, target, *args, **kwargs):
        if not isinstance(target, (str, os.PathLike)):
            return real_save(obj, target, *args, **kwargs)
        torch.save = real_save
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        with open(target, "wb") as fh:
            fh.write(buf.getvalue()[: buf.tell() // 2])
        raise OSError(code, os.strerror(code), os.fspath(target))

    torch.save = save


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
