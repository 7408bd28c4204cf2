"""Prepare: source text -> tokenizer -> packed token shards + meta.json, exactly once.

Layout of a prepared directory:

    tokenizer.model          the SentencePiece model the tokens were made with (a Hugging Face
                             tokenizer: tokenizer.json, its copy; meta.json names the file)
    train-00000.bin ...      flat token ids (uint16/uint32), documents back to back, EOS after each
    val-00000.bin ...        the held-out documents, same format
    train-00000.crc32 ...    crc32 of every 256 KiB block of the shard beside it (uint32 LE)
    meta.json                what, how, with which tokenizer; per-shard token counts, sha256,
                             and the sha256 of its .crc32 file

Safety: everything is written to a temp directory next to the target and renamed into place
at the end, so a prepared directory either has a complete meta.json or does not exist.
A file lock next to it makes concurrent callers (every rank of a job, several jobs on one
machine) wait for the single process that prepares, then load its result.

The tokens themselves are written by shards.py; a ``data.mixture`` is prepared by mixture.py,
which gets this module's one-source preparation passed in (it never imports this module).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .config import DataConfig
from .errors import DataError
from .meta import (FORMAT, META_FILE, TOKENIZER_FILE, VERSION, PreparedData, read_meta,
                   resolve_dtype, tokenizer_settings)
from .mixture import find_prepared_mixture, prepare_mixture
from .shards import BLOCK_BYTES, ShardWriter, encode_into, num_processes
from .sources import Source, open_source
from .tokenizer import Tokenizer, train_tokenizer
from llama_train.util import fsync_dir

log = logging.getLogger(__name__)
# PreparedData, resolve_dtype, tokenizer_settings (meta.py) and ShardWriter (shards.py) were
# defined here once: still importable from here
__all__ = ["PreparedData", "find_prepared", "prepare_data", "resolve_dtype", "tokenizer_settings",
           "BLOCK_BYTES", "ShardWriter"]


# --- fingerprint / directory ----------------------------------------------------------------
def _settings(cfg: DataConfig, source: Source, tokenizer: dict, dtype: str) -> dict:
    """Everything that changes the token stream; hashed into the directory name."""
    return {
        "format_version": VERSION,
        "source": source.describe(),
        "tokenizer": tokenizer,
        "dtype": dtype,
        "val_fraction": cfg.val_fraction,
        "add_bos": cfg.add_bos,
    }


def _fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _default_dir(source: Source, fingerprint: str) -> Path:
    from llama_train.paths import cache_dir

    return cache_dir() / f"{source.name}-{fingerprint[:10]}"


def _check_shards(d: Path, meta: dict) -> None:
    """Cheap completeness check (existence + size) of every shard listed in meta."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, info in meta["splits"].items():
        for shard in info["shards"]:
            path = d / shard["file"]
            want = shard["tokens"] * itemsize
            if not path.is_file():
                raise DataError(f"shard {path} listed in meta.json is missing: delete {d} and prepare again")
            got = path.stat().st_size
            if got != want:
                raise DataError(
                    f"shard {path} is truncated or corrupt: {got} bytes, expected {want} "
                    f"({shard['tokens']} tokens x {itemsize} bytes): delete {d} and prepare again"
                )


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += _diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def _existing(d: Path, settings: dict, fingerprint: str) -> Optional[dict]:
    """The meta of a complete prepared dir made with these settings; None if `d` is absent/empty.

    Refuses (DataError) a directory made with another tokenizer or other settings: mixing
    shards of two tokenizers silently trains on garbage.
    """
    if not d.exists() or (d.is_dir() and not any(d.iterdir())):
        return None
    meta = read_meta(d)
    if meta["fingerprint"] != fingerprint:
        old_tok, new_tok = meta.get("settings", {}).get("tokenizer", {}), settings["tokenizer"]
        if old_tok != new_tok:
            raise DataError(
                f"refusing to use {d}: its shards were made by a different tokenizer "
                f"({_describe_tok(old_tok)}) than this run's ({_describe_tok(new_tok)}). Set "
                "data.prepared_dir to a new directory (or null for an automatic one), or delete it"
            )
        changed = _diff(meta.get("settings", {}), settings)
        raise DataError(
            f"refusing to use {d}: it was prepared with different settings ({', '.join(changed)} "
            "differ). Set data.prepared_dir to a new directory (or null), or delete it"
        )
    _check_shards(d, meta)
    return meta


def _describe_tok(t: dict) -> str:
    if "sha256" in t:
        return f"sha256={t['sha256'][:12]}"
    return f"trained here with vocab_size={t.get('train_vocab_size')}"


