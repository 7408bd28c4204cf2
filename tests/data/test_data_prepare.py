"""Data pipeline: tokenizer, sources, prepare (shards + meta), and every bad-input error."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from llama_train.data import (
    DataConfig,
    DataError,
    PackedTokens,
    Tokenizer,
    builtin_corpus,
    check_compatible,
    prepare_data,
    read_meta,
    train_tokenizer,
)
from llama_train.data import sources as sources_mod
from llama_train.data.cli import main as cli_main

from helpers import REPO
VOCAB = 512
UNICODE_DOC = "Emoji 😀🚀 and CJK 中文字符 and accents: naïve café — «quotes» \t tab\n\n  two spaces"


def tiny_docs() -> list[str]:
    """Real English (40 Python help topics) plus one document of characters outside the vocab."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [topics[k].strip() for k in sorted(topics)[:40]] + [UNICODE_DOC]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return tiny_docs()


@pytest.fixture(scope="module")
def files(tmp_path_factory, docs) -> dict[str, str]:
    """The same documents as a .jsonl file, a directory of .txt files and a .parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("sources")
    jsonl = root / "docs.jsonl"
    with open(jsonl, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    txt = root / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):
        (txt / f"doc-{i:03d}.txt").write_text(d)
    parquet = root / "docs.parquet"
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), parquet)
    return {"jsonl": str(jsonl), "txt": str(txt), "parquet": str(parquet), "root": str(root)}


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory, docs) -> str:
    return train_tokenizer(docs, VOCAB, tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")


def cfg(**kw) -> DataConfig:
    base = dict(val_fraction=0.1, num_proc=1)
    base.update(kw)
    return DataConfig(**base)


def split_tokens(d: str, split: str) -> np.ndarray:
    pt = PackedTokens(d, split)
    return np.asarray(pt[:], dtype=np.int64)


def expected_streams(tok: Tokenizer, docs: list[str], frac: float, bos: bool = False):
    """The token streams the spec promises: non-empty docs + EOS, every 1/f-th held out."""
    f = Fraction(str(frac))
    out = {"train": [], "val": []}
    j = 0
    for d in docs:
        ids = tok.encode(d)
        if not ids:
            continue
        is_val = math.ceil((j + 1) * f) > math.ceil(j * f)
        out["val" if is_val else "train"] += ([tok.bos_id] if bos else []) + ids + [tok.eos_id]
        j += 1
    return {k: np.array(v, dtype=np.int64) for k, v in out.items()}


# --- tokenizer --------------------------------------------------------------------------------
def test_tokenizer_round_trip_and_byte_fallback(tok_path, docs):
    tok = Tokenizer(tok_path)
    assert (tok.vocab_size, tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (VOCAB, 0, 1, 2, -1)
    ids = tok.encode(UNICODE_DOC)
    pieces = [tok.sp.id_to_piece(i) for i in ids]
    assert "<0xF0>" in pieces, "emoji must go through byte fallback"
    assert tok.unk_id not in ids
    assert tok.decode(ids) == UNICODE_DOC
    for text in docs[:5] + ["", " leading space", "trailing  \n", "x\r\ny", "12345 67"]:
        assert tok.decode(tok.encode(text)) == text
    digits = [tok.sp.id_to_piece(i) for i in tok.encode("2024")]
    assert all(len(p.strip("▁")) <= 1 for p in digits), digits  # split_digits
    assert tok.encode("hi", bos=True, eos=True) == [1] + tok.encode("hi") + [2]
    assert tok.encode_batch(docs[:3], eos=True) == [tok.encode(d, eos=True) for d in docs[:3]]
    assert tok.sha256 == hashlib.sha256(Path(tok_path).read_bytes()).hexdigest()


def test_tokenizer_training_is_byte_identical_across_paths(tmp_path, docs, tok_path):
    again = train_tokenizer(docs, VOCAB, tmp_path / "other" / "name", num_threads=1)
    assert Tokenizer(again).sha256 == Tokenizer(tok_path).sha256


def test_tokenizer_errors(tmp_path, docs):
    with pytest.raises(DataError, match="too few distinct pieces"):
        train_tokenizer(docs[:1], 30000, tmp_path / "big")
    with pytest.raises(DataError, match="vocab_size=270 is too small"):
        train_tokenizer(docs, 270, tmp_path / "small")
    with pytest.raises(DataError, match="no non-empty text"):
        train_tokenizer(["", "  \n"], VOCAB, tmp_path / "empty")
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        Tokenizer(tmp_path / "junk.model")


# --- builtin corpus ---------------------------------------------------------------------------
SAMPLE_HASH = (
    "import hashlib; from llama_train.data import corpus as c; "
    "files = c._stdlib_files(c.stdlib_dir())[::15]; "
    "docs = [d for f in files for d in c._module_documents(f)]; "
    "print(len(files), hashlib.sha256('\\x00'.join(docs).encode()).hexdigest())"
)


@pytest.mark.slow
def test_builtin_corpus_is_real_text_and_deterministic():
    # another interpreter process (other hash seed) extracts the same documents from a sample
    other = subprocess.Popen([sys.executable, "-c", SAMPLE_HASH], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = other.communicate(timeout=120)
    finally:
        other.kill()
    mine = subprocess.run([sys.executable, "-c", SAMPLE_HASH], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONHASHSEED": "123"}, timeout=120).stdout
    assert out == mine and int(out.split()[0]) > 40
    docs = builtin_corpus()
    assert builtin_corpus() == docs
    size = sum(len(d.encode()) for d in docs)
    assert size > 3_000_000 and len(docs) > 1000
    assert all(isinstance(d, str) and d.strip() for d in docs)
    words = "\n".join(docs[:300]).split()
    assert sum(w.lower() in {"the", "of", "is", "to", "and", "a"} for w in words) > 0.05 * len(words)
    assert any("Return" in d for d in docs)  # docstrings, not only the pydoc topics


def test_the_extracted_corpus_is_kept_on_disk_checked_and_never_trusted_blindly(
        tmp_path, monkeypatch, caplog):
    """builtin_corpus() extracts once per cache directory (LLAMA_TRAIN_CACHE/corpus): a later
    process reads the file instead of parsing ~700 stdlib files; a damaged file (one byte, or
    another interpreter's id, an edit to the extraction code) is extracted again, never used; an
    unwritable cache costs the extraction, not the run."""
    from llama_train.data import corpus

    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "cache"))
    calls = []

    def extract():
        calls.append(1)
        return ("first document", "second\nwith \"quotes\" and \u00e9", "third")

    docs = corpus.cached_corpus("builtin", extract)
    path = corpus.corpus_cache_file("builtin")
    assert calls == [1] and path.parent == tmp_path / "cache" / "corpus" and path.is_file()
    assert corpus.cached_corpus("builtin", lambda: pytest.fail("extracted again")) == docs

    raw = path.read_bytes()
    at = raw.index(b"second")
    path.write_bytes(raw[:at] + b"S" + raw[at + 1:])  # one byte of one document
    with caplog.at_level("WARNING", logger="llama_train.data.corpus"):
        assert corpus.cached_corpus("builtin", extract) == docs
    assert calls == [1, 1] and "fails its check" in caplog.text
    assert path.read_bytes() == raw  # written again whole
    assert corpus.cached_corpus("stdlib", extract) == docs and calls == [1, 1, 1]  # its own id
    head, _, body = path.read_bytes().partition(b"\n")
    meta = json.loads(head)
    path.write_bytes(json.dumps({**meta, "corpus": "builtin-v1-cpython-3.99.0"}).encode()
                     + b"\n" + body)
    assert corpus.cached_corpus("builtin", extract) == docs and len(calls) == 4
    path.write_bytes(json.dumps({**meta, "extractor": "0" * 16}).encode() + b"\n" + body)
    assert corpus.cached_corpus("builtin", extract) == docs and len(calls) == 5  # rules edited

    # builtin_corpus() goes through it (in a new process: nothing read yet)
    monkeypatch.setattr(corpus, "extract_builtin", extract)
    monkeypatch.setattr(corpus, "_CORPORA", {})
    assert corpus.builtin_corpus() == list(docs) and len(calls) == 5  # read, not extracted

    # a cache that cannot be a directory is refused naming the variable (issue 54), not used
    from llama_train.paths import PathRefused

    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "file"))
    with pytest.raises(PathRefused, match="LLAMA_TRAIN_CACHE="):
        corpus.cached_corpus("builtin", extract)
    assert len(calls) == 5

    def disk_full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "full"))
    monkeypatch.setattr(corpus, "_write_cache", disk_full)
    assert corpus.cached_corpus("builtin", extract) == docs and len(calls) == 6  # once, not twice


@pytest.mark.slow
def test_stdlib_corpus_is_the_whole_standard_library_and_prepares(tmp_path):
    """data.source=stdlib: every stdlib .py file whole (tests included), ~8x builtin; its own
    corpus key and directory name, so it never shares prepared data with builtin."""
    from llama_train.data.corpus import stdlib_corpus

    docs = stdlib_corpus()
    assert stdlib_corpus() == docs and len(docs) > 1000
    size = sum(len(d.encode()) for d in docs)
    assert size > 6 * sum(len(d.encode()) for d in builtin_corpus())
    assert any(d.startswith('"""') and "def " in d for d in docs)  # code, not only prose
    prep = prepare_data(cfg(source="stdlib", max_documents=40, val_fraction=0.1), VOCAB)
    assert Path(prep.dir).name.startswith("stdlib-")
    assert prep.meta["source"]["corpus"].startswith("stdlib-sha256-")
    assert prep.meta["documents"]["read"] == 40


@pytest.mark.slow
def test_prepare_builtin_source_small(tmp_path):
    prep = prepare_data(cfg(max_documents=120, val_fraction=0.05), VOCAB)
    assert prep.created and Path(prep.dir).parent == tmp_path / "cache"
    assert Path(prep.dir).name.startswith("builtin-")
    assert prep.meta["documents"]["read"] == 120
    assert prep.meta["source"]["corpus"].startswith("builtin-sha256-")
    tok = Tokenizer(prep.tokenizer_path)
    exp = expected_streams(tok, builtin_corpus()[:120], 0.05)
    assert np.array_equal(split_tokens(prep.dir, "train"), exp["train"])


# --- prepare ----------------------------------------------------------------------------------
def test_shards_hold_every_document_plus_eos(tmp_path, files, docs, tok_path):
    tok = Tokenizer(tok_path)
    prep = prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, shard_tokens=3000), VOCAB)
    m = prep.meta
    exp = expected_streams(tok, docs, 0.1)
    for split in ("train", "val"):
        got = split_tokens(prep.dir, split)
        assert np.array_equal(got, exp[split]), split
        assert m["splits"][split]["tokens"] == len(exp[split])
        assert (got == tok.eos_id).sum() == m["splits"][split]["documents"]
    assert m["splits"]["val"]["documents"] == math.ceil(len(docs) * 0.1)
    total = sum(len(tok.encode(d)) + 1 for d in docs)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == total
    assert len(m["splits"]["train"]["shards"]) == math.ceil(len(exp["train"]) / 3000)
    for s in m["splits"]["train"]["shards"]:
        p = Path(prep.dir) / s["file"]
        assert p.stat().st_size == s["bytes"] == 2 * s["tokens"]
        assert hashlib.sha256(p.read_bytes()).hexdigest() == s["sha256"]
    assert m["dtype"] == "uint16" and m["vocab_size"] == VOCAB
    assert m["tokenizer"]["sha256"] == tok.sha256
    assert Tokenizer(prep.tokenizer_path).sha256 == tok.sha256  # the tokenizer travels with the shards
    assert not list(Path(prep.dir).parent.glob(".*tmp*")), "temp dir left behind"


