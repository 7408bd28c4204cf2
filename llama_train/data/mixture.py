"""Weighted mixtures of sources (``data.mixture``): one tokenizer, each source's own shards, and a
training stream that draws windows from the sources in proportion to their weights.

Layout of a prepared mixture (``<cache>/mixture-<hash>/``):

    tokenizer.model    one SentencePiece model for every source (given, or trained on the
                       sources' text in proportion to the weights)
    meta.json          format "llama_train.mixture": the entries, their weights and the prepared
                       directory of each source (ordinary prepared data, see prepare.py)

prepare.prepare_data hands a mixture to :func:`prepare_mixture` together with itself, which
prepares each source: this module never imports prepare.py (data.mixture's entries and their
checks are config.py's).

A source's shards depend only on the source and the tokenizer, so any mixture with the same
tokenizer (``data.tokenizer``) reuses them.

The stream (:class:`Allocation`): global sample k goes to one source by a binary tree over the
sources; a node with weights A (left) and T (both) sends its j-th sample left iff
``floor(((j+1) A + C) / T) > floor((j A + C) / T)`` (C from the seed). After n samples a node has
sent exactly ``floor((n A + C) / T)`` left, so every source is within a window or two of its share
at every point of the stream (a random draw would be off by ~sqrt(n)), and which source and which
of its windows a sample reads is a closed form of k: the stream does not depend on world size or
micro-batch, resumes at any sample without replay, and each source runs its own epochs of its own
shuffle (loader._Windows).
"""

from __future__ import annotations

import hashlib
import json
import re
import logging
import os
import shutil
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np

from .config import DataConfig, MixtureEntry, as_entries, check_entries
from .errors import DataError
from .meta import PreparedData, resolve_dtype, tokenizer_settings
from .sources import open_source
from .tokenizer import train_tokenizer
from llama_train.util import splitmix64

log = logging.getLogger(__name__)

MIXTURE_FORMAT = "llama_train.mixture"
MIXTURE_VERSION = 1
_WEIGHT_BITS = 24  # weights are quantized to integers summing to ~2**24 (exact integer stream)


# --- the stream -------------------------------------------------------------------------------
def quantize(weights: Sequence[float]) -> List[int]:
    """Relative weights -> integers (a positive weight never becomes 0)."""
    total = float(sum(weights))
    return [0 if w <= 0 else max(1, round(w / total * (1 << _WEIGHT_BITS))) for w in weights]


class Allocation:
    """Global sample k -> (source, that source's k-th sample), in closed form (module doc)."""

    def __init__(self, weights: Sequence[float], seed: int):
        self.w = quantize(weights)
        self.seed = int(seed)

    def _node(self, lo: int, hi: int):
        mid = (lo + hi) // 2
        a, t = sum(self.w[lo:mid]), sum(self.w[lo:hi])
        c = splitmix64(self.seed * 1_000_003 + lo * 1009 + hi) % t if t else 0
        return mid, a, t, c

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, index within the source) of each global sample id."""
        j = np.asarray(samples, dtype=np.int64)
        src = np.zeros_like(j)
        idx = j.copy()
        self._assign(0, len(self.w), np.arange(j.size), idx, src)
        return src, idx

    def _assign(self, lo: int, hi: int, sel: np.ndarray, idx: np.ndarray, src: np.ndarray):
        if hi - lo == 1 or sel.size == 0:
            src[sel] = lo
            return
        mid, a, t, c = self._node(lo, hi)
        j = idx[sel]
        before = (j * a + c) // t  # samples this node sent left before its j-th
        left = ((j + 1) * a + c) // t > before
        idx[sel] = np.where(left, before, j - before)
        self._assign(lo, mid, sel[left], idx, src)
        self._assign(mid, hi, sel[~left], idx, src)

    def counts(self, n: int) -> List[int]:
        """How many of the first ``n`` global samples each source got."""
        out = [0] * len(self.w)
        self._counts(0, len(self.w), int(n), out)
        return out

    def _counts(self, lo: int, hi: int, n: int, out: List[int]) -> None:
        if hi - lo == 1:
            out[lo] = n
            return
        mid, a, t, c = self._node(lo, hi)
        left = (n * a + c) // t  # c < t: floor(c / t) = 0
        self._counts(lo, mid, left, out)
        self._counts(mid, hi, n - left, out)


def source_seed(seed: int, name: str) -> int:
    """Each source's own shuffle (so adding a source does not reshuffle the others)."""
    return splitmix64(int(seed) ^ (zlib.crc32(name.encode()) << 20)) & ((1 << 62) - 1)


