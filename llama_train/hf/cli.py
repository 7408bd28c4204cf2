"""``llama-export`` and ``llama-import``: the command lines of :mod:`llama_train.hf`, with
their exit codes (2: not a checkpoint or model directory; 3: one that cannot be loaded).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from llama_train.errors import BadInput
from llama_train.hf.export import export_hf, trained_with_bos
from llama_train.hf.read import import_hf

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# The CLIs' exit codes (docs/reliability.md): 2 the path is not a checkpoint at all (bad input),
# 3 a checkpoint that cannot be loaded (incomplete, corrupt, foreign or tampered). Nothing in a
# checkpoint is unpickled unrestricted, so a refused file never runs code.
EXIT_NOT_A_CHECKPOINT, EXIT_UNLOADABLE = 2, 3


def _cli_fail(prog: str, code: int, e: Any) -> None:
    """One line, ``<prog>: error: ...``, and the exit code: no traceback for a bad checkpoint."""
    msg = " ".join(str(e).split())
    print(f"{prog}: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def export_main(argv: Optional[list[str]] = None) -> None:
    """``llama-export <checkpoint_dir> <out_dir> [--dtype fp32|bf16|fp16]``. Exit 2: the path
    is not a checkpoint; 3: the checkpoint cannot be loaded or does not fit its model args."""
    p = argparse.ArgumentParser(prog="llama-export", description="Export a llama_train checkpoint to Hugging Face format.")
    p.add_argument("checkpoint_dir", help="a llama_train checkpoint directory")
    p.add_argument("out_dir", help="where to write the Hugging Face model")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="weight dtype (default fp32)")
    a = p.parse_args(argv)
    from llama_train.checkpoint import (CheckpointError, NotACheckpoint, checkpoint_step,
                                        load_consolidated, resolve_checkpoint)
    from llama_train.paths import PathRefused, check_output

    try:  # before the checkpoint is read and converted: a read-only out_dir fails at once
        check_output(a.out_dir, "out_dir", directory=True)
    except PathRefused as e:
        _cli_fail(p.prog, EXIT_NOT_A_CHECKPOINT, e)

    try:
        ckpt = resolve_checkpoint(a.checkpoint_dir)
        args, state_dict, tokenizer_model = load_consolidated(str(ckpt))
        add_bos = bool(tokenizer_model) and trained_with_bos(ckpt)
        out = export_hf(args, state_dict, a.out_dir, tokenizer_model=tokenizer_model,
                        dtype=_DTYPES[a.dtype], add_bos=add_bos)
    except NotACheckpoint as e:
        _cli_fail(p.prog, EXIT_NOT_A_CHECKPOINT, e)
    except CheckpointError as e:
        _cli_fail(p.prog, EXIT_UNLOADABLE, e)
    except (BadInput, RuntimeError) as e:  # its weights or tokenizer do not fit its model args
        _cli_fail(p.prog, EXIT_UNLOADABLE, f"{a.checkpoint_dir} cannot be exported: "
                                           f"{type(e).__name__}: {e}")
    step = checkpoint_step(ckpt)
    print(f"exported step {step} ({ckpt}) -> {out} "
          f"({a.dtype}{', with tokenizer' if tokenizer_model else ''})")


def import_main(argv: Optional[list[str]] = None) -> None:
    """``llama-import <hf_dir> <out_file.pt>``: writes ``{"model_args": ..., "model": state_dict}``.
    Exit 2: ``hf_dir`` is not a Hugging Face model directory; 3: its config or weights cannot be
    read or are not a Llama this model implements."""
    p = argparse.ArgumentParser(prog="llama-import", description="Import a Hugging Face Llama model.")
    p.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("out_file", help="output .pt file")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast weights (default: keep)")
    a = p.parse_args(argv)
    d = Path(a.hf_dir)
    if not (d / "config.json").is_file():
        found = "it does not exist" if not d.exists() else (
            "it is not a directory" if not d.is_dir() else "it has no config.json")
        _cli_fail(p.prog, EXIT_NOT_A_CHECKPOINT,
                  f"{d} is not a Hugging Face model directory: {found}. Give the directory "
                  f"save_pretrained wrote (config.json + model*.safetensors).")
    try:
        args, sd = import_hf(d)
    except BadInput as e:  # WeightsError, or ModelArgs' ConfigError: config.json's values
        _cli_fail(p.prog, EXIT_UNLOADABLE, f"{d} cannot be imported: {e}")
    if a.dtype:
        sd = {k: v.to(_DTYPES[a.dtype]) for k, v in sd.items()}
    out = Path(a.out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_args": asdict(args), "model": sd}, out)
    print(f"imported {a.hf_dir} -> {out}")
