"""Tokenizing a source into packed shards: the tokenization worker processes, the train/val
split of documents, and ShardWriter (``<split>-NNNNN.bin`` + its ``.crc32`` block checksums).

prepare.py decides where and whether to prepare; this module writes the tokens. Spawned
tokenization workers import it, so it stays light: numpy and the tokenizer, no config loading.
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from collections import deque
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import DataError
from .meta import TOKENIZER_FILE
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .config import DataConfig
    from .sources import Source

SPLITS = ("train", "val")
# Block checksums (see ShardWriter, PackedTokens): a crc32 per 256 KiB of every shard. A reader
# checks a block on its first read, so this is the most a first read can cost on top of the
# window (~0.1-0.2 ms) and at most 2x the kernel's 128 KiB read-around from disk; the checksums
# are 1/65536 of the data (1.5 KB per 100 MB shard, 30 MB for 1T uint16 tokens).
BLOCK_BYTES = 1 << 18
# Below this much text, starting worker processes costs more than it saves (measured: 4 MB).
AUTO_PARALLEL_MIN_BYTES = 32 << 20


def num_processes(cfg: DataConfig, source: Source) -> int:
    """cfg.num_proc, or for 0 (auto): all cores (max 8), except in-process for small sources."""
    if cfg.num_proc:
        return cfg.num_proc
    size = source.approx_bytes()
    if size is not None and size < AUTO_PARALLEL_MIN_BYTES:
        return 1
    return min(os.cpu_count() or 1, 8)


def is_val(j: int, frac: Fraction) -> bool:
    """Document-level split: non-empty document j is held out iff ceil((j+1)f) > ceil(jf).

    Exact integer arithmetic: picks ceil(N*f) documents evenly spread over the source (the first
    one included), independent of batching, process count and streaming.
    """
    p, q = frac.numerator, frac.denominator
    return -((-(j + 1) * p) // q) > -((-j * p) // q)


# --- tokenization workers (also used in-process when num_proc == 1) ---------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(model_path: str, add_bos: bool, dtype: str, one_thread: bool = False) -> None:
    if one_thread:  # one of num_proc workers: a Hugging Face tokenizer's own threads oversubscribe
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = Tokenizer(model_path)
    _WORKER.update(tok=tok, add_bos=add_bos, dtype=np.dtype(dtype))


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Encode documents -> (flat ids with BOS?/EOS per doc, per-doc lengths, input bytes).

    A document that encodes to no tokens gets length 0 and contributes nothing (not even EOS).
    """
    tok: Tokenizer = _WORKER["tok"]
    ids = tok.encode_batch(texts)
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


def encoded_chunks(source: Source, model_path: str, add_bos: bool, dtype: str, num_proc: int):
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
            initargs=(model_path, add_bos, dtype, True),
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


def encode_into(out: Path, cfg: DataConfig, source: Source, dtype: str, num_proc: int,
                block_bytes: int = BLOCK_BYTES, tokenizer_file: str = TOKENIZER_FILE):
    """Tokenize every document of ``source`` with ``out``'s tokenizer (``tokenizer_file`` in it)
    into its train/val shards; (split summaries, document counts)."""
    from tqdm.auto import tqdm

    writers = {s: ShardWriter(out, s, dtype, cfg.shard_tokens, block_bytes) for s in SPLITS}
    frac = Fraction(str(cfg.val_fraction))
    docs = {"read": 0, "empty": 0, "kept": 0, "bytes": 0}
    bar = tqdm(total=source.num_documents(), unit="doc", desc=f"tokenizing {source.name}",
               mininterval=1.0, dynamic_ncols=True)
    try:
        chunks = encoded_chunks(source, str(out / tokenizer_file), cfg.add_bos, dtype, num_proc)
        for (flat, lengths, nb), n in chunks:
            docs["read"] += n
            docs["bytes"] += nb
            keep = lengths > 0
            docs["empty"] += int((~keep).sum())
            kept = lengths[keep]
            held = np.fromiter((is_val(docs["kept"] + j, frac) for j in range(kept.size)),
                               bool, kept.size)
            docs["kept"] += kept.size
            token_is_val = np.repeat(held, kept)
            for split, mask in (("train", ~token_is_val), ("val", token_is_val)):
                writers[split].write(flat[mask])
            writers["val"].documents += int(held.sum())
            writers["train"].documents += int((~held).sum())
            bar.update(n)
    finally:
        bar.close()
    crc_s = sum(w.crc_s for w in writers.values())
    return {s: w.finish() for s, w in writers.items()}, {**docs, "crc_s": crc_s}
