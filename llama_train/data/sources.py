"""Reading documents from a source: the built-in corpus, local files, or the HF hub.

Every source becomes a `Source`: a deterministic, re-iterable stream of text batches, plus a
`describe()` dict that goes into the fingerprint and meta.json. Local files and hub datasets are
read through HF `datasets` (the json / text / parquet builders, or `load_dataset(name)`).
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .config import DataConfig
from .corpus import BUILTIN_CORPORA, corpus_id, named_corpus
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

    kind: str  # builtin (data.source builtin or stdlib) | local | hub
    cfg: DataConfig
    files: list[str] = field(default_factory=list)
    _dataset: Any = None
    _rows: Any = None  # _JsonRowCursor, made on the first null text of a JSON source

    @property
    def name(self) -> str:
        """``data.name``, else one from the source: the prefix of its prepared directory."""
        if self.cfg.name:
            return self.cfg.name
        if self.kind == "builtin":
            return self.cfg.source  # builtin | stdlib
        if self.kind != "hub":
            return self.kind  # local
        return re.sub(r"[^a-z0-9_.-]+", "_", self.cfg.source.rsplit("/", 1)[-1].lower()) or "hub"

    def describe(self) -> dict:
        """What identifies the documents: part of the fingerprint and of meta.json."""
        d: dict[str, Any] = {"kind": self.kind, "source": self.cfg.source}
        if self.kind == "builtin":
            d["corpus"] = corpus_id(self.cfg.source)  # its text's digest, not the Python version
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
            n = len(named_corpus(self.cfg.source))
        else:
            try:
                n = len(self.dataset())
            except TypeError:  # IterableDataset
                return None
        return min(n, self.cfg.max_documents) if self.cfg.max_documents else n

    def approx_bytes(self) -> Optional[int]:
        """Rough size of the text (to decide whether worker processes pay off); None if unknown."""
        if self.kind == "builtin":
            return sum(len(d) for d in named_corpus(self.cfg.source))
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
            if builder == "json":
                _quiet_json_builder()
            try:
                ds = datasets.load_dataset(
                    builder, data_files=self.files, split="train", streaming=cfg.streaming, **kwargs
                )
            except StopIteration as e:  # what the json builder raises on a file with no rows
                raise empty from e
            except Exception as e:
                raise self._read_error(e) from e
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
        try:
            self._check_column(ds, what)
        except DataError:
            raise
        except Exception as e:  # streaming: the first row is read here
            raise self._read_error(e) from e
        return ds.select_columns([cfg.text_column])

    def _read_error(self, e: BaseException) -> DataError:
        """A reader's failure as a DataError naming the file (line, byte) at fault and the fix.

        The HF builders say only "An error occurred while generating the dataset", so on this
        error path (never on the normal one) the local files are scanned in the order the
        builder reads them, for the first one that is not UTF-8, not JSON lines, or lacks the
        text column. Without a culprit the message carries the innermost cause instead.
        """
        cfg = self.cfg
        if self.kind == "local":
            builder = BUILDERS[_suffix(self.files[0])]
            found = find_unreadable(self.files, builder, cfg.text_column, cast_error=_is_cast_error(e))
            if found is not None:
                return DataError(f"data.source={cfg.source!r}: {found}")
            what = f"local {builder} files from data.source={cfg.source!r}"
        else:
            what = f"hub dataset {cfg.source!r} (hub_config={cfg.hub_config!r}, split={cfg.split!r})"
        root = _root_cause(e)
        detail = " ".join(str(root).split())[:300]  # one line: the builders' messages span several
        if self.kind == "local":
            fix = "check that every file is readable and holds what its suffix says"
        else:
            fix = "check the dataset's files, or copy them and set data.source to the local path"
        return DataError(f"could not read {what}: {type(root).__name__}: {detail}. {fix}")

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

        A null text (JSON null, a parquet/Arrow null) is passed on as "" so it is counted as an
        empty document and skipped; a JSON row without the text column at all is an error naming
        the file and line (the reader fills it with null too, see `_check_null`); a non-string
        value is an error naming the column.
        """
        batch_docs = batch_docs or BATCH_DOCS
        limit = self.cfg.max_documents
        seen = 0
        if self.kind == "builtin":
            docs = named_corpus(self.cfg.source)
            batches: Any = (docs[i : i + batch_docs] for i in range(0, len(docs), batch_docs))
        else:
            batches = self._dataset_batches(batch_docs)
        for batch in batches:
            texts = []
            for i, t in enumerate(batch):
                if t is None:
                    self._check_null(seen + i)
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

    def _dataset_batches(self, batch_docs: int) -> Iterator[list]:
        """The text column in batches; a streamed reader's failure becomes `_read_error`'s."""
        col = self.cfg.text_column
        try:
            for b in self.dataset().iter(batch_size=batch_docs):
                yield b[col]
        except DataError:
            raise
        except Exception as e:
            raise self._read_error(e) from e

    def _check_null(self, row: int) -> None:
        """Row `row` (0-based, in reading order) has a null text: an error if the row of a JSON
        file lacks the text column altogether.

        The json builder gives a missing key and an explicit null the same null, so only the raw
        line can tell them apart. Rows are found by a forward-only cursor over the files (null
        rows come in increasing order), so all the null rows of a source cost one extra pass
        over the files up to the last of them, parsing only those rows; sources without nulls
        pay nothing.
        """
        if self.kind != "local" or BUILDERS[_suffix(self.files[0])] != "json":
            return
        if self._rows is None:
            self._rows = _JsonRowCursor(self.files)
        # A second pass over the source (tokenizer training, then encoding) asks again for rows
        # the cursor has passed: those were checked by the first pass, and seek says None.
        found = self._rows.seek(row)
        if found is None:
            return  # checked already, or not lined up with the reader's rows: a null (never guess)
        path, where, value = found
        col = self.cfg.text_column
        if isinstance(value, dict) and col not in value:
            missing = _missing_column(path, where, col, value)
            raise DataError(f"data.source={self.cfg.source!r}: {missing}")

    def iter_texts(self) -> Iterator[str]:
        for batch in self.iter_batches():
            yield from batch