@pytest.mark.parametrize("kind,extra", [("txt", {}), ("parquet", {"text_column": "body"})])
def test_local_formats_give_the_same_tokens(tmp_path, files, docs, tok_path, kind, extra):
    prep = prepare_data(cfg(source=files[kind], tokenizer=tok_path, **extra), VOCAB)
    exp = expected_streams(Tokenizer(tok_path), docs, 0.1)
    assert np.array_equal(split_tokens(prep.dir, "train"), exp["train"])
    assert np.array_equal(split_tokens(prep.dir, "val"), exp["val"])


def test_streaming_glob_parallel_and_bos(tmp_path, files, docs, tok_path, monkeypatch):
    """Two processes, small batches (several in flight), streaming, glob: same tokens, in order."""
    monkeypatch.setattr(sources_mod, "BATCH_DOCS", 4)
    glob = str(Path(files["root"]) / "*.jsonl")
    prep = prepare_data(
        cfg(source=glob, tokenizer=tok_path, streaming=True, num_proc=2, add_bos=True, dtype="uint32"), VOCAB
    )
    exp = expected_streams(Tokenizer(tok_path), docs, 0.1, bos=True)
    assert prep.meta["dtype"] == "uint32"
    assert np.array_equal(split_tokens(prep.dir, "train"), exp["train"])
    assert np.array_equal(split_tokens(prep.dir, "val"), exp["val"])


