"""PackedTokens: one split of a prepared directory as a single memory-mapped token array.

Integrity without reading the dataset up front: prepare records a crc32 of every fixed-size
block of every shard (`<shard>.crc32`, one small file per shard whose sha256 is in meta.json),
and a process checks each block the first time it reads a window that touches it, before the
window is returned. The cost follows the data actually read, spread over the run; a checked
block costs a bitmap look-up. Data prepared before block checksums existed falls back to a
whole-shard sha256 on a shard's first read. `verify=True` hashes every shard up front.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from pathlib import Path
from typing import Optional, Union

import numpy as np

from .errors import DataError
from .meta import read_meta

log = logging.getLogger(__name__)

_HASH_BLOCK = 1 << 20
BLOCK_ALGORITHM = "crc32"

# Shards whose sha256 this process has checked, by the identity of the file checked: (device,
# inode, size, mtime, ctime) -> sha256. A shard is hashed once per process however many
# PackedTokens open it (the train loader, every evaluation's eval_set, a re-built loader);
# a DataLoader worker forked after the check inherits it. A file replaced or rewritten since
# has another identity and is hashed again. verify=True always hashes again.
_VERIFIED: dict[tuple, str] = {}

# The same for block checksums: (file identity, shard sha256) -> _ShardBlocks, so a block is
# checked once per process whichever PackedTokens reads it.
_BLOCKS: dict[tuple, "_ShardBlocks"] = {}

# Prepared directories this process has said to lack block checksums (said once, not per reader).
_NOTED_OLD: set[str] = set()


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _fd_sha256(fd: int) -> str:
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        n = os.readv(fd, [buf])
        if not n:
            return h.hexdigest()
        h.update(view[:n])


def _verify_hint(path: Path) -> str:
    return f"(`llama-data info {path.parent} --verify` checks every shard)"


def verified_open(path: Path, want: Optional[str], fix: str, again: bool = False):
    """Open a shard for reading and check it against meta.json's sha256 first (once per
    process per file, or `again`); the open file is what gets mapped, so the bytes checked are
    the bytes read. DataError with both digests and the fix on a mismatch."""
    f = open(path, "rb")
    try:
        key = _identity(os.fstat(f.fileno()))
        if want and (again or _VERIFIED.get(key) != want):
            got = _fd_sha256(f.fileno())
            if got != want:
                raise DataError(
                    f"shard {path} fails its sha256 check (its contents changed after prepare: "
                    f"disk or copy corruption, or an edit): meta.json says {want}, the file "
                    f"hashes to {got}: {fix} {_verify_hint(path)}"
                )
            _VERIFIED[key] = got
    except BaseException:
        f.close()
        raise
    return f


class _ShardBlocks:
    """One shard's block checksums and which of its blocks this process has checked.

    `ok` is a bytearray, one byte per block: the check of an already-checked block, on every
    read, is one index into it.
    """

    __slots__ = ("path", "crc_path", "crcs", "ok", "block_bytes", "block_tokens", "fix")

    def __init__(self, path: Path, crc_path: Path, crcs: np.ndarray, block_bytes: int,
                 itemsize: int, fix: str):
        self.path, self.crc_path, self.crcs, self.fix = path, crc_path, crcs, fix
        self.block_bytes, self.block_tokens = block_bytes, block_bytes // itemsize
        self.ok = bytearray(len(crcs))

    def check(self, tokens: np.ndarray, lo: int, hi: int) -> None:
        """Check the blocks holding tokens[lo:hi] (offsets in this shard) not checked yet."""
        bt, ok = self.block_tokens, self.ok
        for b in range(lo // bt, (hi - 1) // bt + 1):
            if not ok[b]:
                self.verify(tokens, b)

    def verify(self, tokens: np.ndarray, b: int) -> None:
        """crc32 of block b, read through the same map the window is then sliced from."""
        bt = self.block_tokens
        got = zlib.crc32(tokens[b * bt : (b + 1) * bt])
        want = int(self.crcs[b])
        if got != want:
            lo = b * self.block_bytes
            hi = min(lo + self.block_bytes, tokens.size * tokens.itemsize)
            raise DataError(
                f"shard {self.path} fails its crc32 check at bytes {lo}-{hi - 1} (block {b} of "
                f"{len(self.crcs)}, {self.block_bytes} bytes each; its contents changed after "
                f"prepare: disk or copy corruption, or an edit): {self.crc_path.name} says "
                f"{want:08x}, the bytes hash to {got:08x}: {self.fix} {_verify_hint(self.path)}"
            )
        self.ok[b] = 1


def _block_bytes(meta: dict, path: Path, itemsize: int, fix: str) -> int:
    """meta.json's block size in bytes, 0 if it has no block checksums (an older prepare)."""
    spec = meta.get("block_checksums")
    if spec is None:
        return 0
    size = spec.get("block_bytes") if isinstance(spec, dict) else None
    if (not isinstance(spec, dict) or spec.get("algorithm") != BLOCK_ALGORITHM
            or not isinstance(size, int) or size <= 0 or size % itemsize):
        raise DataError(
            f"{path} has block_checksums={spec!r}, which this code cannot use (it reads "
            f"{BLOCK_ALGORITHM!r} over blocks of a positive multiple of {itemsize} bytes): {fix}"
        )
    return size


