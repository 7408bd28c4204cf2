"""The built-in corpus: real English text that ships with every CPython install.

Why: `make train` must work offline on a fresh machine, so the default data cannot be a
download. The Python documentation topics (`pydoc_data.topics`) plus the docstrings and comments
of the interpreter's own standard library are a few MB of real, technical English prose.
The corpus is built deterministically (sorted file order, no timestamps), so the same
interpreter always yields the same documents. Its key in the prepared-data fingerprint
(:func:`corpus_id`) is the sha256 of those documents, not the interpreter's version: prepared data
is found wherever the text is the same, and never where it differs.

This file needs only the standard library, so a bare interpreter (a GPU machine's Python, without
numpy or torch) can run it to say which key its own corpus has:
``python3.12 llama_train/data/corpus.py key builtin`` (see :func:`main`; launch/gpu_bundle.sh).
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

# Bump when the extraction rules change: it names the cache files of extracted corpora. (The key
# of a corpus, corpus_id, is its text's digest: changed text changes it by itself.)
CORPUS_VERSION = 1
# Another interpreter whose standard library the built-in corpora come from (unset: this one's).
CORPUS_PYTHON_ENV = "LLAMA_TRAIN_CORPUS_PYTHON"

# Directories of the stdlib left out: third-party packages and the (huge, repetitive) test suites.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Comment lines that carry no prose: separators ("#-----"), empty "#", shebangs, coding cookies.
_NOISE = re.compile(r"^[\s\W_]*$")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# The corpora that ship with the interpreter: data.source=<name>.
BUILTIN_CORPORA = ("builtin", "stdlib")


def corpus_python() -> Optional[str]:
    """$LLAMA_TRAIN_CORPUS_PYTHON, else None (this interpreter). Set, that interpreter extracts
    the built-in corpora (running this file), so that data prepared here is the data a machine
    with that Python looks for: launch/gpu_bundle.sh prepares for the GPU machine's Python."""
    return os.environ.get(CORPUS_PYTHON_ENV) or None


def _this_interpreter() -> str:
    v = sys.version_info
    return f"{sys.implementation.name}-{v.major}.{v.minor}.{v.micro}"


@functools.lru_cache(maxsize=None)
def _interpreter_of(python: str) -> str:
    return _run(python, "interpreter").strip()


def source_id(name: str = "builtin") -> str:
    """What extracting a built-in corpus depends on, the extraction rules and the interpreter
    whose standard library it reads: it names the corpus's cache file. Not the corpus's key
    (:func:`corpus_id`): two interpreters may yield the same text, and one key then."""
    python = corpus_python()
    interpreter = _this_interpreter() if python is None else _interpreter_of(python)
    return f"{name}-v{CORPUS_VERSION}-{interpreter}"


def corpus_id(name: str = "builtin") -> str:
    """The key of a built-in corpus in the prepared-data fingerprint: ``<name>-sha256-<hex>``, the
    sha256 of its documents as JSON lines (``json.dumps(doc) + "\\n"`` each, the body of its
    cache file). The same text has the same key whichever interpreter extracted it; other text
    (another Python's standard library) another key, so it never finds data prepared from this
    one. Costs reading the corpus (from its cache file: 0.02-0.04 s), once per process."""
    return f"{name}-sha256-{_corpus(name)[1]}"


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

    return cache_dir() / "corpus" / f"{source_id(name)}.jsonl"


@functools.lru_cache(maxsize=1)
def _extractor() -> str:
    """This file's digest, kept in every cache file: an edit to the extraction rules makes the
    cached corpora stale even where CORPUS_VERSION was not bumped."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _lines(docs: Sequence[str]) -> list[bytes]:
    """The documents as JSON lines (ASCII, the same bytes from every Python version): the body
    of a cache file, and what the corpus key hashes."""
    return [json.dumps(d).encode() + b"\n" for d in docs]


def _digest(lines: Sequence[bytes]) -> str:
    return hashlib.sha256(b"".join(lines)).hexdigest()


def _read_cache(path: Path, cid: str) -> Optional[tuple[tuple[str, ...], str]]:
    """(documents, their digest) from a cache file; None if it is missing (silently) or fails
    its check (a header naming the corpus's source id, the extraction code, the document count
    and the sha256 of the lines after it)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    head, _, body = raw.partition(b"\n")
    lines = body.splitlines(keepends=True)
    digest = _digest(lines)
    try:
        meta = json.loads(head)
        ok = (meta.get("corpus") == cid and meta.get("extractor") == _extractor()
              and meta.get("documents") == len(lines) and meta.get("sha256") == digest)
        docs = tuple(json.loads(line) for line in lines) if ok else None
    except (ValueError, AttributeError):
        docs = None
    if docs is None or not all(isinstance(d, str) for d in docs):
        log.warning("the cached corpus %s fails its check (sha256, count, id or extraction "
                    "code); extracting it again", path)
        return None
    return docs, digest


def _write_cache(path: Path, cid: str, lines: Sequence[bytes]) -> None:
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


class _NoLock:
    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass


def _file_lock(path: str):
    """A FileLock; none under a bare interpreter running this file (no filelock package): two
    such processes may both extract, and the atomic write keeps the file whole either way."""
    try:
        from filelock import FileLock
    except ImportError:
        return _NoLock()
    return FileLock(path)