def test_trained_tokenizer_is_stored_and_used(tmp_path, files, docs):
    prep = prepare_data(cfg(source=files["jsonl"], max_documents=30), VOCAB)
    assert prep.meta["tokenizer"]["trained_here"]
    tok = Tokenizer(prep.tokenizer_path)
    assert tok.vocab_size == VOCAB and prep.meta["tokenizer"]["sha256"] == tok.sha256
    exp = expected_streams(tok, docs[:30], 0.1)
    assert np.array_equal(split_tokens(prep.dir, "train"), exp["train"])


def test_idempotent_rerun_is_fast_and_untouched(tmp_path, files, tok_path):
    c = cfg(source=files["jsonl"], tokenizer=tok_path)
    first = prepare_data(c, VOCAB)
    shard = Path(first.dir) / "train-00000.bin"
    mtime = shard.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = prepare_data(c, VOCAB)
    assert time.perf_counter() - t0 < 5.0  # generous for a loaded CI machine; a re-tokenize takes far longer
    assert (first.created, again.created) == (True, False)
    assert again.dir == first.dir and again.meta == first.meta
    assert shard.stat().st_mtime_ns == mtime
    # num_proc / shard size / loader settings do not change the tokens, so not the directory
    assert prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, num_proc=2, num_workers=3), VOCAB).dir == first.dir


