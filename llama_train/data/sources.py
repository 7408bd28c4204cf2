"""Reading documents from a source: the built-in corpus, local files, or the HF hub.

Every source becomes a `Source`: a deterministic, re-iterable stream of text batches, plus a
`describe()` dict that goes into the fingerprint and meta.json. Local files and hub datasets are
read through HF `datasets` (the json / text / parquet builders, or `load_dataset(name)`).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .config import DataConfig
from .corpus import builtin_corpus, corpus_id
from .errors import DataError

log = logging.getLogger(__name__)

# File suffix -> datasets builder. ".json" is read by the json builder (JSON lines or an array).
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_GLOB_CHARS = set("*?[")
BATCH_DOCS = 1000


def _suffix(path: str) -> str:
    return Path(path).suffix.lower()


def _looks_local(source: str) -> bool:
    """A source that is meant as a path even though nothing exists there (so: error, not hub)."""
    return (
        source.startswith(("/", "./", "../", "~", "."))
        or bool(_GLOB_CHARS & set(source))
        or _suffix(source) in BUILDERS
        or os.sep in source and source.count("/") > 1
    )


def resolve_local_files(source: str) -> list[str]:
    """The sorted list of data files a local source names (file, directory or glob)."""
    expanded = os.path.expanduser(source)
    if os.path.isdir(expanded):
        files = [
            str(p) for p in sorted(Path(expanded).rglob("*")) if p.is_file() and p.suffix.lower() in BUILDERS
        ]
        where = f"directory {source!r}"
    elif _GLOB_CHARS & set(expanded):
        files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
        where = f"glob {source!r}"
    elif os.path.isfile(expanded):
        files = [expanded]
        where = f"file {source!r}"
    else:
        raise DataError(
            f"data.source={source!r}: no such file or directory. Set data.source to 'builtin', "
            "a Hugging Face hub dataset name, or an existing .txt/.jsonl/.json/.parquet file, "
            "directory or glob"
        )
    if not files:
        raise DataError(
            f"data.source {where} matched no data files (supported: {', '.join(sorted(BUILDERS))})"
        )
    bad = sorted({_suffix(f) for f in files} - set(BUILDERS))
    if bad:
        raise DataError(
            f"data.source {where} contains files with unsupported suffix(es) {bad}; "
            f"supported: {', '.join(sorted(BUILDERS))}"
        )
    builders = {BUILDERS[_suffix(f)] for f in files}
    if len(builders) > 1:
        raise DataError(
            f"data.source {where} mixes file kinds {sorted(builders)}; point it at one kind of file"
        )
    return [os.path.abspath(f) for f in files]


@dataclass
class Source:
    """A deterministic stream of documents (str) read in batches."""

    kind: str  # builtin | local | hub
    cfg: DataConfig
    files: list[str] = field(default_factory=list)
    _dataset: Any = None

    def describe(self) -> dict:
        """What identifies the documents: part of the fingerprint and of meta.json."""
        d: dict[str, Any] = {"kind": self.kind, "source": self.cfg.source}
        if self.kind == "builtin":
            d["corpus"] = corpus_id()
        elif self.kind == "local":
            d["text_column"] = self.cfg.text_column
            d["files"] = [
                {"path": f, "bytes": os.path.getsize(f), "mtime_ns": os.stat(f).st_mtime_ns}
                for f in self.files
            ]
            if BUILDERS[_suffix(self.files[0])] == "text":
                d["text_sample_by"] = self.cfg.text_sample_by
        else:
            d.update(hub_config=self.cfg.hub_config, split=self.cfg.split, text_column=self.cfg.text_column)
        if self.cfg.max_documents is not None:
            d["max_documents"] = self.cfg.max_documents
        return d

    def num_documents(self) -> Optional[int]:
        """Known document count (for the progress bar), None when streaming."""
        if self.kind == "builtin":
            n = len(builtin_corpus())
        else:
            try:
                n = len(self.dataset())
            except TypeError:  # IterableDataset
                return None
        return min(n, self.cfg.max_documents) if self.cfg.max_documents else n

    def approx_bytes(self) -> Optional[int]:
        """Rough size of the text (to decide whether worker processes pay off); None if unknown."""
        if self.kind == "builtin":
            return sum(len(d) for d in builtin_corpus())
        if self.kind == "local":
            return sum(os.path.getsize(f) for f in self.files)
        return None

    # --- loading ---------------------------------------------------------------------------
    def dataset(self):
        """The HF dataset (Dataset or IterableDataset) with the text column checked."""
        if self._dataset is None:
            self._dataset = self._load()
        return self._dataset

    def _load(self):
        import datasets

        cfg = self.cfg
        if self.kind == "local":
            builder = BUILDERS[_suffix(self.files[0])]
            kwargs: dict[str, Any] = {}
            if builder == "text":
                kwargs["sample_by"] = cfg.text_sample_by
                # line mode: the newline is replaced by the EOS every document gets; blank
                # lines become empty documents (counted and skipped)
                kwargs["keep_linebreaks"] = False
            what = f"local {builder} files from data.source={cfg.source!r}"
            empty = DataError(f"{what} hold no documents (the files are empty)")
            if all(os.path.getsize(f) == 0 for f in self.files):
                raise empty
            try:
                ds = datasets.load_dataset(
                    builder, data_files=self.files, split="train", streaming=cfg.streaming, **kwargs
                )
            except StopIteration as e:  # what the json builder raises on a file with no rows
                raise empty from e
            except Exception as e:
                raise DataError(f"could not read {what}: {type(e).__name__}: {e}") from e
        else:
            what = f"hub dataset {cfg.source!r} (hub_config={cfg.hub_config!r}, split={cfg.split!r})"
            log.info("loading %s via datasets.load_dataset (set HF_HUB_OFFLINE=1 to fail fast offline)", what)
            try:
                ds = datasets.load_dataset(
                    cfg.source, cfg.hub_config, split=cfg.split, streaming=cfg.streaming
                )
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise DataError(
                    f"could not load {what} with datasets.load_dataset: {type(e).__name__}: {first}. "
                    "Either the Hugging Face hub is unreachable (offline / no network: pre-download "
                    "it into the HF cache, or copy the files and set data.source to the local "
                    "path) or the name, hub_config or split is wrong."
                ) from e
        self._check_column(ds, what)
        return ds.select_columns([cfg.text_column])

    def _check_column(self, ds, what: str) -> None:
        col = self.cfg.text_column
        names = ds.column_names
        if names is None:  # streaming without known features: look at the first row
            first = next(iter(ds), None)
            if first is None:
                raise DataError(f"{what} has no documents")
            names = list(first)
        if col not in names:
            raise DataError(
                f"data.text_column={col!r} is not a column of {what}; available columns: "
                f"{', '.join(map(str, names))}. Set data.text_column to one of them."
            )

    # --- iteration -------------------------------------------------------------------------
    def iter_batches(self, batch_docs: Optional[int] = None) -> Iterator[list[str]]:
        """Batches of documents in source order, at most cfg.max_documents in all.

        None values (missing text) are passed on as "" so they are counted as empty documents;
        a non-string value is an error naming the column.
        """
        batch_docs = batch_docs or BATCH_DOCS
        limit = self.cfg.max_documents
        seen = 0
        if self.kind == "builtin":
            batches: Any = (
                builtin_corpus()[i : i + batch_docs] for i in range(0, len(builtin_corpus()), batch_docs)
            )
        else:
            col = self.cfg.text_column
            batches = (b[col] for b in self.dataset().iter(batch_size=batch_docs))
        for batch in batches:
            texts = []
            for t in batch:
                if t is None:
                    t = ""
                elif not isinstance(t, str):
                    raise DataError(
                        f"data.text_column={self.cfg.text_column!r} of data.source={self.cfg.source!r} "
                        f"holds {type(t).__name__} values, not text; pick a string column"
                    )
                texts.append(t)
            if limit is not None and seen + len(texts) > limit:
                texts = texts[: limit - seen]
            seen += len(texts)
            if texts:
                yield texts
            if limit is not None and seen >= limit:
                return

    def iter_texts(self) -> Iterator[str]:
        for batch in self.iter_batches():
            yield from batch


def open_source(cfg: DataConfig) -> Source:
    """Decide what kind of source `cfg.source` is (no data is read yet, no network touched)."""
    src = cfg.source
    if src == "builtin":
        return Source("builtin", cfg)
    expanded = os.path.expanduser(src)
    if os.path.exists(expanded) or (_GLOB_CHARS & set(src) and glob.glob(expanded)) or _looks_local(src):
        return Source("local", cfg, files=resolve_local_files(src))
    return Source("hub", cfg)
