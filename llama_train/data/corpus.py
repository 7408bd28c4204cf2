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
import io
import re
import sys
import sysconfig
import tokenize
from pathlib import Path

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


@functools.lru_cache(maxsize=1)
def _build() -> tuple[str, ...]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    docs = [topics[key].strip() for key in sorted(topics)]
    for path in _stdlib_files(stdlib_dir()):
        docs.extend(_module_documents(path))
    return tuple(d for d in docs if d)


def builtin_corpus() -> list[str]:
    """The built-in corpus as a list of documents (deterministic for a given interpreter).

    Documents: the 79 `pydoc_data.topics` help pages (sorted by topic), then, for every stdlib
    module in sorted path order (test suites and site-packages excluded), one document with its
    docstrings (module, classes, functions in source order) and one with its comments (merged into
    paragraphs). Cached per process: building it parses ~700 files (a few seconds).
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