def test_refuses_other_tokenizer_or_settings_in_same_dir(tmp_path, files, docs, tok_path):
    out = str(tmp_path / "prepared")
    prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, prepared_dir=out), VOCAB)
    other_tok = train_tokenizer(docs[10:], VOCAB, tmp_path / "other")
    assert Tokenizer(other_tok).sha256 != Tokenizer(tok_path).sha256
    with pytest.raises(DataError, match="different tokenizer"):
        prepare_data(cfg(source=files["jsonl"], tokenizer=other_tok, prepared_dir=out), VOCAB)
    with pytest.raises(DataError, match="val_fraction"):
        prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, prepared_dir=out, val_fraction=0.2), VOCAB)
    (tmp_path / "notprepared").mkdir()
    (tmp_path / "notprepared" / "x").write_text("mine")
    with pytest.raises(DataError, match="not a prepared data directory"):
        prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, prepared_dir=str(tmp_path / "notprepared")), VOCAB)
    assert (tmp_path / "notprepared" / "x").read_text() == "mine"


def test_prepare_failure_leaves_nothing_behind(tmp_path, files, tok_path):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": 3}\n')
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match="holds int values"):
        prepare_data(cfg(source=str(jsonl), tokenizer=tok_path, prepared_dir=str(out)), VOCAB)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --- bad input --------------------------------------------------------------------------------
def test_missing_path_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match=r"no such file.*data\.source"):
        prepare_data(cfg(source=str(tmp_path / "nope.jsonl")), VOCAB)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.csv").write_text("x")
    with pytest.raises(DataError, match="matched no data files"):
        prepare_data(cfg(source=str(tmp_path / "d")), VOCAB)


