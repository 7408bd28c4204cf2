"""Llama 3's own tokenizer (issue 53, item 3): a Hugging Face tokenizer.json as data.tokenizer.
Llama 3's 128,256-piece vocabulary is tiktoken-style BPE, not SentencePiece, so its presets
trained on nothing but a padded toy tokenizer; and a preset whose vocabulary the built-in corpus
cannot train failed a minute in, after a dry run that said nothing. Here a small byte-level BPE
trained by the tokenizers library in the test (no hub) goes through the whole path: prepare,
train, resume, export (AutoTokenizer encodes like ours), init_from the export, generate; a
tokenizer too large for model.vocab_size and a Llama 3 preset without one fail at once.
Also (item 4, the data half): tokenizer training and preparation say what they do."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

from helpers import cfg_for, resumed_from
from llama_train.data import DataError
from llama_train.data.tokenizer import file_sha256

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = ["The quick brown fox.", "  two spaces\n\ttab\nnew line", "ünïcödé ☃ 日本語 2024",
         f"a document that names {EOS} and {BOS} as text", ""]


def _docs(n: int):
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)[:n]]


def _bpe(path: Path, vocab: int, specials=(BOS, EOS), template: bool = False) -> Path:
    """A byte-level BPE tokenizer.json trained here on the Python docs (Llama 3's kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_docs(80), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template:  # as Llama 3's: BOS before the text, from its post-processor
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials[0]} $A", special_tokens=[(specials[0], 0)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> Path:
    return _bpe(tmp_path_factory.mktemp("hf_tok"), 1000)


def test_a_tokenizer_json_loads_behind_the_one_interface(hf_tok, tmp_path):
    """Its file or its directory; BOS/EOS by name (Llama 3's) or from the post-processor; the
    whole text encoded, special-token strings in it as text; exact round trips."""
    from llama_train.data import Tokenizer

    tok = Tokenizer(hf_tok)
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == \
        ("huggingface", 1000, 0, 1, -1)
    assert tok.file_name == "tokenizer.json" and tok.sha256 == file_sha256(hf_tok)
    assert Tokenizer(hf_tok.parent).path == str(hf_tok)
    for text in TEXTS:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[0] == 0 and ids[-1] == 1 and 0 not in ids[1:-1] and 1 not in ids[1:-1]
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS, eos=True) == [tok.encode(t, eos=True) for t in TEXTS]

    other = Tokenizer(_bpe(tmp_path / "t", 600, specials=("<|start|>", "</s>"), template=True))
    assert (other.bos_id, other.eos_id) == (0, 1)  # BOS: the template's; EOS: "</s>" by name
    with pytest.raises(DataError, match="data.tokenizer.*no end-of-text token.*add_special_tokens"):
        Tokenizer(_bpe(tmp_path / "none", 600, specials=("<unk>",)))


