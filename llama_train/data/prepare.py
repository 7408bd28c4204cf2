"""Prepare: source text -> tokenizer -> packed token shards + meta.json, exactly once.

Layout of a prepared directory:

    tokenizer.model          the SentencePiece model the tokens were made with
    train-00000.bin ...      flat token ids (uint16/uint32), documents back to back, EOS after each
    val-00000.bin ...        the held-out documents, same format
    train-00000.crc32 ...    crc32 of every 256 KiB block of the shard beside it (uint32 LE)
    meta.json                what, how, with which tokenizer; per-shard token counts, sha256,
                             and the sha256 of its .crc32 file

Safety: everything is written to a temp directory next to the target and renamed into place
at the end, so a prepared directory either has a complete meta.json or does not exist.
A file lock next to it makes concurrent callers (every rank of a job, several jobs on one
machine) wait for the single process that prepares, then load its result.
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
import zlib
from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .config import DataConfig
from .errors import DataError
from .meta import FORMAT, META_FILE, TOKENIZER_FILE, VERSION, read_meta
from .sources import Source, open_source
from .tokenizer import Tokenizer, train_tokenizer
from llama_train.util import fsync_dir

log = logging.getLogger(__name__)

UINT16_MAX_VOCAB = 65535
# Bump when the tokenizer training recipe changes: part of the fingerprint of trained tokenizers.
TOKENIZER_RECIPE = 1
SPLITS = ("train", "val")
# Block checksums (see ShardWriter, PackedTokens): a crc32 per 256 KiB of every shard. A reader
# checks a block on its first read, so this is the most a first read can cost on top of the
# window (~0.1-0.2 ms) and at most 2x the kernel's 128 KiB read-around from disk; the checksums
# are 1/65536 of the data (1.5 KB per 100 MB shard, 30 MB for 1T uint16 tokens).
BLOCK_BYTES = 1 << 18


@dataclass
class PreparedData:
    """Result of prepare_data: where the shards are and what meta.json says."""

    dir: str
    tokenizer_path: str
    meta: dict
    created: bool = False
    """True if this call wrote the directory, False if it found it already prepared."""


def resolve_dtype(dtype: str, vocab_size: int) -> str:
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


# Below this much text, starting worker processes costs more than it saves (measured: 4 MB).
AUTO_PARALLEL_MIN_BYTES = 32 << 20


def _num_proc(cfg: DataConfig, source: Source) -> int:
    """cfg.num_proc, or for 0 (auto): all cores (max 8), except in-process for small sources."""
    if cfg.num_proc:
        return cfg.num_proc
    size = source.approx_bytes()
    if size is not None and size < AUTO_PARALLEL_MIN_BYTES:
        return 1
    return min(os.cpu_count() or 1, 8)


def _is_val(j: int, frac: Fraction) -> bool:
    """Document-level split: non-empty document j is held out iff ceil((j+1)f) > ceil(jf).

    Exact integer arithmetic: picks ceil(N*f) documents evenly spread over the source (the first
    one included), independent of batching, process count and streaming.
    """
    p, q = frac.numerator, frac.denominator
    return -((-(j + 1) * p) // q) > -((-j * p) // q)


# --- tokenization workers (also used in-process when num_proc == 1) ---------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(model_path: str, add_bos: bool, dtype: str) -> None:
    tok = Tokenizer(model_path)
    _WORKER.update(tok=tok, add_bos=add_bos, dtype=np.dtype(dtype))


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Encode documents -> (flat ids with BOS?/EOS per doc, per-doc lengths, input bytes).

    A document that encodes to no tokens gets length 0 and contributes nothing (not even EOS).
    """
    tok: Tokenizer = _WORKER["tok"]
    ids = tok.sp.encode(texts)
    pre = [tok.bos_id] if _WORKER["add_bos"] else []
    eos = [tok.eos_id]
    lengths = np.fromiter(
        (len(x) + len(pre) + 1 if x else 0 for x in ids), dtype=np.int64, count=len(ids)
    )
    flat: list[int] = []
    for x in ids:
        if x:
            flat += pre
            flat += x
            flat += eos
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    return np.array(flat, dtype=_WORKER["dtype"]), lengths, nbytes