def test_missing_column_lists_available(files, tok_path):
    with pytest.raises(DataError, match=r"text_column='content'.*available columns: id, text"):
        prepare_data(cfg(source=files["jsonl"], text_column="content", tokenizer=tok_path), VOCAB)
    with pytest.raises(DataError, match=r"available columns: .*body"):
        prepare_data(cfg(source=files["parquet"], tokenizer=tok_path), VOCAB)


BINARY = bytes(range(256)) * 12  # the first byte that is not UTF-8: 0x80, byte 128, line 2


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
@pytest.mark.parametrize("streaming", [False, True])
def test_binary_file_is_named_with_its_offset(tmp_path, suffix, streaming):
    """Not "DatasetGenerationError: An error occurred while generating the dataset": the file,
    the byte and line, data.source and what to do, before any tokenizer is trained."""
    bad = tmp_path / f"bin{suffix}"
    bad.write_bytes(BINARY)
    out = tmp_path / "prepared"
    with pytest.raises(DataError) as e:
        prepare_data(cfg(source=str(bad), streaming=streaming, prepared_dir=str(out)), VOCAB)
    msg = str(e.value)
    assert f"data.source='{bad}'" in msg and f"{bad} is not UTF-8 text (byte 128, line 2:" in msg
    assert "remove it from data.source" in msg and "\n" not in msg
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_llama_train_on_a_binary_source_exits_2_with_one_line(tmp_path, capsys):
    """The trainer's entry point: exit status 2 and the message, no traceback."""
    from hydra import compose, initialize_config_dir

    from helpers import TINY, launch_vars_restored
    from llama_train.paths import CONFIG_DIR
    from llama_train.train import run_job

    bad = tmp_path / "bin.txt"
    bad.write_bytes(BINARY)
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        dcfg = compose("config", overrides=[*TINY, f"data.source={bad}",
                                            f"trainer.output_dir={tmp_path / 'out'}"])
    with launch_vars_restored(), pytest.raises(SystemExit) as e:
        run_job(dcfg)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("llama-train: error: data.source=") and f"{bad} is not UTF-8" in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
@pytest.mark.parametrize("streaming", [False, True])
def test_glob_names_the_one_binary_file(tmp_path, suffix, streaming):
    d = tmp_path / "corpus"
    d.mkdir()
    for name in ("a", "b", "c", "d"):
        text = f"document {name} with a few ordinary words"
        (d / f"{name}{suffix}").write_text(json.dumps({"text": text}) + "\n" if suffix == ".jsonl" else text)
    bad = d / f"c{suffix}"
    good_line = json.dumps({"text": "fine"}) + "\n" if suffix == ".jsonl" else "fine\n"
    bad.write_bytes(good_line.encode() * 2 + "caf\xe9".encode("latin-1") + b"\n")  # latin-1, not UTF-8
    with pytest.raises(DataError) as e:
        prepare_data(cfg(source=str(d / f"*{suffix}"), streaming=streaming), VOCAB)
    msg = str(e.value)
    assert f"{bad} is not UTF-8 text (byte {2 * len(good_line) + 3}, line 3" in msg, msg
    assert all(f"{d / n}{suffix}" not in msg for n in "abd") and "iconv" in msg


@pytest.mark.parametrize("streaming", [False, True])
def test_jsonl_row_without_the_text_column_is_named(tmp_path, streaming, tok_path):
    """A row that lacks the column is an error naming file, line and key; a null or "" text
    is an empty document, skipped and counted. Checked before the tokenizer trains (the first
    case) and while encoding with a given tokenizer (the second)."""
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "ok, a document with words"}\n\n{"text": null}\n{"text": ""}\n'
                   '{"body": "no text"}\n{"text": "more words"}\n')
    out = tmp_path / "prepared"
    for tok in (None, tok_path):
        with pytest.raises(DataError) as e:
            prepare_data(cfg(source=str(src), streaming=streaming, tokenizer=tok, prepared_dir=str(out)), VOCAB)
        msg = str(e.value)
        assert f"{src} line 5 has no 'text' key" in msg and "data.text_column='text'" in msg
        assert "its keys: body" in msg and "too few" not in msg and "SentencePiece" not in msg
        assert not out.exists()
    # a whole file of a glob without the column (the json reader then fails on its columns)
    d = tmp_path / "glob"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "first file"}\n')
    (d / "b.jsonl").write_text('{"text": "second file"}\n{"content": "x", "id": 1}\n')
    with pytest.raises(DataError, match=rf"{d / 'b.jsonl'} line 2 has no 'text' key .*its keys: content, id"):
        prepare_data(cfg(source=str(d / "*.jsonl"), streaming=streaming, tokenizer=tok_path), VOCAB)
    # null and "" (and blank lines, which are no rows) are fine: counted as empty and skipped
    src.write_text('{"text": "ok, a document"}\n\n{"text": null}\n{"text": ""}\n{"text": "more"}\n')
    prep = prepare_data(cfg(source=str(src), streaming=streaming, tokenizer=tok_path, val_fraction=0.0), VOCAB)
    assert prep.meta["documents"] == {"read": 4, "empty_skipped": 2, "kept": 2}


