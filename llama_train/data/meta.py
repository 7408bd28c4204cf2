"""meta.json of a prepared directory: reading it safely and checking it against a model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

from .errors import DataError

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.model"
FORMAT = "llama_train.packed_tokens"
VERSION = 1
_REQUIRED = ("format", "version", "dtype", "vocab_size", "tokenizer", "splits", "fingerprint")


def read_meta(prepared_dir: Union[str, os.PathLike]) -> dict:
    """Load and structurally validate `<prepared_dir>/meta.json`; DataError on anything wrong."""
    d = Path(prepared_dir)
    path = d / META_FILE
    if not path.is_file():
        if not d.exists():
            raise DataError(
                f"prepared data directory {str(d)!r} does not exist: run `llama-data prepare` "
                "(or prepare_data) first, or fix data.prepared_dir"
            )
        raise DataError(
            f"{str(d)!r} is not a prepared data directory (no {META_FILE}): run `llama-data "
            "prepare` into an empty or new directory"
        )
    fix = f"delete {str(d)!r} and prepare again"
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is corrupt ({e}): {fix}") from e
    if not isinstance(meta, dict):
        raise DataError(f"{path} is corrupt (not a JSON object): {fix}")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise DataError(f"{path} is corrupt or not from llama_train (missing keys {missing}): {fix}")
    if meta["format"] != FORMAT:
        raise DataError(f"{path} has format {meta['format']!r}, expected {FORMAT!r}: {fix}")
    if meta["version"] != VERSION:
        raise DataError(
            f"{path} has format version {meta['version']}, this code reads version {VERSION}: {fix}"
        )
    if not isinstance(meta["splits"], dict) or not all(
        isinstance(s, dict) and {"tokens", "documents", "shards"} <= set(s) for s in meta["splits"].values()
    ):
        raise DataError(f"{path} is corrupt (bad 'splits' entry): {fix}")
    return meta


def _as_meta(meta: Any) -> dict:
    if isinstance(meta, dict):
        return meta
    if hasattr(meta, "meta") and isinstance(meta.meta, dict):  # PreparedData
        return meta.meta
    return read_meta(meta)


def check_compatible(
    meta: Any, vocab_size: int, seq_len: int, tokenizer_sha256: Optional[str] = None
) -> None:
    """Raise DataError unless the prepared data can feed a model with this vocab and seq_len.

    `meta`: a meta dict, a PreparedData or a prepared directory path. `tokenizer_sha256`: the
    hash recorded with the model/checkpoint, if any.
    """
    m = _as_meta(meta)
    data_vocab = int(m["vocab_size"])
    if data_vocab != int(vocab_size):
        raise DataError(
            f"data.meta vocab_size={data_vocab} but model.vocab_size={vocab_size}: use the "
            f"tokenizer trained for this model (data.tokenizer) or set model.vocab_size={data_vocab}"
        )
    data_sha = m["tokenizer"].get("sha256")
    if tokenizer_sha256 is not None and data_sha != tokenizer_sha256:
        raise DataError(
            f"the prepared data was tokenized with tokenizer sha256={data_sha[:16]}... but the "
            f"model/checkpoint expects sha256={tokenizer_sha256[:16]}...: prepare the data with "
            "the checkpoint's tokenizer (data.tokenizer=<its tokenizer.model>)"
        )
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    for split, info in m["splits"].items():
        if split != "train" and info["tokens"] == 0:
            continue  # no validation split (val_fraction=0): nothing to check
        if info["tokens"] < seq_len + 1:
            raise DataError(
                f"the {split!r} split has {info['tokens']} tokens, fewer than seq_len+1="
                f"{seq_len + 1} needed for one training window: lower seq_len, use more data"
                + (" or raise data.val_fraction" if split != "train" else "")
            )