def _encoded_chunks(source: Source, model_path: str, add_bos: bool, dtype: str, num_proc: int):
    """Yield _encode_chunk results in source order, `num_proc` processes, bounded memory."""
    batches = source.iter_batches()
    if num_proc <= 1:
        _init_worker(model_path, add_bos, dtype)
        for texts in batches:
            yield _encode_chunk(texts), len(texts)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: the caller may already run threads (torch, tqdm, HF) that fork would copy
    # mid-lock; the workers import only numpy + sentencepiece.
    try:
        with ProcessPoolExecutor(
            max_workers=num_proc,
            mp_context=mp.get_context("spawn"),
            initializer=_init_worker,
            initargs=(model_path, add_bos, dtype),
        ) as pool:
            pending: deque = deque()
            for texts in batches:
                pending.append((pool.submit(_encode_chunk, texts), len(texts)))
                if len(pending) >= 2 * num_proc:
                    fut, n = pending.popleft()
                    yield fut.result(), n
            while pending:
                fut, n = pending.popleft()
                yield fut.result(), n
    except BrokenProcessPool as e:
        raise DataError(
            f"a tokenization worker process died ({e}). Common causes: the main script has no "
            "`if __name__ == '__main__':` guard (worker processes re-import it), or out of "
            "memory. Set data.num_proc=1 to tokenize in-process"
        ) from e