def test_unreadable_json_and_parquet_files_are_named(tmp_path, tok_path):
    arr = tmp_path / "docs.json"
    arr.write_text(json.dumps([{"text": "one"}, {"text": None}, {"title": "two"}], indent=1))
    with pytest.raises(DataError, match=rf"{arr} element 2 has no 'text' key .*its keys: title"):
        prepare_data(cfg(source=str(arr), tokenizer=tok_path), VOCAB)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "unterminated}\n')
    with pytest.raises(DataError, match=rf"{bad} line 2 is not valid JSON \(.*\)\. Each line"):
        prepare_data(cfg(source=str(bad), tokenizer=tok_path), VOCAB)
    d = tmp_path / "glob"  # the json reader takes its columns from the first file
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "first"}\n')
    (d / "b.jsonl").write_text('{"text": "second", "id": 2}\n')
    with pytest.raises(DataError, match=rf"{d / 'b.jsonl'} line 1 has column\(s\) \['id'\] that the first file"):
        prepare_data(cfg(source=str(d / "*.jsonl"), tokenizer=tok_path), VOCAB)
    pq = tmp_path / "x.parquet"
    pq.write_bytes(BINARY)
    with pytest.raises(DataError, match=rf"{pq} is not a readable parquet file \(ArrowInvalid"):
        prepare_data(cfg(source=str(pq), tokenizer=tok_path), VOCAB)


def test_empty_dataset_and_all_empty_documents(tmp_path, tok_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="no documents"):
        prepare_data(cfg(source=str(tmp_path / "empty.jsonl"), tokenizer=tok_path), VOCAB)
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    with pytest.raises(DataError, match="all 2 documents .* tokenize to nothing"):
        prepare_data(cfg(source=str(tmp_path / "blank.jsonl"), tokenizer=tok_path), VOCAB)
    # some empty ones are counted, not silently dropped
    (tmp_path / "some.jsonl").write_text('{"text": "hello there"}\n{"text": ""}\n{"text": "more words"}\n')
    prep = prepare_data(cfg(source=str(tmp_path / "some.jsonl"), tokenizer=tok_path, val_fraction=0.0), VOCAB)
    assert prep.meta["documents"] == {"read": 3, "empty_skipped": 1, "kept": 2}


def test_dtype_and_vocab_errors(files, tok_path):
    with pytest.raises(DataError, match="uint16 cannot hold .*vocab_size=70000.*uint32"):
        prepare_data(cfg(source=files["jsonl"], dtype="uint16"), 70000)
    with pytest.raises(DataError, match=r"vocab_size=512 but model.vocab_size=1024"):
        prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path), 1024)
    with pytest.raises(DataError, match="--vocab-size"):
        prepare_data(cfg(source=files["jsonl"]), None)
    with pytest.raises(DataError, match="data.dtype"):
        DataConfig(dtype="int8")
    with pytest.raises(DataError, match="val_fraction"):
        DataConfig(val_fraction=1.0)


