"""The built-in corpus: real English text that ships with every CPython install.

Why: `make train` must work offline on a fresh machine, so the default data cannot be a
download. The Python documentation topics (`pydoc_data.topics`) plus the docstrings and comments
of the interpreter's own standard library are a few MB of real, technical English prose.
The corpus is built deterministically (sorted file order, no timestamps), so the same
interpreter always yields the same documents and the same fingerprint.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import logging
import os
import re
import sys
import sysconfig
import tokenize
from pathlib import Path
from typing import Callable, Optional, Sequence

log = logging.getLogger(__name__)

# Bump when the extraction rules change: it is part of the prepared-data fingerprint.
CORPUS_VERSION = 1

# Directories of the stdlib left out: third-party packages and the (huge, repetitive) test suites.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Comment lines that carry no prose: separators ("#-----"), empty "#", shebangs, coding cookies.
_NOISE = re.compile(r"^[\s\W_]*$")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# The corpora that ship with the interpreter: data.source=<name>.
BUILTIN_CORPORA = ("builtin", "stdlib")


def corpus_id(name: str = "builtin") -> str:
    """What a built-in corpus depends on: the interpreter version and the extraction rules."""
    impl = sys.implementation.name
    v = sys.version_info
    return f"{name}-v{CORPUS_VERSION}-{impl}-{v.major}.{v.minor}.{v.micro}"


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _docstrings(tree: ast.AST) -> list[str]:
    """Docstrings of the module, classes and functions, in source order."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                out.append(doc.strip())
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _comment_paragraphs(source: str) -> list[str]:
    """Comments merged into paragraphs: consecutive comment lines form one paragraph."""
    paragraphs: list[list[str]] = []
    last_line = -10
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            line_no = tok.start[0]
            text = tok.string.lstrip("#")
            text = text[1:] if text.startswith(" ") else text
            text = text.rstrip()
            if line_no <= 2 and (tok.string.startswith("#!") or "coding" in text):
                continue
            if _NOISE.match(text):
                last_line = -10  # a separator line ends the paragraph
                continue
            if line_no == last_line + 1 and paragraphs:
                paragraphs[-1].append(text)
            else:
                paragraphs.append([text])
            last_line = line_no
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # keep what was read before the error; deterministic either way
    return ["\n".join(p) for p in paragraphs]


def _module_documents(path: Path) -> list[str]:
    """Up to two documents per module: its docstrings, and its comments."""
    raw = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        source = raw.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return []
    docs = []
    try:
        docs.append("\n\n".join(_docstrings(ast.parse(source))))
    except (SyntaxError, ValueError):
        pass
    docs.append("\n\n".join(_comment_paragraphs(source)))
    return [d for d in docs if d.strip()]


def extract_builtin() -> tuple[str, ...]:
    """The built-in corpus extracted from the interpreter's files, no cache (what
    :func:`builtin_corpus` does on a cache miss; ``llama-bench data`` times it)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    docs = [topics[key].strip() for key in sorted(topics)]
    for path in _stdlib_files(stdlib_dir()):
        docs.extend(_module_documents(path))
    return tuple(d for d in docs if d)


def corpus_cache_file(name: str = "builtin") -> Path:
    from llama_train.paths import cache_dir

    return cache_dir() / "corpus" / f"{corpus_id(name)}.jsonl"


@functools.lru_cache(maxsize=1)
def _extractor() -> str:
    """This file's digest, kept in every cache file: an edit to the extraction rules makes the
    cached corpora stale even where CORPUS_VERSION was not bumped."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _digest(lines: Sequence[bytes]) -> str:
    return hashlib.sha256(b"".join(lines)).hexdigest()


