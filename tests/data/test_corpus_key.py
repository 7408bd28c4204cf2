"""The built-in corpus's key is its text's digest, not the interpreter's version.

Before, the key was ``builtin-v1-cpython-X.Y.Z``: the GPU bundle's data, prepared under Python
3.11, was never found by the GPU machine's 3.12, which prepared everything again. Now the same text
has the same key (and finds the same prepared data) whatever the version says; other text, one
character or another Python's standard library, has another key and never finds stale data.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pydoc_data.topics
import pytest

from llama_train.data import DataConfig, DataError, corpus, prepare_data

# Real English (the Python help topics) as the "extracted" corpus: enough for a 512-piece tokenizer.
_TOPICS = pydoc_data.topics.topics
TEXT = tuple(_TOPICS[k].strip() for k in sorted(_TOPICS)[:40])
OTHER_TEXT = TEXT[:-1] + (TEXT[-1] + ".",)  # one character more
_Version = collections.namedtuple("_Version", "major minor micro releaselevel serial")


def digest_of(docs) -> str:
    """The documented key: the sha256 of the documents as JSON lines."""
    return hashlib.sha256(b"".join(json.dumps(d).encode() + b"\n" for d in docs)).hexdigest()


@pytest.fixture
def extracted(tmp_path, monkeypatch):
    """A fresh cache and process; ``extracted["docs"]`` is what this interpreter extracts."""
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(corpus.CORPUS_PYTHON_ENV, raising=False)
    monkeypatch.setattr(corpus, "_CORPORA", {})
    text = {"docs": TEXT}
    monkeypatch.setattr(corpus, "extract_builtin", lambda: text["docs"])
    return text


def as_another_version(monkeypatch, micro: int) -> None:
    """This process becomes a new one of CPython 3.<minor>.<micro> (micro beyond any release, so
    no feature check takes another branch)."""
    v = sys.version_info
    monkeypatch.setattr(sys, "version_info", _Version(v.major, v.minor, micro, "final", 0))
    monkeypatch.setattr(corpus, "_CORPORA", {})


def test_the_same_text_has_the_same_key_whatever_the_interpreter_version(extracted, monkeypatch):
    key = corpus.corpus_id("builtin")
    assert key == f"builtin-sha256-{digest_of(TEXT)}"
    first = corpus.source_id("builtin")
    as_another_version(monkeypatch, 98)
    assert corpus.source_id("builtin") != first  # its own cache file: extracted again
    assert corpus.corpus_id("builtin") == key
    assert len(list((Path(os.environ["LLAMA_TRAIN_CACHE"]) / "corpus").glob("*.jsonl"))) == 2

    extracted["docs"] = OTHER_TEXT
    as_another_version(monkeypatch, 97)
    assert corpus.corpus_id("builtin") == f"builtin-sha256-{digest_of(OTHER_TEXT)}" != key
    monkeypatch.setattr(corpus, "extract_stdlib", lambda: TEXT)
    assert corpus.corpus_id("stdlib") == f"stdlib-sha256-{digest_of(TEXT)}"  # a corpus of its own


def test_prepared_data_is_found_by_its_text_not_by_the_interpreter_version(extracted, monkeypatch):
    cfg = DataConfig(source="builtin", val_fraction=0.1, num_proc=1)
    made = prepare_data(cfg, 512)
    assert made.created and made.meta["source"]["corpus"] == f"builtin-sha256-{digest_of(TEXT)}"

    as_another_version(monkeypatch, 98)  # another Python, the same text: the same data
    again = prepare_data(cfg, 512)
    assert not again.created and again.dir == made.dir

    extracted["docs"] = OTHER_TEXT  # another Python's text: prepared afresh, never reused
    as_another_version(monkeypatch, 97)
    other = prepare_data(cfg, 512)
    assert other.created and other.dir != made.dir
    with pytest.raises(DataError, match=r"source\.corpus differ"):
        prepare_data(DataConfig(source="builtin", val_fraction=0.1, num_proc=1,
                                prepared_dir=made.dir), 512)


def test_a_corpus_python_that_does_not_run_is_named(extracted, monkeypatch, tmp_path):
    monkeypatch.setenv(corpus.CORPUS_PYTHON_ENV, str(tmp_path / "python3.99"))
    with pytest.raises(DataError, match="LLAMA_TRAIN_CORPUS_PYTHON=.*python3.99.*cannot run"):
        corpus.corpus_id("builtin")
    monkeypatch.setenv(corpus.CORPUS_PYTHON_ENV, shutil.which("false"))
    with pytest.raises(DataError, match="LLAMA_TRAIN_CORPUS_PYTHON=.*exited with status 1"):
        corpus.corpus_id("builtin")


def _another_python() -> str | None:
    """A CPython 3.12 other than this one (pyenv's here), if this machine has one that runs."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(os.path.join(root, "versions", "3.12.*", "bin", "python3")),
                   reverse=True)
    for python in [*found, shutil.which("python3.12")]:
        if python and subprocess.run([python, "-c", "pass"], capture_output=True).returncode == 0:
            out = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True).stdout.strip()
            if out != str(sys.version_info[:2]):
                return python
    return None


@pytest.mark.slow
def test_another_python_running_corpus_py_alone_computes_the_key_of_its_text(tmp_path, monkeypatch):
    """What launch/gpu_bundle.sh relies on: data prepared here for another Python (the corpus
    extracted by it, LLAMA_TRAIN_CORPUS_PYTHON) has the key that Python computes itself, running
    corpus.py with nothing but its standard library (-I; no numpy, torch or filelock), from the
    cache file this process wrote (as the GPU machine reads .whl/cache) or from scratch."""
    python = _another_python()
    if python is None:
        pytest.skip("no other CPython 3.12 on this machine")
    monkeypatch.delenv(corpus.CORPUS_PYTHON_ENV, raising=False)
    own = corpus.corpus_id("builtin")  # this interpreter's (the session's cache: extracted once)

    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "here"))
    monkeypatch.setenv(corpus.CORPUS_PYTHON_ENV, python)
    monkeypatch.setattr(corpus, "_CORPORA", {})
    key = corpus.corpus_id("builtin")
    version = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert corpus.source_id("builtin") == f"builtin-v1-cpython-{version}"
    assert key == f"builtin-sha256-{digest_of(corpus.builtin_corpus())}" and key != own

    script = str(Path(corpus.__file__).resolve())
    keys = {}
    for cache in ("here", "fresh"):  # this process's cache file; none (it extracts)
        env = {k: v for k, v in os.environ.items() if k != corpus.CORPUS_PYTHON_ENV}
        proc = subprocess.run([python, "-I", script, "key", "builtin"], capture_output=True,
                              text=True, env={**env, "LLAMA_TRAIN_CACHE": str(tmp_path / cache)},
                              cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr
        keys[cache] = proc.stdout.strip()
    assert keys == {"here": key, "fresh": key}
    name = f"builtin-v1-cpython-{version}.jsonl"
    assert ((tmp_path / "here" / "corpus" / name).read_bytes()
            == (tmp_path / "fresh" / "corpus" / name).read_bytes())