# --- diagnosing unreadable local files (error paths only) ----------------------------------------
_SCAN_BLOCK = 1 << 20
_HOW_TO_FIX_ENCODING = (
    "data.source must be UTF-8 text: convert the file (e.g. iconv -f latin1 -t utf-8) or, if it "
    "is a binary or compressed file, remove it from data.source (or narrow the glob)"
)


def _chain(e: BaseException) -> Iterator[BaseException]:
    """`e` and its causes, outermost first."""
    seen: set = set()
    x: Optional[BaseException] = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        yield x
        x = x.__cause__ or x.__context__


def _root_cause(e: BaseException) -> BaseException:
    *_, root = _chain(e)
    return root


def _is_cast_error(e: BaseException) -> bool:
    return any(type(x).__name__ == "CastError" for x in _chain(e))


def first_non_utf8(path: str) -> Optional[tuple[int, int, str]]:
    """(byte offset, line, reason) of the first byte sequence of `path` that is not UTF-8, or
    None. Reads the file in 1 MB blocks with an incremental decoder (bounded memory)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    pos = 0  # bytes handed to the decoder so far
    lines = 0  # newlines in the bytes the decoder has fully consumed
    with open(path, "rb") as f:
        while True:
            block = f.read(_SCAN_BLOCK)
            pending = dec.getstate()[0]  # an incomplete sequence held back from the last block
            try:
                dec.decode(block, final=not block)
            except UnicodeDecodeError as err:
                seen = (pending + block)[: err.start]
                return pos - len(pending) + err.start, lines + seen.count(b"\n") + 1, err.reason
            lines += block.count(b"\n")
            if not block:
                return None
            pos += len(block)


def _missing_column(path: str, where: str, column: str, row: dict) -> str:
    return (
        f"{path} {where} has no {column!r} key (data.text_column={column!r}; its keys: "
        f"{', '.join(map(str, row)) or 'none'}). Every row needs the text column: add it (null "
        "or \"\" for an empty document, which is skipped), remove the row, or set data.text_column"
    )


def _json_rows(path: str) -> Iterator[tuple[str, Any]]:
    """(where, raw) for each row the json builder makes of `path`, in its order: the elements
    of a file that is one JSON array ("element k", already parsed; a string element is the
    builder's {"text": s}), else each non-blank line ("line n", its bytes, parsed by
    `_parse_row` only where needed). Raises _BadJson for a '['-file that is not one array."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(codecs.BOM_UTF8):
        head = head[len(codecs.BOM_UTF8):]
    if head.startswith(b"["):
        try:
            with open(path, "rb") as f:
                doc = json.load(f)
        except ValueError as err:
            raise _BadJson("(a JSON array)", str(err)) from None
        if not isinstance(doc, list):
            raise _BadJson("(a JSON array)", "not an array")
        for k, r in enumerate(doc):
            yield f"element {k}", {"text": r} if isinstance(r, str) else r
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield f"line {n}", raw


def _parse_row(raw: Any) -> Any:
    return json.loads(raw) if isinstance(raw, bytes) else raw


