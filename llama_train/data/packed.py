"""PackedTokens: one split of a prepared directory as a single memory-mapped token array.

Integrity without reading the dataset up front: prepare records a crc32 of every fixed-size
block of every shard (`<shard>.crc32`, one small file per shard whose sha256 is in meta.json),
and a process checks each block the first time it reads a window that touches it, before the
window is returned. The cost follows the data actually read, spread over the run; a checked
block costs a bitmap look-up. Data prepared before block checksums existed falls back to a
whole-shard sha256 on a shard's first read. `verify=True` hashes every shard up front.

Data that changes under a running job is never used either. Shards are read with pread, not a
memory map, so a shard truncated mid-run is a short read (DataChanged naming the file), never a
SIGBUS. After every read (a slice, or a micro-batch of windows) each file it read from is
fstat-ed (~0.8 µs): a write or a truncation updates the file's mtime/ctime/size before its
bytes change (so does the first write through a memory map to a clean page; seen on ext4 and
tmpfs), so a read whose file looks the same afterwards read the bytes that were checked. A
shard whose identity moved has its blocks checked again as they are read (the read is
repeated): a `touch` or an identical copy goes on, changed bytes or another size raise
DataChanged before the window is returned.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import zlib
from pathlib import Path
from typing import Optional, Union

import numpy as np

from .errors import DataChanged, DataError
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

# Shards (path, identity) this process has said changed under it (said once per change).
_NOTED_CHANGED: set[tuple] = set()

# A read whose file changed during it is repeated (the change checked first) this many times
# at most: a file written to all the while is refused.
_READS = 3


def _max_open() -> int:
    """Shard files a reader keeps open at once (the oldest opened is closed first): a 1T-token
    dataset has ~20,000 shards and the soft limit on open files is often 1024. Reopening one
    costs ~4 µs (open + fstat + close)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft < 0:
            soft = 1 << 16
    except (ImportError, OSError, ValueError):
        soft = 1024
    return max(8, min(128, soft // 16))


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _fd_sha256(fd: int) -> str:
    """sha256 of the whole file, by offset (pread): a forked worker shares the file offset."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    off = 0
    while True:
        n = os.preadv(fd, [buf], off)
        if not n:
            return h.hexdigest()
        h.update(view[:n])
        off += n


def _verify_hint(path: Path) -> str:
    return f"(`llama-data info {path.parent} --verify` checks every shard)"


def _changed_fix(path: Path) -> str:
    return (f"put the shard back as prepared (`llama-data info {path.parent} --verify` checks "
            f"every shard) and relaunch: the run resumes from its last checkpoint. Never write "
            f"to a prepared directory a job reads: prepare changed data into a new one")


def _when(ns: int) -> str:
    ms = ns % 10**9 // 10**6
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ms:03d}"


def verified_open(path: Path, want: Optional[str], fix: str, again: bool = False):
    """Open a shard for reading and check it against meta.json's sha256 first (once per
    process per file, or `again`); the open file is what gets read, so the bytes checked are
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
    read, is one index into it. `changed` says how the file changed after the job opened it
    (None: it did not), so that a failing block is reported as data changed under the job.
    """

    __slots__ = ("path", "crc_path", "crcs", "ok", "block_bytes", "block_tokens", "nbytes",
                 "fix", "changed")

    def __init__(self, path: Path, crc_path: Path, crcs: np.ndarray, block_bytes: int,
                 itemsize: int, fix: str, nbytes: int = 0):
        self.path, self.crc_path, self.crcs, self.fix = path, crc_path, crcs, fix
        self.block_bytes, self.block_tokens = block_bytes, block_bytes // itemsize
        self.nbytes = nbytes or len(crcs) * block_bytes
        self.ok = bytearray(len(crcs))
        self.changed: Optional[str] = None

    def again(self, changed: str) -> "_ShardBlocks":
        """The same checksums, no block checked: for the file after it changed."""
        fresh = _ShardBlocks(self.path, self.crc_path, self.crcs, self.block_bytes,
                             self.block_bytes // self.block_tokens, self.fix, self.nbytes)
        fresh.changed = changed
        return fresh

    def all_ok(self, lo: int, hi: int) -> bool:
        """Whether every block holding tokens[lo:hi] is checked (no 0 byte among theirs)."""
        bt = self.block_tokens
        return self.ok.find(0, lo // bt, (hi - 1) // bt + 1) < 0

    def check(self, tokens, lo: int, hi: int) -> None:
        """Check the blocks holding tokens[lo:hi] (offsets in this shard) not checked yet;
        `tokens` slices by shard offsets and holds at least those blocks."""
        bt, ok = self.block_tokens, self.ok
        for b in range(lo // bt, (hi - 1) // bt + 1):
            if not ok[b]:
                self.verify(tokens, b)

    def verify(self, tokens, b: int) -> None:
        """crc32 of block b, of the very bytes the window is then sliced from."""
        bt = self.block_tokens
        got = zlib.crc32(tokens[b * bt : (b + 1) * bt])
        want = int(self.crcs[b])
        if got != want:
            lo = b * self.block_bytes
            hi = min(lo + self.block_bytes, self.nbytes)
            where = (f"block {b} of {len(self.crcs)} (bytes {lo}-{hi - 1}, {self.block_bytes} "
                     f"bytes each)")
            if self.changed is not None:
                raise DataChanged(
                    f"shard {self.path} was changed while this job was reading it "
                    f"({self.changed}): {where} now fails its crc32 check: {self.crc_path.name} "
                    f"says {want:08x}, the bytes hash to {got:08x}: {_changed_fix(self.path)}")
            raise DataError(
                f"shard {self.path} fails its crc32 check at bytes {lo}-{hi - 1} (block {b} of "
                f"{len(self.crcs)}, {self.block_bytes} bytes each; its contents changed after "
                f"prepare: disk or copy corruption, or an edit): {self.crc_path.name} says "
                f"{want:08x}, the bytes hash to {got:08x}: {self.fix} {_verify_hint(self.path)}"
            )
        self.ok[b] = 1


class _Span:
    """Tokens [first, first + len(buf)) of a shard, sliced by shard offsets (what
    _ShardBlocks.check reads the blocks of a window from)."""

    __slots__ = ("buf", "first")

    def __init__(self, buf: np.ndarray, first: int):
        self.buf, self.first = buf, first

    def __getitem__(self, s: slice) -> np.ndarray:
        return self.buf[s.start - self.first : s.stop - self.first]


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

    Nothing is returned that changed after this object was made, either: reads are pread calls
    (a truncated shard is a short read, not a SIGBUS), then one fstat per file read from per
    call (`windows` reads a whole micro-batch per call); a shard whose size changed raises
    DataChanged, one whose mtime/ctime moved is checked again (its blocks, or its sha256 for
    older data) and the read repeated: changed bytes raise DataChanged, a touch or an
    identical rewrite goes on. Slices are new arrays, never views.

    Each shard is opened on first use (a forked DataLoader worker inherits the open file), at
    most `_max_open()` at once (the oldest opened is closed: a reopened file is compared with
    the one checked), and its descriptor dropped on pickling, so a spawned worker opens (and
    checks) it itself.
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
        self._paths = [self.dir / s["file"] for s in self.shards]
        self._nbytes = [s["tokens"] * self.dtype.itemsize for s in self.shards]
        # the identity of each shard when this object was made: later reads compare with it
        self._start: list[tuple] = [()] * len(self.shards)
        self._validate(verify)
        sizes = np.array([s["tokens"] for s in self.shards], dtype=np.int64)
        # _starts[i] = index of the first token of shard i; _starts[-1] = total
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._fds: list[Optional[int]] = [None] * len(self.shards)
        self._opened: list[int] = []  # shards with an open descriptor, oldest first
        self._max_open = _max_open()
        self._ident: list[tuple] = [()] * len(self.shards)  # what the checks so far hold for
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
        for i, shard in enumerate(self.shards):
            path = self._paths[i]
            want = self._nbytes[i]
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
            if st is None or not path.is_file():
                raise DataError(f"shard {path} listed in meta.json is missing: {fix}")
            if st.st_size != want:
                raise DataError(
                    f"shard {path} is truncated or corrupt: {st.st_size} bytes on disk, meta.json "
                    f"says {shard['tokens']} tokens x {self.dtype.itemsize} = {want} bytes: {fix}"
                )
            self._start[i] = _identity(st)
        if verify:  # the up-front check; the lazy ones then find every shard and block checked
            for i, shard in enumerate(self.shards):
                path = self._paths[i]
                with verified_open(path, shard.get("sha256"), fix, again=True) as f:
                    ident = _identity(os.fstat(f.fileno()))
                    self._start[i] = ident
                    if self._has_blocks(shard):
                        blocks = self._load_blocks(shard, path)
                        blocks.ok[:] = b"\1" * len(blocks.ok)  # the whole shard just matched
                        _BLOCKS[(ident, shard.get("sha256"))] = blocks

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
        nbytes = shard["tokens"] * self.dtype.itemsize
        n = -(-nbytes // self.block_bytes)
        if len(crcs) != n:
            raise DataError(
                f"block checksum file {crc_path} holds {len(crcs)} checksums but shard {path} has "
                f"{n} blocks of {self.block_bytes} bytes (meta.json is inconsistent): {self._fix}"
            )
        return _ShardBlocks(path, crc_path, crcs, self.block_bytes, self.dtype.itemsize,
                            self._fix, nbytes)

    # --- the open shards: what was checked holds for the file identity it was checked at ------
    def _open(self, i: int) -> int:
        """Shard i's file descriptor, opened on first use, with its checks set up: its block
        checksums (checked per block as windows are read) or, for older data, its whole sha256
        checked now. A file that changed since this object was made is checked as changed.
        Reopened after it was closed (too many open), the checks stay those of the identity
        they hold for: _moved, after the read, finds a file that differs."""
        fd = self._fds[i]
        if fd is not None:
            return fd
        path = self._paths[i]
        if len(self._opened) >= self._max_open:
            old = self._opened.pop(0)
            self._close(old)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise DataChanged(f"shard {path} was deleted while this job was reading it: "
                              f"{_changed_fix(path)}") from None
        if not self._ident[i]:  # the first open in this object
            try:
                ident = _identity(os.fstat(fd))
                self._bind(i, fd, ident, self._change(i, ident))
            except BaseException:
                os.close(fd)
                raise
        self._fds[i] = fd
        self._opened.append(i)
        return fd

    def _close(self, i: int) -> None:
        fd, self._fds[i] = self._fds[i], None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _bind(self, i: int, fd: int, ident: tuple, changed: Optional[str]) -> None:
        """Make shard i's checks those of the file as it is now (`ident`)."""
        shard = self.shards[i]
        if self._has_blocks(shard):
            key = (ident, shard.get("sha256"))
            blocks = _BLOCKS.get(key)
            if blocks is None:
                old = self._blocks[i]
                blocks = (old.again(changed) if old is not None
                          else self._load_blocks(shard, self._paths[i]))
                blocks.changed = changed
                _BLOCKS[key] = blocks
            self._blocks[i] = blocks
        else:
            self._check_sha(i, fd, ident, changed)
        self._ident[i] = ident

    def _change(self, i: int, ident: tuple) -> Optional[str]:
        """How shard i's file differs from when this object was made (None: it does not);
        DataChanged if its size changed."""
        start = self._start[i]
        if ident == start:
            return None
        path, want = self._paths[i], self._nbytes[i]
        if ident[2] != want:
            how = "truncated" if ident[2] < want else "extended"
            raise DataChanged(
                f"shard {path} was {how} while this job was reading it: {ident[2]} bytes now, "
                f"{want} as prepared (meta.json: {self.shards[i]['tokens']} tokens x "
                f"{self.dtype.itemsize}): {_changed_fix(path)}")
        if start and ident[:2] != start[:2]:
            return "replaced by another file of the same size"
        if start and ident[3] == start[3]:
            return f"its inode changed at {_when(ident[4])}, its mtime kept"
        return f"modified {_when(ident[3])}" + (f", {_when(start[3])} when the job opened it"
                                                 if start else "")

    def _check_sha(self, i: int, fd: int, ident: tuple, changed: Optional[str]) -> None:
        """Data prepared before block checksums: the whole shard's sha256, once per process
        and file identity (and again after the file changed)."""
        path, want = self._paths[i], self.shards[i].get("sha256")
        if not want or _VERIFIED.get(ident) == want:
            return
        got = _fd_sha256(fd)
        if got != want:
            if changed is not None:
                raise DataChanged(
                    f"shard {path} was changed while this job was reading it ({changed}): it no "
                    f"longer matches meta.json's sha256 {want} (the file hashes to {got}): "
                    f"{_changed_fix(path)}")
            raise DataError(
                f"shard {path} fails its sha256 check (its contents changed after prepare: "
                f"disk or copy corruption, or an edit): meta.json says {want}, the file "
                f"hashes to {got}: {self._fix} {_verify_hint(path)}")
        _VERIFIED[ident] = got

    def _moved(self, i: int) -> bool:
        """Whether shard i's file changed since its checks were set up (fstat: a write changes
        mtime/ctime before the bytes); if so its checks start over (DataChanged if its size
        changed) and the caller reads again."""
        fd = self._open(i)  # closed meanwhile (too many open): reopened, the path's file now
        ident = _identity(os.fstat(fd))
        if ident == self._ident[i]:
            return False
        changed = self._change(i, ident)
        self._bind(i, fd, ident, changed)
        if changed is not None and (str(self._paths[i]), ident) not in _NOTED_CHANGED:
            _NOTED_CHANGED.add((str(self._paths[i]), ident))
            log.warning("shard %s changed while this job was reading it (%s): its blocks are "
                        "checked again as they are read; changed bytes stop the job",
                        self._paths[i], changed)
        return True

    def _pread(self, i: int, fd: int, lo: int, out: np.ndarray) -> None:
        """Fill `out` (contiguous) with shard i's tokens from offset lo; a short read is a
        truncated file."""
        view = memoryview(out).cast("B")
        size, off, got = len(view), lo * self.dtype.itemsize, 0
        while got < size:
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                self._change(i, _identity(os.fstat(fd)))  # DataChanged if its size changed
                raise DataChanged(
                    f"shard {self._paths[i]} ended at byte {off + got} while this job read "
                    f"bytes {off}-{off + size - 1}: it changed while the job was reading it: "
                    f"{_changed_fix(self._paths[i])}")
            got += n

    def _read(self, s: int, lo: int, hi: int, out: np.ndarray) -> None:
        """tokens[lo:hi] of shard s (offsets in the shard) into `out`, its blocks checked
        first: a block not checked yet is read whole, checked, and the window copied from
        those same bytes."""
        fd = self._open(s)
        blocks = self._blocks[s]
        if blocks is None or blocks.all_ok(lo, hi):
            self._pread(s, fd, lo, out)
            return
        bt = blocks.block_tokens
        a = lo // bt * bt
        span = np.empty(min(((hi - 1) // bt + 1) * bt, int(self.shards[s]["tokens"])) - a,
                        dtype=self.dtype)
        self._pread(s, fd, a, span)
        blocks.check(_Span(span, a), lo, hi)
        out[:] = span[lo - a : hi - a]

    def _gather(self, start: int, stop: int, out: np.ndarray, touched: set) -> None:
        """tokens[start:stop] (global offsets, stop <= len) into `out`, across shards."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        if stop <= self._starts[first + 1]:  # one shard: the common case
            off = int(self._starts[first])
            touched.add(first)
            self._read(first, start - off, stop - off, out)
            return
        last = int(np.searchsorted(self._starts, stop - 1, side="right")) - 1
        for s in range(first, last + 1):
            off, end = int(self._starts[s]), int(self._starts[s + 1])
            a, b = max(start, off), min(stop, end)
            touched.add(s)
            self._read(s, a - off, b - off, out[a - start : b - start])

    def _checked_read(self, fill) -> None:
        """fill(touched) reads; then the files it touched are fstat-ed once each: a file that
        looks as it did when checked was not written to before the fstat, so neither while it
        was read (a write moves mtime/ctime first). One that moved is checked again and the
        read repeated (at most _READS times). A block that fails its first check in a file
        that moved is data changed under the job too (DataChanged), not old corruption."""
        for _ in range(_READS):
            touched: set = set()
            try:
                fill(touched)
            except DataChanged:
                raise
            except DataError:
                moved = [s for s in touched if self._moved(s)]
                if not moved:
                    raise
                continue  # read again, its blocks checked as changed
            moved = [s for s in touched if self._moved(s)]
            if not moved:
                return
        path = self._paths[moved[0]]
        raise DataChanged(f"shard {path} kept changing while this job read it ({_READS} reads "
                          f"in a row): {_changed_fix(path)}")

    def windows(self, starts, length: int) -> np.ndarray:
        """tokens[a : a + length] for each a of `starts`, as the rows of one new array
        (len(starts), length): one read per window, one fstat per shard per call."""
        out = np.empty((len(starts), length), dtype=self.dtype)
        n = len(self)
        for a in starts:
            if not 0 <= a <= n - length:
                raise IndexError(f"window [{a}, {a + length}) out of range for {n} tokens")

        def fill(touched: set) -> None:
            for r, a in enumerate(starts):
                self._gather(int(a), int(a) + length, out[r], touched)

        self._checked_read(fill)
        return out

    def close(self) -> None:
        """Close the open shards (also on garbage collection)."""
        for i in range(len(getattr(self, "_fds", ()))):
            self._close(i)
        self._opened = []

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        n = len(self.shards)
        state["_fds"], state["_ident"], state["_blocks"] = [None] * n, [()] * n, [None] * n
        state["_opened"] = []
        return state

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, idx: Union[int, slice]) -> np.ndarray:
        """tokens[i] -> int; tokens[a:b] -> a new array (read, checked, unchanged after)."""
        n = len(self)
        if isinstance(idx, (int, np.integer)):
            i = int(idx) + n if idx < 0 else int(idx)
            if not 0 <= i < n:
                raise IndexError(f"token index {idx} out of range for {n} tokens")
            return self[i : i + 1][0]
        if not isinstance(idx, slice):
            raise TypeError(f"PackedTokens indices must be int or slice, not {type(idx).__name__}")
        start, stop, step = idx.indices(n)
        if step != 1:
            raise ValueError("PackedTokens slices must have step 1")
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        if stop > start:
            self._checked_read(lambda touched: self._gather(start, stop, out, touched))
        return out

    def __repr__(self) -> str:
        return f"PackedTokens({str(self.dir)!r}, split={self.split!r}, tokens={len(self)}, dtype={self.dtype})"