def test_prepare_train_resume_export_with_a_tokenizer_json(hf_tok, tmp_path):
    """The tokenizer kept with the shards (tokenizer.json, hashed in meta.json and the data's
    fingerprint), in the checkpoint (resume checks it), in the export (AutoTokenizer encodes as
    we do); init_from the export reuses the data; llama-generate reads it."""
    import transformers

    from llama_train.checkpoint import resolve_checkpoint
    from llama_train.config import ConfigError
    from llama_train.data import Tokenizer
    from llama_train.hf import check_init_from_tokenizer, export_main
    from llama_train.inference.generate import load
    from llama_train.job.preflight import preflight
    from llama_train.train import train

    out, sha = tmp_path / "run", file_sha256(hf_tok)
    args = (f"data.tokenizer={hf_tok.parent}", "model.vocab_size=1000", "data.max_documents=120",
            "trainer.save_every=1", "sample.tokens=4")
    train(cfg_for(out, *args, "trainer.max_steps=2"))
    ckpt = resolve_checkpoint(out)
    saved = json.loads((ckpt / "model_args.json").read_text())
    assert saved["vocab_size"] == 1000
    cfg = cfg_for(out, *args)
    assert cfg.data.tokenizer == str(hf_tok)  # the directory read as its tokenizer.json
    pf = preflight(cfg_for(tmp_path / "look", *args))
    pf.release()
    meta = pf.prepared.meta
    assert meta["tokenizer"]["kind"] == "huggingface" and meta["tokenizer"]["sha256"] == sha
    assert meta["tokenizer"]["eos_id"] == 1 and meta["vocab_size"] == 1000
    assert Path(pf.prepared.tokenizer_path).name == "tokenizer.json"
    assert file_sha256(pf.prepared.tokenizer_path) == sha
    assert meta["settings"]["tokenizer"]["sha256"] == sha
    assert any(file_sha256(f) == sha for f in ckpt.glob("tokenizer.*"))

    train(cfg_for(out, *args, "trainer.max_steps=3"))  # resumes, its tokenizer checked
    assert resumed_from(out) and resolve_checkpoint(out).name == "step_00000003"

    hf = tmp_path / "hf"
    export_main([str(out), str(hf)])
    assert (hf / "tokenizer.json").read_bytes() == hf_tok.read_bytes()
    assert not (hf / "tokenizer.model").exists()
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf))
    ours = Tokenizer(hf_tok)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text), text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
    config = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (0, 1, 1000)

    loaded = load(str(hf))  # llama-generate: the export's tokenizer through data.Tokenizer
    assert loaded.tokenizer.kind == "huggingface" and loaded.tokenizer.sha256 == sha
    assert load(str(out)).tokenizer.sha256 == sha  # and the checkpoint's

    # init_from the export: its tokenizer.json is the weights' tokenizer, the data is reused
    pf = preflight(cfg_for(tmp_path / "from_export", "model.vocab_size=1000",
                           "data.max_documents=120", f"trainer.init_from={hf}"))
    pf.release()
    assert pf.cfg.data.tokenizer == str(hf / "tokenizer.json")
    assert pf.prepared.meta["tokenizer"]["sha256"] == sha and not pf.prepared.created
    copy = tmp_path / "copy.json"  # the same tokenizer elsewhere is init_from's; another is not
    shutil.copyfile(hf_tok, copy)
    assert check_init_from_tokenizer(str(hf), str(copy), 1000) == str(copy)
    with pytest.raises(ConfigError, match="data.tokenizer=.*900 tokens, not 1000"):
        check_init_from_tokenizer(str(hf), str(_bpe(tmp_path / "other", 900)), 1000)


def test_the_export_prepends_bos_as_training_did(hf_tok, tmp_path):
    """transformers applies a tokenizer.json's post-processor as it is: with data.add_bos the
    export's has one that prepends BOS, and a Llama 3-like one (BOS in its template) is kept
    byte for byte where training prepended BOS too."""
    import torch
    import transformers

    from llama_train.data import Tokenizer
    from llama_train.hf import export_hf
    from llama_train.model import ModelArgs, Transformer

    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=1024, max_seq_len=32)
    torch.manual_seed(0)
    sd = Transformer(args).state_dict()
    ours = Tokenizer(hf_tok)
    for add_bos, tok in ((True, hf_tok), (True, _bpe(tmp_path / "l3", 1000, template=True)),
                         (False, _bpe(tmp_path / "l3b", 1000, template=True))):
        hf = export_hf(args, sd, tmp_path / f"hf_{tok.parent.name}_{add_bos}",
                       tokenizer_model=tok, add_bos=add_bos)
        theirs = transformers.AutoTokenizer.from_pretrained(str(hf))
        for text in TEXTS[:3]:
            assert theirs(text)["input_ids"] == ours.encode(text, bos=add_bos), (tok, add_bos)
        kept = (hf / "tokenizer.json").read_bytes() == tok.read_bytes()
        assert kept == (add_bos and tok.parent.name == "l3")