class _SameErrorWeName(logging.Filter):
    """Drops the json builder's "Failed to load JSON from file ..." record: the reader's
    failure reaches us as an exception, and :meth:`Source._read_error` names the file and line
    in one line; the builder's own line said it a second time (twice, with its handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load JSON from file")


def _quiet_json_builder() -> None:
    lg = logging.getLogger("datasets.packaged_modules.json.json")
    if not any(isinstance(f, _SameErrorWeName) for f in lg.filters):
        lg.addFilter(_SameErrorWeName())


def _lone_surrogate(value: Any, key: str = "") -> Optional[str]:
    """Where a parsed JSON row holds a lone surrogate: an escape such as ``\\ud800`` (half of
    a UTF-16 pair) without its other half. Valid JSON to Python, but no UTF-8 text can hold it,
    so Arrow's reader refuses the whole file ("The surrogate pair in string is invalid")."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            where = f" of its {key!r} value" if key else ""
            return (f"\\u{ord(value[err.start]):04x} at character {err.start}{where}")
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _lone_surrogate(k, "") or _lone_surrogate(v, str(k))
            if found:
                return found
    elif isinstance(value, list):
        for v in value:
            found = _lone_surrogate(v, key)
            if found:
                return found
    return None


class _BadJson(ValueError):
    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def _json_problem(path: str, column: str, keys: Optional[set]) -> Optional[str]:
    """What the json builder would stumble on in a UTF-8 file: a line that is not JSON, a row
    that is not an object or lacks `column`, or (`keys` given) a column the first file lacks."""
    try:
        for where, raw in _json_rows(path):
            try:
                row = _parse_row(raw)
            except ValueError as err:
                raise _BadJson(where, str(err)) from None
            lone = _lone_surrogate(row)
            if lone is not None:
                return (f"{path} {where} holds a lone surrogate ({lone}): half of a UTF-16 "
                        f"pair without its other half, which no UTF-8 text can hold, so the "
                        f"JSON reader refuses the file. Fix or remove that line (replace the "
                        f"escape, e.g. with \\ufffd, or write the file again from the "
                        f"original text)")
            if not isinstance(row, dict):
                return (f"{path} {where} is a JSON {type(row).__name__}, not an object: every row "
                        f"must be an object with a {column!r} key")
            if column not in row:
                return _missing_column(path, where, column, row)
            if keys is not None and not set(row) <= keys:
                return (f"{path} {where} has column(s) {sorted(set(row) - keys)} that the first "
                        "file does not have; the json reader needs the same columns in every "
                        "file: drop them, or prepare the files separately")
    except _BadJson as bad:
        return (f"{path} {bad.where} is not valid JSON ({bad.reason}). Each line of a JSON-lines "
                "file must be one JSON object: fix or remove that line")
    return None


def find_unreadable(
    files: list[str], builder: str, column: str, cast_error: bool = False
) -> Optional[str]:
    """The first file the HF builder cannot read, and why; None if all look fine. Only called
    after a read failed: it reads the files again. First every file for bytes that are not
    UTF-8 (~1 GB/s), then, for JSON, every row in Python (~50 MB/s): a bad line, a row that is
    not an object or lacks the column, a column the first file lacks (`cast_error`)."""
    if builder in ("text", "json"):
        for path in files:
            bad = first_non_utf8(path)
            if bad is not None:
                off, line, reason = bad
                return (f"{path} is not UTF-8 text (byte {off}, line {line}: {reason}). "
                        f"{_HOW_TO_FIX_ENCODING}")
    if builder == "json":
        first_keys: Optional[set] = None
        for i, path in enumerate(files):
            problem = _json_problem(path, column, first_keys if i else None)
            if problem is not None:
                return problem
            if cast_error and i == 0:  # the builder takes its columns from the first file
                first_keys = set().union(*(_parse_row(raw) for _, raw in _json_rows(path)))
    elif builder == "parquet":
        import pyarrow.parquet as pq

        for path in files:
            try:
                pq.ParquetFile(path).metadata
            except Exception as err:
                return (f"{path} is not a readable parquet file ({type(err).__name__}: {err}): "
                        "remove it from data.source or write it again")
    return None


class _JsonRowCursor:
    """Walks the rows of JSON files forward, in the json builder's order, to find row k.

    Lines are counted, not parsed; only the rows asked for are parsed. `seek` returns None when
    the files cannot be lined up with the reader's rows (then nothing is concluded).
    """

    def __init__(self, files: list[str]):
        self._rows = ((path, where, raw) for path in files for where, raw in _json_rows(path))
        self._next = 0  # index of the row _rows yields next

    def seek(self, row: int) -> Optional[tuple[str, str, Any]]:
        if row < self._next:
            return None
        try:
            for path, where, raw in self._rows:
                self._next += 1
                if self._next - 1 == row:
                    return path, where, _parse_row(raw)
        except ValueError:  # _BadJson or a row that does not parse: the reader read it differently
            pass
        return None


def open_source(cfg: DataConfig) -> Source:
    """Decide what kind of source `cfg.source` is (no data is read yet, no network touched)."""
    src = cfg.source
    if src in BUILTIN_CORPORA:
        return Source("builtin", cfg)
    expanded = os.path.expanduser(src)
    if os.path.exists(expanded) or (_GLOB_CHARS & set(src) and glob.glob(expanded)) or _looks_local(src):
        return Source("local", cfg, files=resolve_local_files(src))
    return Source("hub", cfg)