def test_hub_source_fails_clearly_offline(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as e:
        prepare_data(cfg(source="someorg/some_corpus", hub_config="en"), VOCAB)
    msg = str(e.value)
    assert "someorg/some_corpus" in msg and "offline" in msg and "network" in msg
    assert "\n" not in msg


def test_check_compatible(files, tok_path):
    prep = prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path), VOCAB)
    check_compatible(prep.meta, VOCAB, 64, Tokenizer(tok_path).sha256)
    check_compatible(prep.dir, VOCAB, 64)
    with pytest.raises(DataError, match=r"data.meta vocab_size=512 but model.vocab_size=32000.*model.vocab_size=512"):
        check_compatible(prep, 32000, 64)
    with pytest.raises(DataError, match="tokenizer sha256"):
        check_compatible(prep.meta, VOCAB, 64, "0" * 64)
    too_long = prep.meta["splits"]["val"]["tokens"]
    with pytest.raises(DataError, match=r"'val' split has \d+ tokens, fewer than seq_len\+1"):
        check_compatible(prep.meta, VOCAB, too_long)
    with pytest.raises(DataError, match=r"'train' split has"):
        check_compatible(prep.meta, VOCAB, 10**9)


def test_truncated_and_corrupted_shards(tmp_path, files, tok_path):
    src = prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path), VOCAB).dir
    d = tmp_path / "copy"
    shutil.copytree(src, d)
    shard = d / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    PackedTokens(d, "train", verify=True)
    # same size, one token changed: only the sha256 check sees it
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    PackedTokens(d, "train")
    prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, prepared_dir=str(d)), VOCAB)
    with pytest.raises(DataError, match="train-00000.bin fails its sha256"):
        PackedTokens(d, "train", verify=True)
    with pytest.raises(DataError, match="fails its sha256"):
        prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, prepared_dir=str(d), verify=True), VOCAB)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=r"train-00000.bin is truncated"):
        PackedTokens(d, "train")
    with pytest.raises(DataError, match=r"train-00000.bin is truncated"):
        prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, prepared_dir=str(d)), VOCAB)
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        PackedTokens(d, "train")
    (d / "meta.json").write_text('{"format": "llama_train.packed_tokens", "vers')
    with pytest.raises(DataError, match="meta.json is corrupt"):
        read_meta(d)
    with pytest.raises(DataError, match="meta.json is corrupt"):
        PackedTokens(d, "train")
    with pytest.raises(DataError, match="does not exist"):
        PackedTokens(tmp_path / "nowhere")


def test_packed_tokens_slices_across_shards(files, tok_path):
    prep = prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, shard_tokens=1000), VOCAB)
    pt = PackedTokens(prep.dir, "train")
    assert len(pt.shards) > 3
    full = np.concatenate([np.fromfile(Path(prep.dir) / s["file"], dtype=np.uint16) for s in pt.shards])
    assert len(pt) == len(full)
    for a, b in [(0, 10), (990, 1010), (999, 1000), (1000, 1001), (500, 3500), (len(full) - 5, len(full))]:
        assert np.array_equal(pt[a:b], full[a:b]), (a, b)
    assert pt[1000] == full[1000] and pt[-1] == full[-1]
    assert len(pt[5:5]) == 0


def test_prepare_records_a_crc32_per_block_of_every_shard(tmp_path, files, tok_path, monkeypatch):
    """Beside each shard, its .crc32 file: the crc32 of every block (the last one shorter) as
    uint32 LE, whose sha256 meta.json records, so a reader checks what it reads without hashing
    whole shards. meta.json stays version 1 (the new keys are optional): the settings
    fingerprint, and so the automatic directory name, does not change."""
    import zlib

    from llama_train.data import prepare as prepare_module

    assert prepare_module.BLOCK_BYTES == 1 << 18
    d = prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path), VOCAB).dir
    monkeypatch.setattr(prepare_module, "BLOCK_BYTES", 256)
    prep = prepare_data(cfg(source=files["jsonl"], tokenizer=tok_path, shard_tokens=1000,
                            prepared_dir=str(tmp_path / "small_blocks")), VOCAB)
    meta = prep.meta
    assert meta["version"] == 1 and meta["block_checksums"] == {"algorithm": "crc32", "block_bytes": 256}
    assert read_meta(d)["fingerprint"] == meta["fingerprint"] and read_meta(prep.dir) == meta
    # the checksums' time, measured while the shards are written: hundreds of 256-byte blocks
    # take a measurable share of tokenize_and_write (which includes it), never more than it
    timing = meta["timing_s"]
    assert 0 < timing["block_checksums"] <= timing["tokenize_and_write"], timing
    partial = 0
    for split in meta["splits"].values():
        for shard in split["shards"]:
            data = (Path(prep.dir) / shard["file"]).read_bytes()
            crc = Path(prep.dir) / shard["block_crc32"]["file"]
            assert crc.name == shard["file"].replace(".bin", ".crc32")
            assert hashlib.sha256(crc.read_bytes()).hexdigest() == shard["block_crc32"]["sha256"]
            assert np.fromfile(crc, "<u4").tolist() == [zlib.crc32(data[i : i + 256]) for i in range(0, len(data), 256)]
            partial += len(data) % 256 != 0
    assert len(meta["splits"]["train"]["shards"]) > 3 and partial >= 2  # 2000-byte shards: 7 blocks + 208 bytes