def _cached(name: str, extract: Callable[[], Sequence[str]]) -> tuple[tuple[str, ...], str]:
    """:func:`cached_corpus`, with the documents' digest (computed by the check or the write)."""
    cid, path = source_id(name), corpus_cache_file(name)
    found = _read_cache(path, cid)  # None when missing, silently
    if found is not None:
        return found
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _file_lock(str(path) + ".lock")
        lock.acquire()
    except OSError as e:
        log.debug("corpus cache %s not used: %s", path, e)
        docs = tuple(extract())
        return docs, _digest(_lines(docs))
    try:
        found = _read_cache(path, cid)  # another process's, written while this one waited
        if found is not None:
            return found
        docs = tuple(extract())
        lines = _lines(docs)
        try:
            _write_cache(path, cid, lines)
        except OSError as e:  # a full disk: this process has the documents all the same
            log.debug("corpus cache %s not written: %s", path, e)
        return docs, _digest(lines)
    finally:
        lock.release()


def cached_corpus(name: str, extract: Callable[[], Sequence[str]]) -> tuple[str, ...]:
    """``extract()``, kept on disk (LLAMA_TRAIN_CACHE/corpus/<source id>.jsonl) for the next
    process: extraction parses ~700 files (12-14 s of CPU on a 2.45 GHz core), reading the cache
    takes 0.02 s. Every read is checked, so a damaged file is extracted again, never trained on;
    one process extracts while the others wait on a lock. A cache that cannot be written (a
    read-only home) costs the extraction, never the run."""
    return _cached(name, extract)[0]


def _read_source(path: Path) -> str:
    raw = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return ""


def extract_stdlib() -> tuple[str, ...]:
    """The ``stdlib`` corpus (:func:`stdlib_corpus`), read from the interpreter's files."""
    root = stdlib_dir()
    files = sorted((p for p in root.rglob("*.py")
                    if not {"site-packages", "dist-packages", "__pycache__"}.intersection(
                        p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    return tuple(t for t in (_read_source(p).strip() for p in files) if t)


def _run(python: str, *args: str) -> str:
    """The stdout of this file run by `python` (-I: its standard library and nothing else)."""
    import subprocess

    from .errors import DataError

    what = f"{CORPUS_PYTHON_ENV}={python!r}"
    try:
        proc = subprocess.run([python, "-I", str(Path(__file__).resolve()), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{what}: cannot run it ({e}); set it to a Python executable, or unset "
                        "it to use this interpreter's corpus") from e
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise DataError(f"{what}: `{python} {Path(__file__).name} {' '.join(args)}` exited "
                        f"with status {proc.returncode}: {last}")
    return proc.stdout


def _extract(name: str) -> tuple[str, ...]:
    """The corpus `name` extracted, no cache: by this interpreter, or by $LLAMA_TRAIN_CORPUS_PYTHON
    (its documents as JSON lines on its stdout)."""
    python = corpus_python()
    if python is None:
        return extract_stdlib() if name == "stdlib" else extract_builtin()
    out = _run(python, "dump", name)
    return tuple(json.loads(line) for line in out.split("\n") if line)


# (name, corpus_python()) -> (documents, sha256 of their JSON lines): once per process
_CORPORA: dict = {}


def _corpus(name: str) -> tuple[tuple[str, ...], str]:
    key = (name, corpus_python())
    if key not in _CORPORA:
        if name == "stdlib":  # read whole in 0.6 s: a cache file would save nothing
            docs = _extract(name)
            _CORPORA[key] = docs, _digest(_lines(docs))
        else:
            _CORPORA[key] = _cached(name, lambda: _extract(name))
    return _CORPORA[key]


def builtin_corpus() -> list[str]:
    """The built-in corpus as a list of documents (deterministic for a given interpreter).

    Documents: the 79 `pydoc_data.topics` help pages (sorted by topic), then, for every stdlib
    module in sorted path order (test suites and site-packages excluded), one document with its
    docstrings (module, classes, functions in source order) and one with its comments (merged into
    paragraphs). Extracted once per cache directory (:func:`cached_corpus`), then per process.
    """
    return list(_corpus("builtin")[0])


def stdlib_corpus() -> list[str]:
    """``data.source=stdlib``: every Python file of the interpreter's standard library (its test
    suites included, site-packages not), whole, one document per file, in sorted path order:
    ~31 MB of code, docstrings and comments (CPython 3.11), about 8x the ``builtin`` corpus. For
    runs that need more tokens than ``builtin`` holds without repeating it (scaling sweeps)."""
    return list(_corpus("stdlib")[0])


def named_corpus(name: str) -> list[str]:
    """A built-in corpus by its ``data.source`` name (BUILTIN_CORPORA)."""
    return stdlib_corpus() if name == "stdlib" else builtin_corpus()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python llama_train/data/corpus.py interpreter | key NAME | dump NAME``, for this
    interpreter's own corpus (LLAMA_TRAIN_CORPUS_PYTHON is ignored), with the standard library
    alone: its name and version; the key (:func:`corpus_id`) its corpus NAME has, through the
    cache in $LLAMA_TRAIN_CACHE/corpus like a run; the documents as JSON lines, extracted afresh
    (what :func:`_extract` reads from another interpreter)."""
    import argparse

    ap = argparse.ArgumentParser(prog="corpus.py", description=main.__doc__)
    ap.add_argument("what", choices=("interpreter", "key", "dump"))
    ap.add_argument("name", nargs="?", default="builtin", choices=BUILTIN_CORPORA)
    args = ap.parse_args(argv)
    os.environ.pop(CORPUS_PYTHON_ENV, None)
    if args.what == "interpreter":
        print(_this_interpreter())
    elif args.what == "key":
        print(corpus_id(args.name))
    else:
        docs = extract_stdlib() if args.name == "stdlib" else extract_builtin()
        sys.stdout.writelines(json.dumps(d) + "\n" for d in docs)
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file: this checkout's llama_train (paths.cache_dir) importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