def _read_cache(path: Path, cid: str) -> Optional[tuple[str, ...]]:
    """The documents of a cache file; None if it is missing (silently) or fails its check (a
    header naming the corpus id, the extraction code, the document count and the sha256 of the
    lines after it)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    head, _, body = raw.partition(b"\n")
    lines = body.splitlines(keepends=True)
    try:
        meta = json.loads(head)
        ok = (meta.get("corpus") == cid and meta.get("extractor") == _extractor()
              and meta.get("documents") == len(lines)
              and meta.get("sha256") == _digest(lines))
        docs = tuple(json.loads(line) for line in lines) if ok else None
    except (ValueError, AttributeError):
        docs = None
    if docs is None or not all(isinstance(d, str) for d in docs):
        log.warning("the cached corpus %s fails its check (sha256, count, id or extraction "
                    "code); extracting it again", path)
        return None
    return docs


def _write_cache(path: Path, cid: str, docs: Sequence[str]) -> None:
    lines = [json.dumps(d).encode() + b"\n" for d in docs]
    head = json.dumps({"corpus": cid, "extractor": _extractor(), "documents": len(lines),
                       "sha256": _digest(lines)})
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(head.encode() + b"\n")
            f.writelines(lines)
        os.replace(tmp, path)  # readers see the old file or the whole new one
    finally:
        tmp.unlink(missing_ok=True)


def cached_corpus(name: str, extract: Callable[[], tuple[str, ...]]) -> tuple[str, ...]:
    """``extract()``, kept on disk (LLAMA_TRAIN_CACHE/corpus/<corpus id>.jsonl) for the next
    process: extraction parses ~700 files (12-14 s of CPU on a 2.45 GHz core), reading the cache
    takes 0.02 s. Every read is checked, so a damaged file is extracted again, never trained on;
    one process extracts while the others wait on a lock. A cache that cannot be written (a
    read-only home) costs the extraction, never the run."""
    from filelock import FileLock

    cid, path = corpus_id(name), corpus_cache_file(name)
    docs = _read_cache(path, cid)  # None when missing, silently
    if docs is not None:
        return docs
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock")
        lock.acquire()
    except OSError as e:
        log.debug("corpus cache %s not used: %s", path, e)
        return extract()
    try:
        docs = _read_cache(path, cid)  # another process's, written while this one waited
        if docs is None:
            docs = extract()
            try:
                _write_cache(path, cid, docs)
            except OSError as e:  # a full disk: this process has the documents all the same
                log.debug("corpus cache %s not written: %s", path, e)
        return docs
    finally:
        lock.release()


@functools.lru_cache(maxsize=1)
def _build() -> tuple[str, ...]:
    return cached_corpus("builtin", extract_builtin)


def builtin_corpus() -> list[str]:
    """The built-in corpus as a list of documents (deterministic for a given interpreter).

    Documents: the 79 `pydoc_data.topics` help pages (sorted by topic), then, for every stdlib
    module in sorted path order (test suites and site-packages excluded), one document with its
    docstrings (module, classes, functions in source order) and one with its comments (merged into
    paragraphs). Extracted once per cache directory (:func:`cached_corpus`), then per process.
    """
    return list(_build())


def _read_source(path: Path) -> str:
    raw = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return ""


@functools.lru_cache(maxsize=1)
def _build_stdlib() -> tuple[str, ...]:
    root = stdlib_dir()
    files = sorted((p for p in root.rglob("*.py")
                    if not {"site-packages", "dist-packages", "__pycache__"}.intersection(
                        p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    return tuple(t for t in (_read_source(p).strip() for p in files) if t)


def stdlib_corpus() -> list[str]:
    """``data.source=stdlib``: every Python file of the interpreter's standard library (its test
    suites included, site-packages not), whole, one document per file, in sorted path order:
    ~31 MB of code, docstrings and comments (CPython 3.11), about 8x the ``builtin`` corpus. For
    runs that need more tokens than ``builtin`` holds without repeating it (scaling sweeps)."""
    return list(_build_stdlib())


def named_corpus(name: str) -> list[str]:
    """A built-in corpus by its ``data.source`` name (BUILTIN_CORPORA)."""
    return stdlib_corpus() if name == "stdlib" else builtin_corpus()