# --- CLI and configs --------------------------------------------------------------------------
def test_cli_prepare_info_and_errors(tmp_path, files, tok_path, capsys):
    out = tmp_path / "cli"
    rc = cli_main(["prepare", "--source", files["jsonl"], "--tokenizer", tok_path, "--out", str(out),
                   "--val-fraction", "0.1", "--num-proc", "1", "--no-add-bos"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dir"] == str(out) and summary["created"] and summary["tokens"]["train"] > 0
    assert cli_main(["info", str(out), "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["splits"]["train"]["tokens"] == summary["tokens"]["train"]
    assert info["block_checksums"] == {"algorithm": "crc32", "block_bytes": 1 << 18}
    rc = cli_main(["prepare", "--source", str(tmp_path / "missing.txt"), "--vocab-size", "512"])
    assert rc == 2 and "no such file" in capsys.readouterr().err
    rc = cli_main(["train-tokenizer", "--source", files["jsonl"], "--vocab-size", "400",
                   "--out", str(tmp_path / "t" / "m")])
    assert rc == 0 and Tokenizer(tmp_path / "t" / "m.model").vocab_size == 400


def test_config_yamls_are_dataconfig_fields():
    from omegaconf import OmegaConf

    paths = sorted((REPO / "configs" / "data").glob("*.yaml"))
    assert {p.stem for p in paths} >= {"builtin", "local_files", "hub"}
    schema = OmegaConf.structured(DataConfig)
    for p in paths:
        raw = OmegaConf.load(p)
        raw.pop("defaults", None)
        merged = OmegaConf.merge(schema, raw)  # raises on a key that is not a field
        DataConfig.from_any(merged)
    assert DataConfig.from_any(OmegaConf.load(REPO / "configs" / "data" / "builtin.yaml")).source == "builtin"
    with pytest.raises(DataError, match="unknown data config key"):
        DataConfig.from_any({"sorce": "x"})


def test_llama_data_prepares_what_llama_train_reuses(files, tmp_path, monkeypatch, capsys):
    """`llama-data prepare --source '<glob>'` and `llama-train data.source='<glob>'` name the
    same data the same way (llama-train's defaults, a directory named after the source): the
    trainer finds the prepared directory instead of training a tokenizer and preparing again
    (before: other val_fraction default, a `builtin-...` name for local files)."""
    from hydra import compose, initialize_config_dir

    from llama_train.config import load_config
    from llama_train.data import find_prepared
    from llama_train.paths import CONFIG_DIR

    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "cache"))
    glob = str(Path(files["root"]) / "*.jsonl")
    assert cli_main(["prepare", "--source", glob, "--vocab-size", str(VOCAB), "--num-proc", "1"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["created"] and Path(made["dir"]).name.startswith("local-")
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = load_config(compose("config", overrides=[f"data.source='{glob}'",
                                                       f"model.vocab_size={VOCAB}"]))
    found = find_prepared(cfg.data, vocab_size=VOCAB)
    assert found is not None and found.dir == made["dir"]
    assert prepare_data(cfg.data, VOCAB).created is False