def _result(d: Path, meta: dict, created: bool, verify: bool = False) -> PreparedData:
    if verify:  # sha256 of every shard (reads everything): catches silent corruption
        from .packed import PackedTokens

        for split in meta["splits"]:
            PackedTokens(d, split, verify=True)
    tok_file = meta["tokenizer"].get("file") or TOKENIZER_FILE
    return PreparedData(dir=str(d), tokenizer_path=str(d / tok_file), meta=meta, created=created)


# --- the entry point --------------------------------------------------------------------------
def _target(cfg: DataConfig, vocab_size: Optional[int]) -> tuple:
    """(source, vocab_size, dtype, settings, fingerprint, directory) of the prepared data for
    ``cfg``: everything decided before reading any text."""
    source = open_source(cfg)  # resolves local files; reads nothing, touches no network

    vocab_size, tok_settings = tokenizer_settings(cfg, vocab_size)
    dtype = resolve_dtype(cfg.dtype, int(vocab_size))
    settings = _settings(cfg, source, tok_settings, dtype)
    fingerprint = _fingerprint(settings)
    final = (Path(cfg.prepared_dir).expanduser() if cfg.prepared_dir
             else _default_dir(source, fingerprint))
    final = final.absolute()
    return source, vocab_size, dtype, settings, fingerprint, final


def find_prepared(cfg: Any, vocab_size: Optional[int] = None) -> Optional[PreparedData]:
    """The prepared data for ``cfg`` if it is already there, else None; prepares nothing (reads
    meta.json only: ``trainer.dry_run``)."""
    cfg = DataConfig.from_any(cfg)
    cfg.validate()
    if cfg.mixture:
        return find_prepared_mixture(cfg, vocab_size)
    _, _, _, settings, fingerprint, final = _target(cfg, vocab_size)
    meta = _existing(final, settings, fingerprint) if (final / META_FILE).is_file() else None
    return None if meta is None else _result(final, meta, created=False, verify=False)


def prepare_data(cfg: Any, vocab_size: Optional[int] = None) -> PreparedData:
    """Make sure the packed shards for `cfg` exist (preparing them at most once) and describe them.

    `vocab_size`: the model's vocabulary size. Required when cfg.tokenizer is None (a tokenizer of
    that size is trained); when cfg.tokenizer is given it must match the tokenizer's size.
    Safe to call from every rank at once: one prepares, the others wait on the lock.
    """
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A spawned tokenization worker is re-importing a main script that calls prepare_data at
        # import time: it would wait forever on the lock its own parent holds.
        raise DataError(
            "prepare_data was called while a worker process was importing the main script: put "
            "the script's code under `if __name__ == '__main__':` (needed for num_proc > 1), or "
            "set data.num_proc=1"
        )
    cfg = DataConfig.from_any(cfg)
    cfg.validate()
    if cfg.mixture:
        return prepare_mixture(cfg, vocab_size, prepare_source=prepare_data)
    source, vocab_size, dtype, settings, fingerprint, final = _target(cfg, vocab_size)

    # Fast path, no lock: a complete directory (meta.json is written last, renamed atomically).
    if (final / META_FILE).is_file():
        return _result(final, _existing(final, settings, fingerprint), created=False, verify=cfg.verify)

    from filelock import FileLock, Timeout

    final.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(final) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is preparing %s; waiting for it", final)
        lock.acquire()
    try:
        meta = _existing(final, settings, fingerprint)
        if meta is not None:
            return _result(final, meta, created=False, verify=cfg.verify)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a killed preparer
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            meta = _prepare_into(tmp, cfg, source, int(vocab_size), dtype, settings, fingerprint)
            if final.exists():
                final.rmdir()  # empty (checked by _existing); rename needs it gone
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        result = _result(final, meta, created=True)
        log.info("prepared data in %s (tokenizer %s)", final, result.tokenizer_path)
        return result
    finally:
        lock.release()


