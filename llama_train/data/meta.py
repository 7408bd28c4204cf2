"""meta.json of a prepared directory: the settings that identify it (token dtype, tokenizer),
reading it safely, checking it against a model, and PreparedData, what preparing returns.
Shared by prepare.py (one source) and mixture.py (several), which never import each other."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from .errors import DataError
from .tokenizer import HUGGINGFACE, MAX_LINE_BYTES, Tokenizer, fits, size_error

if TYPE_CHECKING:
    from .config import DataConfig

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.model"  # a Hugging Face tokenizer's copy: tokenizer.json (its "file")
FORMAT = "llama_train.packed_tokens"
VERSION = 1
_REQUIRED = ("format", "version", "dtype", "vocab_size", "tokenizer", "splits", "fingerprint")
UINT16_MAX_VOCAB = 65535
# Bump when the tokenizer training recipe changes: part of the fingerprint of trained tokenizers.
TOKENIZER_RECIPE = 1
# The most pieces a tokenizer trained on a built-in corpus can have: SentencePiece's own limit
# (its distinct pieces) was 60,383 on the Python 3.11 docs and 193,504 on the stdlib, at the
# default data.tokenizer_max_sentences; rounded up, for other Python versions' text. Above it,
# training fails inside SentencePiece after the corpus is read: refused at once instead.
BUILTIN_MAX_VOCAB = {"builtin": 65536, "stdlib": 262144}


@dataclass
class PreparedData:
    """Result of prepare_data: where the shards are and what meta.json says."""

    dir: str
    tokenizer_path: str
    meta: dict
    created: bool = False
    """True if this call wrote the directory, False if it found it already prepared."""


def resolve_dtype(dtype: str, vocab_size: int) -> str:
    """data.dtype with ``auto`` resolved: uint16 while the ids fit, else uint32."""
    if dtype == "auto":
        return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"
    if dtype == "uint16" and vocab_size > UINT16_MAX_VOCAB:
        raise DataError(
            f"data.dtype=uint16 cannot hold token ids of vocab_size={vocab_size} (max "
            f"{UINT16_MAX_VOCAB}): set data.dtype=uint32 or auto"
        )
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"data.dtype={dtype!r} is not one of auto, uint16, uint32")
    return dtype


def tokenizer_settings(cfg: DataConfig, vocab_size: Optional[int]) -> tuple:
    """(vocab_size, what identifies the tokenizer): data.tokenizer's sha256 and size (which must
    fit the model's: tokenizer.fits), or the recipe of the one to train, of the model's
    vocab_size (refused at once where the source is a built-in corpus too small for it). Part
    of the fingerprint of prepared data and of mixtures. The vocab_size returned is the
    tokenizer's: the ids' bound, what meta.json records."""
    if cfg.tokenizer is not None:
        tok = Tokenizer(cfg.tokenizer)
        if vocab_size is not None and size_error(tok, vocab_size):
            raise DataError(size_error(tok, vocab_size))
        vocab_size = tok.vocab_size
        tok_settings: dict = {"sha256": tok.sha256, "vocab_size": vocab_size}
        if tok.kind == HUGGINGFACE:  # a SentencePiece tokenizer's settings keep their old hash
            tok_settings.update(kind=tok.kind, bos_id=tok.bos_id, eos_id=tok.eos_id)
    else:
        if vocab_size is None:
            raise DataError(
                "no data.tokenizer given and no vocab_size to train one with: pass the model's "
                "vocab_size (llama-data prepare --vocab-size N) or set data.tokenizer"
            )
        _check_trainable(cfg, int(vocab_size))
        tok_settings = {
            "train_vocab_size": int(vocab_size),
            "max_sentences": cfg.tokenizer_max_sentences,
            "recipe": TOKENIZER_RECIPE,
        }
        if cfg.tokenizer_max_line_bytes != MAX_LINE_BYTES:  # the default keeps the names of before
            tok_settings["max_line_bytes"] = cfg.tokenizer_max_line_bytes
    return int(vocab_size), tok_settings


def _check_trainable(cfg: DataConfig, vocab_size: int) -> None:
    """A tokenizer of ``vocab_size`` pieces cannot be trained on a built-in corpus above
    :data:`BUILTIN_MAX_VOCAB`: a Llama 3 preset (128,256) without data.tokenizer failed inside
    SentencePiece ("<= 60383"), a minute in. Other sources are only known once read."""
    sources = [e.source for e in cfg.mixture] if cfg.mixture else [cfg.source]
    if not all(s in BUILTIN_MAX_VOCAB for s in sources):
        return
    limit = max(BUILTIN_MAX_VOCAB[s] for s in sources)
    if vocab_size <= limit:
        return
    where = (f"data.source={cfg.source}" if not cfg.mixture else
             f"data.mixture (sources {', '.join(sorted(set(sources)))})")
    raise DataError(
        f"no data.tokenizer is given, and a tokenizer of model.vocab_size={vocab_size} pieces "
        f"cannot be trained on {where}: the built-in corpus has too few distinct pieces "
        f"(SentencePiece's limit on it is below {limit:,}). Set data.tokenizer to the model's "
        f"own tokenizer: a Hugging Face "
        f"tokenizer.json, or the directory holding it (for Llama 3: a download of "
        f"meta-llama/Meta-Llama-3-8B or a llama-export directory), or a SentencePiece .model of "
        f"{vocab_size} pieces; or train on a larger data.source; or use a smaller "
        f"model.vocab_size")


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
    if not fits(m["tokenizer"].get("kind"), data_vocab, int(vocab_size)):
        raise DataError(
            f"data.meta vocab_size={data_vocab} but model.vocab_size={vocab_size}: use the "
            f"tokenizer trained for this model (data.tokenizer) or set model.vocab_size={data_vocab}"
        )
    data_sha = m["tokenizer"].get("sha256")
    if tokenizer_sha256 is not None and data_sha != tokenizer_sha256:
        raise DataError(
            f"the prepared data was tokenized with tokenizer sha256={data_sha[:16]}... but the "
            f"model/checkpoint expects sha256={tokenizer_sha256[:16]}...: prepare the data with "
            "the checkpoint's tokenizer (data.tokenizer=<its tokenizer.model or .json>)"
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