# --- preparation ------------------------------------------------------------------------------
def is_mixture(prepared_dir: Any) -> bool:
    return read_mixture_meta(prepared_dir) is not None


def read_mixture_meta(prepared_dir: Any) -> Optional[dict]:
    """A prepared mixture's meta.json, or None if ``prepared_dir`` is ordinary prepared data."""
    path = Path(prepared_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if meta.get("format") == MIXTURE_FORMAT else None


def _entry_cfg(cfg, e: MixtureEntry, tokenizer: Optional[str]):
    """The data config that prepares one entry: the mixture's settings, the entry's source."""
    return replace(cfg, mixture=[], name=e.name, source=e.source, prepared_dir=None,
                   tokenizer=tokenizer,
                   text_column=e.text_column if e.text_column is not None else cfg.text_column,
                   hub_config=e.hub_config if e.hub_config is not None else cfg.hub_config,
                   split=e.split if e.split is not None else cfg.split)


# The keys a mixture entry sets for itself: an error about one names the entry's key, which is
# the one to change (data.text_column was advised where data.mixture.1.text_column was meant).
_ENTRY_KEYS = re.compile(r"\bdata\.(source|text_column|hub_config|split)\b")


def _named(i: int, e: MixtureEntry, err: DataError) -> DataError:
    msg = _ENTRY_KEYS.sub(lambda m: f"data.mixture.{i}.{m.group(1)}", str(err))
    return DataError(f"data.mixture[{i}] ({e.name}, source={e.source!r}): {msg}")


def _mixture_target(cfg, entries: List[MixtureEntry], vocab_size: Optional[int]):
    """(settings, fingerprint, directory, sources) of the mixture: decided before reading text."""
    sources = []
    for i, e in enumerate(entries):
        try:
            sources.append(open_source(_entry_cfg(cfg, e, None)))
        except DataError as err:
            raise _named(i, e, err) from None
    vocab_size, tok_settings = tokenizer_settings(cfg, vocab_size)
    if cfg.tokenizer is None:
        tok_settings = {**tok_settings, "seed": cfg.seed,
                        "trained_on": "the mixture, in proportion to the weights"}
    settings = {
        "format_version": MIXTURE_VERSION,
        "entries": [{"name": e.name, "weight": float(e.weight), "source": s.describe()}
                    for e, s in zip(entries, sources)],
        "tokenizer": tok_settings,
        "dtype": resolve_dtype(cfg.dtype, int(vocab_size)),
        "val_fraction": cfg.val_fraction,
        "add_bos": cfg.add_bos,
    }
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    if cfg.prepared_dir:
        final = Path(cfg.prepared_dir).expanduser()
    else:
        from llama_train.paths import cache_dir

        final = cache_dir() / f"{cfg.name or 'mixture'}-{fingerprint[:10]}"
    return settings, fingerprint, final.absolute(), sources, int(vocab_size)


def find_prepared_mixture(cfg, vocab_size: Optional[int]):
    """The prepared mixture if it is complete, else None (reads meta.json files only)."""
    entries = as_entries(cfg.mixture)
    _, fingerprint, final, _, _ = _mixture_target(cfg, entries, vocab_size)
    meta = _complete(final, fingerprint)
    if meta is None:
        return None
    return PreparedData(dir=str(final), tokenizer_path=str(final / "tokenizer.model"), meta=meta)


def _complete(final: Path, fingerprint: str) -> Optional[dict]:
    """The meta of the prepared mixture at ``final`` if it is this one and every source's data
    is there, else None."""
    meta = read_mixture_meta(final)
    if meta is None or meta.get("fingerprint") != fingerprint:
        return None
    if not all((Path(s["dir"]) / "meta.json").is_file() for s in meta["sources"]):
        return None
    return meta


def prepare_mixture(cfg: DataConfig, vocab_size: Optional[int],
                    prepare_source: Callable[[DataConfig, Optional[int]], PreparedData]
                    ) -> PreparedData:
    """Prepare every source of ``cfg.mixture`` with one tokenizer (each by ``prepare_source``,
    i.e. prepare.prepare_data of the source's own config), and the mixture's meta.json
    (PreparedData whose ``dir`` the loaders read). Safe from every rank at once (a file lock)."""
    from filelock import FileLock

    entries = as_entries(cfg.mixture)
    check_entries(entries)
    settings, fingerprint, final, sources, vocab_size = _mixture_target(cfg, entries, vocab_size)
    meta = _complete(final, fingerprint)
    if meta is not None:
        return PreparedData(dir=str(final), tokenizer_path=str(final / "tokenizer.model"),
                            meta=meta, created=False)
    final.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        old = read_mixture_meta(final)
        if old is not None and old.get("fingerprint") != fingerprint:
            raise DataError(f"refusing to use {final}: it holds another mixture (other sources, "
                            f"weights or tokenizer). Set data.prepared_dir to a new directory "
                            f"(or null), or delete it")
        tok_path = final / "tokenizer.model"
        if cfg.tokenizer is not None:
            shutil.copyfile(cfg.tokenizer, tok_path)
        elif old is None or not tok_path.is_file():
            _train_mixture_tokenizer(cfg, entries, sources, vocab_size, final)
        parts = []
        for i, e in enumerate(entries):
            try:
                p = prepare_source(_entry_cfg(cfg, e, str(tok_path)), vocab_size)
            except DataError as err:
                raise _named(i, e, err) from None
            parts.append((e, p))
        meta = _mixture_meta(settings, fingerprint, parts, vocab_size)
        tmp = final / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, final / "meta.json")
    log.info("mixture %s (tokenizer %s): %s", final, tok_path, ", ".join(
        f"{s['name']} (weight {s['weight']:g}, {s['train_tokens']:,} train tokens)"
        for s in meta["sources"]))
    return PreparedData(dir=str(final), tokenizer_path=str(tok_path), meta=meta, created=True)