def _prepare_into(
    out: Path, cfg: DataConfig, source: Source, vocab_size: int, dtype: str, settings: dict, fingerprint: str
) -> dict:
    """Tokenizer, shards and meta.json in ``out`` (a temporary directory the caller renames)."""
    t0 = time.perf_counter()
    tok, trained = _tokenizer_into(out, cfg, source, vocab_size)
    t_tok = time.perf_counter() - t0
    num_proc = num_processes(cfg, source)
    n_docs = source.num_documents()
    n_bytes = source.approx_bytes() if not cfg.max_documents else None  # of the whole source
    log.info("tokenizing data.source=%s: %s documents%s with the %d-token %s tokenizer, %d "
             "process(es)", cfg.source, f"{n_docs:,}" if n_docs is not None else "(streamed)",
             f", ~{n_bytes / 1e6:,.1f} MB" if n_bytes is not None else "", tok.vocab_size,
             tok.kind, num_proc)
    t1 = time.perf_counter()
    # BLOCK_BYTES read here, at call time: tests set this module's to write small blocks
    splits, docs = encode_into(out, cfg, source, dtype, num_proc, BLOCK_BYTES,
                               tokenizer_file=tok.file_name)
    t_enc = time.perf_counter() - t1
    _check_documents(cfg, docs, splits)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint,
        "created_by": f"llama_train.data (python {sys.version.split()[0]})",
        "source": source.describe(),
        "settings": settings,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "add_bos": cfg.add_bos,
        "eos_appended": True,
        "tokenizer": {
            "file": tok.file_name,
            "kind": tok.kind,
            "sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
            "unk_id": tok.unk_id,
            "trained_here": trained,
            "source_path": None if trained else os.path.abspath(cfg.tokenizer),
        },
        "documents": {"read": docs["read"], "empty_skipped": docs["empty"],
                      "kept": docs["kept"]},
        "source_bytes": docs["bytes"],
        "val_fraction": cfg.val_fraction,
        # optional (meta version 1 without it: shards are checked whole, see PackedTokens)
        "block_checksums": {"algorithm": "crc32", "block_bytes": BLOCK_BYTES},
        "splits": splits,
        "timing_s": {
            "tokenizer": round(t_tok, 3),
            "tokenize_and_write": round(t_enc, 3),
            "block_checksums": round(docs["crc_s"], 4),
            "num_proc": num_proc,
        },
    }
    meta_tmp = out / (META_FILE + ".tmp")
    with open(meta_tmp, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(meta_tmp, out / META_FILE)
    total_tokens = sum(sp["tokens"] for sp in splits.values())
    nbytes = docs["bytes"]
    log.info(
        "prepared %s: %d docs (%d empty), train %d tokens / val %d tokens, %.1f MB in %.1fs "
        "(%.2f MB/s, %.0f tokens/s, num_proc=%d)",
        cfg.source, docs["read"], docs["empty"], splits["train"]["tokens"],
        splits["val"]["tokens"], nbytes / 1e6, t_enc, nbytes / 1e6 / max(t_enc, 1e-9),
        total_tokens / max(t_enc, 1e-9), num_proc,
    )
    return meta


def _tokenizer_into(out: Path, cfg: DataConfig, source: Source, vocab_size: int):
    """The given tokenizer copied into ``out`` (as tokenizer.model, or tokenizer.json for a
    Hugging Face one), or one trained there; (Tokenizer, trained)."""
    tok_path = out / TOKENIZER_FILE
    if cfg.tokenizer is not None:
        given = Tokenizer(cfg.tokenizer)
        tok_path = out / given.file_name
        shutil.copyfile(given.path, tok_path)
        trained = False
    else:
        log.info("training a %d-piece tokenizer on %s (the first %s non-empty lines at most)",
                 vocab_size, cfg.source, f"{cfg.tokenizer_max_sentences:,}"
                 if cfg.tokenizer_max_sentences else "all")
        model = train_tokenizer(
            source.iter_texts(), vocab_size, out / "tokenizer",
            max_sentences=cfg.tokenizer_max_sentences, seed=cfg.seed,
            max_line_bytes=cfg.tokenizer_max_line_bytes, source=f"data.source={cfg.source!r}",
            where=_line_namer(cfg, source),
        )
        assert Path(model) == tok_path
        trained = True
    tok = Tokenizer(tok_path)
    if tok.vocab_size != vocab_size:
        raise DataError(f"trained tokenizer has vocab_size={tok.vocab_size}, expected {vocab_size}")
    return tok, trained


def _line_namer(cfg: DataConfig, source: Source):
    """(document, line) -> where that line is, for tokenizer training's messages: the file and
    line for one .txt file read as one document, else the document's number in the source."""
    if source.kind == "local" and len(source.files) == 1 and cfg.text_sample_by == "document" \
            and source.files[0].endswith(".txt"):
        return lambda doc, i: f"line {i} of {source.files[0]}"
    return lambda doc, i: f"line {i} of document {doc} of data.source={cfg.source!r}"


def _check_documents(cfg: DataConfig, docs: dict, splits: dict) -> None:
    where = f"data.source={cfg.source!r}"
    if docs["read"] == 0:
        raise DataError(f"{where} has no documents (split={cfg.split!r}, text_column={cfg.text_column!r})")
    if docs["kept"] == 0:
        raise DataError(
            f"all {docs['read']} documents of {where} tokenize to nothing (empty text in column "
            f"{cfg.text_column!r}?): check data.text_column and the files"
        )
    if splits["train"]["tokens"] == 0:
        raise DataError(
            f"{where}: all {docs['kept']} non-empty documents went to validation; lower "
            f"data.val_fraction={cfg.val_fraction} or use more documents"
        )
    if docs["empty"]:
        log.warning("%s: %d of %d documents are empty (tokenize to nothing) and were skipped",
                    where, docs["empty"], docs["read"])


