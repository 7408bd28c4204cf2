"""PackedTokens: one split of a prepared directory as a single memory-mapped token array."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np

from .errors import DataError
from .meta import read_meta
from .tokenizer import file_sha256


class PackedTokens:
    """The shards of `split`, validated against meta.json, sliceable across shard boundaries.

    Validation on open: every shard exists and has exactly tokens x itemsize bytes (a truncated
    copy fails here, naming the file); with verify=True also its sha256 (reads everything).
    The memmaps are opened lazily and dropped on pickling, so a DataLoader worker maps the files
    itself instead of receiving a copy of their contents.
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
        self._validate(verify)
        sizes = np.array([s["tokens"] for s in self.shards], dtype=np.int64)
        # _starts[i] = index of the first token of shard i; _starts[-1] = total
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._maps: list[np.memmap] | None = None

    def _validate(self, verify: bool) -> None:
        fix = f"delete {self.dir} and run prepare again"
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
            if verify and file_sha256(path) != shard["sha256"]:
                raise DataError(f"shard {path} fails its sha256 check (contents changed): {fix}")

    def _mmaps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [
                np.memmap(self.dir / s["file"], dtype=self.dtype, mode="r", shape=(s["tokens"],))
                for s in self.shards
            ]
        return self._maps

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = None
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
            return self._mmaps()[s][i - self._starts[s]]
        if not isinstance(idx, slice):
            raise TypeError(f"PackedTokens indices must be int or slice, not {type(idx).__name__}")
        start, stop, step = idx.indices(n)
        if step != 1:
            raise ValueError("PackedTokens slices must have step 1")
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        maps = self._mmaps()
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, stop - 1, side="right")) - 1
        if first == last:
            off = self._starts[first]
            return maps[first][start - off : stop - off]
        parts = []
        for s in range(first, last + 1):
            off = self._starts[s]
            parts.append(maps[s][max(start, off) - off : min(stop, self._starts[s + 1]) - off])
        return np.concatenate(parts)

    def __repr__(self) -> str:
        return f"PackedTokens({str(self.dir)!r}, split={self.split!r}, tokens={len(self)}, dtype={self.dtype})"