class ShardWriter:
    """Appends tokens of one split to `<split>-NNNNN.bin` files of at most `shard_tokens` each.

    Beside each shard it writes `<split>-NNNNN.crc32`: the crc32 of every `block_bytes` block of
    the shard (the last one may be shorter), uint32 little-endian, computed from the bytes as
    they are written; meta.json gets its sha256, so a reader can trust it (PackedTokens).
    """

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int,
                 block_bytes: int = 0):
        self.out_dir, self.split, self.dtype = out_dir, split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.block_bytes = block_bytes or BLOCK_BYTES
        if self.block_bytes % self.dtype.itemsize:
            raise ValueError(f"block_bytes={self.block_bytes} is not a multiple of {self.dtype.itemsize}")
        self.shards: list[dict] = []
        self.documents = 0
        self.crc_s = 0.0  # time spent on block checksums (meta.json timing_s)
        self._f = None
        self._sha = None
        self._n = 0
        self._crcs: list[int] = []
        self._crc = 0  # running crc32 of the current block
        self._in_block = 0  # bytes of the current block written so far
        self._split_sha = hashlib.sha256()  # of the whole token stream: shard-layout independent

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._f = open(self.out_dir / name, "wb")
        self._sha = hashlib.sha256()
        self._n = 0
        self._crcs, self._crc, self._in_block = [], 0, 0
        self.shards.append({"file": name})

    def _close(self) -> None:
        if self._f is None:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if self._in_block:
            self._crcs.append(self._crc)
        crc_name = self.shards[-1]["file"][: -len(".bin")] + ".crc32"
        raw = np.array(self._crcs, dtype="<u4").tobytes()
        with open(self.out_dir / crc_name, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        self.shards[-1].update(tokens=self._n, bytes=self._n * self.dtype.itemsize, sha256=self._sha.hexdigest(),
                               block_crc32={"file": crc_name, "sha256": hashlib.sha256(raw).hexdigest()})
        self._f = None

    def _blocks(self, buf: bytes) -> None:
        """Fold `buf` (the next bytes of the shard) into the block checksums."""
        t0 = time.perf_counter()
        view, size = memoryview(buf), self.block_bytes
        while view:
            take = min(size - self._in_block, len(view))
            self._crc = zlib.crc32(view[:take], self._crc)
            self._in_block += take
            view = view[take:]
            if self._in_block == size:
                self._crcs.append(self._crc)
                self._crc, self._in_block = 0, 0
        self.crc_s += time.perf_counter() - t0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        while tokens.size:
            if self._f is None:
                self._open()
            take = min(self.shard_tokens - self._n, tokens.size)
            buf = tokens[:take].tobytes()
            self._f.write(buf)
            self._sha.update(buf)
            self._split_sha.update(buf)
            self._blocks(buf)
            self._n += take
            tokens = tokens[take:]
            if self._n >= self.shard_tokens:
                self._close()

    def finish(self) -> dict:
        self._close()
        return {
            "documents": self.documents,
            "tokens": sum(s["tokens"] for s in self.shards),
            "sha256": self._split_sha.hexdigest(),
            "shards": self.shards,
        }


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
    return PreparedData(dir=str(d), tokenizer_path=str(d / TOKENIZER_FILE), meta=meta, created=created)


# --- the entry point --------------------------------------------------------------------------
def tokenizer_settings(cfg: DataConfig, vocab_size: Optional[int]) -> tuple:
    """(vocab_size, what identifies the tokenizer): data.tokenizer's sha256 (its size must be the
    model's), or the recipe of the one to train, of the model's vocab_size. Part of the
    fingerprint of prepared data and of mixtures."""
    if cfg.tokenizer is not None:
        tok = Tokenizer(cfg.tokenizer)
        if vocab_size is not None and tok.vocab_size != vocab_size:
            raise DataError(
                f"data.tokenizer={cfg.tokenizer!r} has vocab_size={tok.vocab_size} but "
                f"model.vocab_size={vocab_size}: set model.vocab_size={tok.vocab_size} or use "
                "a tokenizer of the model's size"
            )
        vocab_size = tok.vocab_size
        tok_settings: dict = {"sha256": tok.sha256, "vocab_size": vocab_size}
    else:
        if vocab_size is None:
            raise DataError(
                "no data.tokenizer given and no vocab_size to train one with: pass the model's "
                "vocab_size (llama-data prepare --vocab-size N) or set data.tokenizer"
            )
        tok_settings = {
            "train_vocab_size": int(vocab_size),
            "max_sentences": cfg.tokenizer_max_sentences,
            "recipe": TOKENIZER_RECIPE,
        }
    return int(vocab_size), tok_settings


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
        from .mixture import find_prepared_mixture

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
        from .mixture import prepare_mixture

        return prepare_mixture(cfg, vocab_size)
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
        return _result(final, meta, created=True)
    finally:
        lock.release()


def _prepare_into(
    out: Path, cfg: DataConfig, source: Source, vocab_size: int, dtype: str, settings: dict, fingerprint: str
) -> dict:
    """Tokenizer, shards and meta.json in ``out`` (a temporary directory the caller renames)."""
    t0 = time.perf_counter()
    tok, trained = _tokenizer_into(out, cfg, source, vocab_size)
    t_tok = time.perf_counter() - t0
    num_proc = _num_proc(cfg, source)
    t1 = time.perf_counter()
    splits, docs = _encode_into(out, cfg, source, dtype, num_proc)
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
            "file": TOKENIZER_FILE,
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
    """The given tokenizer copied into ``out``, or one trained there; (Tokenizer, trained)."""
    tok_path = out / TOKENIZER_FILE
    if cfg.tokenizer is not None:
        shutil.copyfile(cfg.tokenizer, tok_path)
        trained = False
    else:
        log.info("training a %d-piece tokenizer on %s", vocab_size, cfg.source)
        model = train_tokenizer(
            source.iter_texts(), vocab_size, out / "tokenizer",
            max_sentences=cfg.tokenizer_max_sentences, seed=cfg.seed,
        )
        assert Path(model) == tok_path
        trained = True
    tok = Tokenizer(tok_path)
    if tok.vocab_size != vocab_size:
        raise DataError(f"trained tokenizer has vocab_size={tok.vocab_size}, expected {vocab_size}")
    return tok, trained


def _encode_into(out: Path, cfg: DataConfig, source: Source, dtype: str, num_proc: int):
    """Tokenize every document into the train/val shards; (split summaries, document counts)."""
    from tqdm.auto import tqdm

    writers = {s: ShardWriter(out, s, dtype, cfg.shard_tokens, BLOCK_BYTES) for s in SPLITS}
    frac = Fraction(str(cfg.val_fraction))
    docs = {"read": 0, "empty": 0, "kept": 0, "bytes": 0}
    bar = tqdm(total=source.num_documents(), unit="doc", desc=f"tokenizing {source.name}",
               mininterval=1.0, dynamic_ncols=True)
    try:
        chunks = _encoded_chunks(source, str(out / TOKENIZER_FILE), cfg.add_bos, dtype, num_proc)
        for (flat, lengths, nb), n in chunks:
            docs["read"] += n
            docs["bytes"] += nb
            keep = lengths > 0
            docs["empty"] += int((~keep).sum())
            kept = lengths[keep]
            is_val = np.fromiter((_is_val(docs["kept"] + j, frac) for j in range(kept.size)),
                                 bool, kept.size)
            docs["kept"] += kept.size
            token_is_val = np.repeat(is_val, kept)
            for split, mask in (("train", ~token_is_val), ("val", token_is_val)):
                writers[split].write(flat[mask])
            writers["val"].documents += int(is_val.sum())
            writers["train"].documents += int((~is_val).sum())
            bar.update(n)
    finally:
        bar.close()
    crc_s = sum(w.crc_s for w in writers.values())
    return {s: w.finish() for s, w in writers.items()}, {**docs, "crc_s": crc_s}


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


