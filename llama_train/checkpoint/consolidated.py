"""A checkpoint's full fp32 weights, merged from its ZeRO shards for export and sampling (no
process group needed), checked against its model_args.json before they are used."""

from __future__ import annotations

import json

from llama_train.checkpoint.discovery import read_state, resolve_checkpoint
from llama_train.checkpoint.errors import CheckpointError
from llama_train.checkpoint.layout import DS_TAG, verify
from llama_train.engine.ds_checkpoint import consolidate_fp32, failed_file, load_error_cause


def load_consolidated(ckpt_dir: str):
    """(ModelArgs, full fp32 state dict, tokenizer path or None) from a checkpoint directory.

    Accepts a ``step_N`` directory or an output/checkpoints directory (then the latest complete
    one is used: :func:`resolve_checkpoint`). ZeRO shards are merged with DeepSpeed's zero_to_fp32.
    Raises :class:`NotACheckpoint` for a path that holds no checkpoint at all (exit 2 in the
    CLIs) and CheckpointError, naming the file, for one that cannot be loaded (exit 3).
    """
    from llama_train.model import ModelArgs

    path = resolve_checkpoint(ckpt_dir)
    reason = verify(path, checksums=True)
    if reason is not None:
        raise CheckpointError(f"checkpoint {path} does not verify: {reason}")
    state = read_state(path)
    try:
        args = ModelArgs(**json.loads((path / "model_args.json").read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path / 'model_args.json'} cannot be read: {load_error_cause(e)}"
                              ) from None
    try:
        sd = consolidate_fp32(path, DS_TAG, state.get("zero_stage", 0))
    except Exception as e:  # noqa: BLE001 - whatever DeepSpeed trips on, the file is the cause
        raise CheckpointError(f"checkpoint {path} cannot be loaded: "
                              f"{failed_file(e) or path / DS_TAG}: {load_error_cause(e)}") from None
    sd = {k.removeprefix("module.").replace("_orig_mod.", ""): v for k, v in sd.items()}
    from llama_train.model.weights import WeightsError, check_state_dict

    try:  # before the cast to float: an integer tensor would pass as weights
        check_state_dict(sd, args, str(path / DS_TAG), config=str(path / "model_args.json"))
    except WeightsError as e:
        raise CheckpointError(f"checkpoint {path} cannot be used: {e}") from None
    sd = {k: v.float() for k, v in sd.items()}
    tok = path / "tokenizer.model"
    return args, sd, (str(tok) if tok.exists() else None)