def _mixture_meta(settings: dict, fingerprint: str, parts, vocab_size: int) -> dict:
    first = parts[0][1].meta
    splits = {}
    for split in ("train", "val"):
        splits[split] = {"tokens": sum(p.meta["splits"][split]["tokens"] for _, p in parts),
                         "documents": sum(p.meta["splits"][split]["documents"] for _, p in parts),
                         "shards": []}
    stream = hashlib.sha256(json.dumps(
        [[e.name, float(e.weight), p.meta["splits"]["train"].get("sha256") or p.meta["fingerprint"]]
         for e, p in parts]).encode()).hexdigest()
    return {
        "format": MIXTURE_FORMAT,
        "version": MIXTURE_VERSION,
        "fingerprint": fingerprint,
        "stream_fingerprint": stream,  # the training stream's identity (resume checks it)
        "settings": settings,
        "vocab_size": vocab_size,
        "dtype": first["dtype"],
        "add_bos": first["add_bos"],
        "tokenizer": {**first["tokenizer"], "file": "tokenizer.model"},
        "sources": [{"name": e.name, "weight": float(e.weight), "dir": p.dir,
                     "train_tokens": p.meta["splits"]["train"]["tokens"],
                     "val_tokens": p.meta["splits"]["val"]["tokens"]} for e, p in parts],
        "splits": splits,
    }


def weighted_texts(entries: Sequence[MixtureEntry], sources, max_lines: int) -> Iterator[str]:
    """The sources' documents interleaved so that each contributes characters in proportion to
    its weight (the next document comes from the source furthest below its share); a source that
    runs out starts again. Ends once every weighted source was read through at least once, or
    after ``max_lines`` lines. A weighted source with no text at all is refused, named."""
    live = [i for i, e in enumerate(entries) if float(e.weight) > 0]
    its = {i: iter(sources[i].iter_texts()) for i in live}
    chars = {i: 0 for i in live}
    done, lines = set(), 0
    while len(done) < len(live) and lines < max_lines:
        i = min(live, key=lambda k: (chars[k] / float(entries[k].weight), k))
        try:
            text = next(its[i])
        except DataError as err:  # e.g. its text column is missing: name the entry and its key
            raise _named(i, entries[i], err) from None
        except StopIteration:
            if chars[i] == 0:
                e = entries[i]
                raise DataError(f"data.mixture[{i}] ({e.name}, source={e.source!r}) has no text "
                                f"(no documents, or only empty ones in column "
                                f"{e.text_column or sources[i].cfg.text_column!r})") from None
            done.add(i)
            its[i] = iter(sources[i].iter_texts())
            continue
        if not text.strip():
            continue
        chars[i] += len(text) + 1
        lines += text.count("\n") + 1
        yield text


def _train_mixture_tokenizer(cfg, entries, sources, vocab_size: int, out: Path) -> None:
    log.info("training a %d-piece tokenizer on the mixture (%s)", vocab_size,
             ", ".join(f"{e.name} {float(e.weight):g}" for e in entries))
    limit = cfg.tokenizer_max_sentences or 1_000_000
    train_tokenizer(weighted_texts(entries, sources, limit), vocab_size, out / "tokenizer",
                    max_sentences=cfg.tokenizer_max_sentences, seed=cfg.seed,
                    max_line_bytes=cfg.tokenizer_max_line_bytes, source="data.mixture",
                    where=lambda doc, i: f"line {i} of the mixture's document {doc}")