class PackedTokens:
    """The shards of `split`, validated against meta.json, sliceable across shard boundaries.

    Validation on open: every shard exists and has exactly tokens x itemsize bytes (a truncated
    copy fails here, naming the file); with verify=True also every shard's sha256 and its block
    checksum file's (reads them all, up front). Without verify, nothing is returned that was not
    checked in this process: each block's crc32 before the first window that touches it (a
    window can straddle two blocks or two shards: every block it touches), so a same-size
    corruption whose tokens may well be in range is never trained on, and the cost is one crc32
    per block actually read. A shard prepared without block checksums gets its sha256 checked
    on its first read instead (the whole shard, once per process).

    Each shard's memmap is opened on first use and dropped on pickling, so a DataLoader worker
    maps (and checks) the files itself instead of receiving a copy of their contents.
    """

    def __init__(self, prepared_dir: Union[str, os.PathLike], split: str = "train", verify: bool = False):
        self.dir = Path(prepared_dir)
        self.meta = read_meta(self.dir)
        if split not in self.meta["splits"]:
            raise DataError(
                f"split {split!r} is not in {self.dir}/meta.json; available: {sorted(self.meta['splits'])}"
            )
        self.split = split
        self.dtype = np.dtype(self.meta["dtype"])
        info = self.meta["splits"][split]
        self.shards = [s for s in info["shards"] if s["tokens"] > 0]
        self._fix = f"delete {self.dir} and run prepare again"
        self.block_bytes = _block_bytes(self.meta, self.dir / "meta.json", self.dtype.itemsize, self._fix)
        self._validate(verify)
        sizes = np.array([s["tokens"] for s in self.shards], dtype=np.int64)
        # _starts[i] = index of the first token of shard i; _starts[-1] = total
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._maps: list[Optional[np.memmap]] = [None] * len(self.shards)
        self._blocks: list[Optional[_ShardBlocks]] = [None] * len(self.shards)
        if any(not self._has_blocks(s) for s in self.shards) and str(self.dir) not in _NOTED_OLD:
            _NOTED_OLD.add(str(self.dir))
            log.warning(
                "%s was prepared without block checksums: each shard's sha256 is checked the "
                "first time a process reads from it (the whole shard, ~0.1 s per 100 MB). Prepare "
                "it again (delete it first) for the per-block check, which reads only what "
                "training reads", self.dir)

    def _has_blocks(self, shard: dict) -> bool:
        return bool(self.block_bytes) and "block_crc32" in shard

    def _validate(self, verify: bool) -> None:
        fix = self._fix
        for shard in self.shards:
            path = self.dir / shard["file"]
            want = shard["tokens"] * self.dtype.itemsize
            if not path.is_file():
                raise DataError(f"shard {path} listed in meta.json is missing: {fix}")
            got = path.stat().st_size
            if got != want:
                raise DataError(
                    f"shard {path} is truncated or corrupt: {got} bytes on disk, meta.json says "
                    f"{shard['tokens']} tokens x {self.dtype.itemsize} = {want} bytes: {fix}"
                )
        if verify:  # the up-front check; the lazy ones then find every shard and block checked
            for shard in self.shards:
                path = self.dir / shard["file"]
                with verified_open(path, shard.get("sha256"), fix, again=True) as f:
                    if self._has_blocks(shard):
                        blocks = self._load_blocks(shard, path)
                        blocks.ok[:] = b"\1" * len(blocks.ok)  # the whole shard just matched
                        _BLOCKS[(_identity(os.fstat(f.fileno())), shard.get("sha256"))] = blocks

    def _load_blocks(self, shard: dict, path: Path) -> _ShardBlocks:
        """The shard's block checksums, from its .crc32 file checked against meta.json."""
        entry = shard["block_crc32"]
        crc_path = self.dir / entry["file"]
        try:
            raw = crc_path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"block checksum file {crc_path} listed in meta.json is missing: "
                            f"{self._fix}") from None
        got = hashlib.sha256(raw).hexdigest()
        if got != entry.get("sha256"):
            raise DataError(
                f"block checksum file {crc_path} fails its sha256 check (its contents changed "
                f"after prepare): meta.json says {entry.get('sha256')}, the file hashes to {got}: "
                f"{self._fix} {_verify_hint(path)}"
            )
        crcs = np.frombuffer(raw, dtype="<u4")
        n = -(-shard["tokens"] * self.dtype.itemsize // self.block_bytes)
        if len(crcs) != n:
            raise DataError(
                f"block checksum file {crc_path} holds {len(crcs)} checksums but shard {path} has "
                f"{n} blocks of {self.block_bytes} bytes (meta.json is inconsistent): {self._fix}"
            )
        return _ShardBlocks(path, crc_path, crcs, self.block_bytes, self.dtype.itemsize, self._fix)

    def _map(self, i: int) -> np.memmap:
        """Shard i's memmap, opened on first use: with its block checksums (checked per block
        as windows are read), or, for older data, after checking its whole sha256."""
        m = self._maps[i]
        if m is None:
            shard = self.shards[i]
            path = self.dir / shard["file"]
            if self._has_blocks(shard):
                with open(path, "rb") as f:
                    key = (_identity(os.fstat(f.fileno())), shard.get("sha256"))
                    blocks = _BLOCKS.get(key)
                    if blocks is None:
                        blocks = _BLOCKS[key] = self._load_blocks(shard, path)
                    m = np.memmap(f, dtype=self.dtype, mode="r", shape=(shard["tokens"],))
                self._blocks[i] = blocks
            else:
                with verified_open(path, shard.get("sha256"), self._fix) as f:
                    m = np.memmap(f, dtype=self.dtype, mode="r", shape=(shard["tokens"],))
            self._maps[i] = m
        return m

    def _read(self, s: int, lo: int, hi: int) -> np.ndarray:
        """tokens[lo:hi] of shard s (offsets in the shard), its blocks checked first."""
        m = self._map(s)
        blocks = self._blocks[s]
        if blocks is not None:
            blocks.check(m, lo, hi)
        return m[lo:hi]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = [None] * len(self.shards)
        state["_blocks"] = [None] * len(self.shards)
        return state

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, idx: Union[int, slice]) -> np.ndarray:
        """tokens[i] -> int; tokens[a:b] -> array (a view inside one shard, else a copy)."""
        n = len(self)
        if isinstance(idx, (int, np.integer)):
            i = int(idx) + n if idx < 0 else int(idx)
            if not 0 <= i < n:
                raise IndexError(f"token index {idx} out of range for {n} tokens")
            s = int(np.searchsorted(self._starts, i, side="right")) - 1
            j = i - int(self._starts[s])
            return self._read(s, j, j + 1)[0]
        if not isinstance(idx, slice):
            raise TypeError(f"PackedTokens indices must be int or slice, not {type(idx).__name__}")
        start, stop, step = idx.indices(n)
        if step != 1:
            raise ValueError("PackedTokens slices must have step 1")
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, stop - 1, side="right")) - 1
        if first == last:
            off = int(self._starts[first])
            return self._read(first, start - off, stop - off)
        parts = []
        for s in range(first, last + 1):
            off, end = int(self._starts[s]), int(self._starts[s + 1])
            parts.append(self._read(s, max(start, off) - off, min(stop, end) - off))
        return np.concatenate(parts)

    def __repr__(self) -> str:
        return f"PackedTokens({str(self.dir)!r}, split={self.split!r}, tokens={len(self)}, dtype={self.dtype})"