def test_a_smaller_tokenizer_json_fits_a_larger_vocabulary(hf_tok, tmp_path):
    """A tokenizer.json may be smaller than model.vocab_size (the extra rows stay unused); a
    SentencePiece model must still match exactly."""
    from llama_train.data import DataConfig, check_compatible, prepare_data

    cfg = DataConfig(source="builtin", tokenizer=str(hf_tok), max_documents=40, num_proc=1,
                     prepared_dir=str(tmp_path / "p"))
    prepared = prepare_data(cfg, vocab_size=1024)
    assert prepared.meta["vocab_size"] == 1000
    check_compatible(prepared.meta, 1024, 64)
    with pytest.raises(DataError, match="model.vocab_size=999"):
        check_compatible(prepared.meta, 999, 64)


def _refused_at_once(cfg, match: str, monkeypatch) -> None:
    """preflight and the dry run refuse ``cfg`` within seconds, before any data is prepared."""
    from llama_train.data import prepare as prepare_module
    from llama_train.job.dry_run import dry_run
    from llama_train.job.preflight import preflight

    def prepared(*a, **k):
        raise AssertionError("data preparation started")

    monkeypatch.setattr(prepare_module, "_prepare_into", prepared)
    for check in (preflight, dry_run):
        t0 = time.perf_counter()
        with pytest.raises(DataError, match=match):
            check(cfg)
        assert time.perf_counter() - t0 < 5, check.__name__


def test_a_tokenizer_too_large_for_the_model_is_refused_at_once(hf_tok, tmp_path, monkeypatch):
    out = tmp_path / "run"
    _refused_at_once(cfg_for(out, f"data.tokenizer={hf_tok}", "model.vocab_size=999"),
                     r"data.tokenizer=.*1000 tokens.*model.vocab_size=999.*model.vocab_size=1000",
                     monkeypatch)
    from llama_train.data import train_tokenizer

    sp = train_tokenizer(_docs(40), 512, tmp_path / "sp")  # SentencePiece: exactly the size
    _refused_at_once(cfg_for(out, f"data.tokenizer={sp}", "model.vocab_size=1000"),
                     r"data.tokenizer=.*vocab_size=512 but model.vocab_size=1000", monkeypatch)
    assert not out.exists() or not any(out.iterdir())


def test_a_llama3_preset_without_a_tokenizer_fails_fast(tmp_path, monkeypatch):
    """The built-in corpus cannot train 128,256 pieces: said at once, naming data.tokenizer
    and a tokenizer.json, not by SentencePiece after the corpus was read."""
    _refused_at_once(cfg_for(tmp_path / "run", "model=llama3_8b"),
                     r"data.tokenizer.*model.vocab_size=128256.*tokenizer.json", monkeypatch)


def test_tokenizer_training_and_preparation_say_what_they_do(tmp_path, monkeypatch, caplog):
    """A line when each starts, how much; progress lines while SentencePiece trains (it says
    nothing for minutes on a large corpus); counts and seconds at the end."""
    from llama_train.data import DataConfig, prepare_data
    from llama_train.data import tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "PROGRESS_EVERY_S", 0.01)
    src = tmp_path / "docs.jsonl"
    docs = _docs(80)  # all of them: 79 pages
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = DataConfig(source=str(src), num_proc=1, prepared_dir=str(tmp_path / "p"))
    with caplog.at_level(logging.INFO, logger="llama_train"):
        prepare_data(cfg, vocab_size=2048)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("training a 2048-piece tokenizer") for m in said), said
    assert any("tokenizer training on" in m and "lines" in m for m in said), said
    assert any(m.startswith("trained a 2048-piece tokenizer on") and " s" in m for m in said)
    assert any(m.startswith("tokenizing data.source=") and f"{len(docs)} documents" in m
               for m in said), said
    assert any(m.startswith("prepared ") and f"{len(docs)} docs" in m for m in said), said
