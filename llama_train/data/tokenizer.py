"""The tokenizer: SentencePiece BPE trained and used the way LLaMA does, or a Hugging Face
``tokenizer.json`` (Llama 3's 128,256-piece tiktoken-style BPE is not SentencePiece), behind one
interface, :class:`Tokenizer`.

SentencePiece settings that matter for exact round trips: identity normalization and no whitespace
collapsing (so `decode(encode(s)) == s` for any text), byte fallback (characters outside the
vocabulary become UTF-8 byte pieces instead of <unk>), digits split one per token.
Special ids: unk=0, bos=1, eos=2, pad=-1 (no pad piece, as in LLaMA: data is packed, so
nothing is ever padded; use ignore_index in the loss if a caller pads).

A Hugging Face tokenizer is read through the ``tokenizers`` library (no transformers). Its
text is encoded with no added special tokens and special-token strings in the text taken as
text (as Meta's Llama 3 encoder does), so a document holding "<|end_of_text|>" cannot end early.
BOS and EOS are read from the tokenizer.json alone (it is what travels with the shards,
checkpoints and exports): the special tokens its post-processor puts before and after the text,
else the first of :data:`BOS_NAMES` / :data:`EOS_NAMES` among its special tokens. No EOS is an
error: every document ends with one in packing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NoReturn, Optional

from .errors import DataError

log = logging.getLogger(__name__)

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, -1
# SentencePiece skips, without a word, training lines longer than this many bytes (its
# max_sentence_length): data.tokenizer_max_line_bytes's default, what every tokenizer trained
# before that key existed used. Longer lines are counted here and left out before they reach it
# (the same model), so a source of nothing but long lines is named, not SentencePiece's
# "INTERNAL ... [!sentences_.empty()]".
MAX_LINE_BYTES = 16384

SENTENCEPIECE, HUGGINGFACE = "sentencepiece", "huggingface"
# The name each kind is kept under beside the shards and in an export.
FILE_NAMES = {SENTENCEPIECE: "tokenizer.model", HUGGINGFACE: "tokenizer.json"}
# The document-end and -start specials of the tokenizers LLaMA-family and other open models ship
# (Llama 3; Llama 2 and Mistral; GPT-2, NeoX, Qwen, Phi; Gemma), in the order they are tried.
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
# llama-export's key in tokenizer_config.json naming the file that is the tokenizer the weights
# were trained with: a SentencePiece export's tokenizer.json is only a conversion of it.
EXPORT_KEY = "llama_train_tokenizer"
# Seconds between progress lines of a step that is otherwise silent (tokenizer training).
PROGRESS_EVERY_S = 20.0


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_json(path: Path) -> bool:
    """A Hugging Face tokenizer.json (JSON), not a SentencePiece model (protobuf, whose first
    byte is never "{"): told by content, as a checkpoint keeps either as tokenizer.model."""
    if path.suffix == ".json":
        return True
    with open(path, "rb") as f:
        return f.read(64).lstrip()[:1] == b"{"


def tokenizer_file_in(directory: str | os.PathLike) -> Optional[Path]:
    """The tokenizer file of a model directory (a Hugging Face one, llama-export's): the file its
    tokenizer_config.json names as the weights' own (llama-export's :data:`EXPORT_KEY`; missing:
    None), else ``tokenizer.model`` where it is SentencePiece (not Llama 3's tiktoken text file
    of that name), else ``tokenizer.json``; None if there is none. Reads no more than a byte of
    each: loading is the caller's, with its own message."""
    d = Path(directory)
    try:
        named = json.loads((d / "tokenizer_config.json").read_text()).get(EXPORT_KEY)
    except (OSError, ValueError, AttributeError):
        named = None
    if named:
        return d / named if (d / named).is_file() else None
    model = d / FILE_NAMES[SENTENCEPIECE]
    if model.is_file():
        with open(model, "rb") as f:
            if f.read(1) == b"\n":  # protobuf field 1 (the pieces): a SentencePiece model
                return model
    hf = d / FILE_NAMES[HUGGINGFACE]
    return hf if hf.is_file() else None


def _template_specials(post: Optional[dict]) -> tuple:
    """(token before, token after) the text in a post-processor's single-sequence template."""
    if not isinstance(post, dict):
        return None, None
    kind = post.get("type")
    if kind == "Sequence":
        for p in post.get("processors", []):
            found = _template_specials(p)
            if found != (None, None):
                return found
    elif kind == "TemplateProcessing":
        items = [next(iter(i.items())) for i in post.get("single", [])]
        kinds = [k for k, _ in items]
        at = kinds.index("Sequence") if "Sequence" in kinds else 0
        before = [v["id"] for k, v in items[:at] if k == "SpecialToken"]
        after = [v["id"] for k, v in items[at + 1:] if k == "SpecialToken"]
        return (before[-1] if before else None), (after[0] if after else None)
    elif kind in ("BertProcessing", "RobertaProcessing"):
        return post["cls"][0], post["sep"][0]
    return None, None


class Tokenizer:
    """A loaded tokenizer, SentencePiece (a .model) or Hugging Face (a tokenizer.json, or a
    directory holding one), plus the facts the pipeline checks: ``kind``, the special ids, the
    size and the sha256 of the file. One interface for both."""

    def __init__(self, model_path: str | os.PathLike):
        p = Path(model_path).expanduser()
        if p.is_dir():
            found = tokenizer_file_in(p)
            if found is None:
                raise DataError(
                    f"tokenizer directory {str(p)!r} holds no tokenizer: set data.tokenizer to a "
                    "SentencePiece .model, a Hugging Face tokenizer.json or a directory holding "
                    "one (a Hugging Face model's), or leave it null to train one")
            p = found
        self.path = str(p)
        if not p.is_file():
            raise DataError(
                f"tokenizer model {self.path!r} does not exist: set data.tokenizer to a "
                "SentencePiece .model file or a Hugging Face tokenizer.json, or leave it null to "
                "train one"
            )
        self.sp = self.hf = None
        self._sha256: str | None = None
        if _is_json(p):
            self.kind = HUGGINGFACE
            self._ids = self._load_hf()
            return
        import sentencepiece as spm

        self.kind = SENTENCEPIECE
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.path)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with C++ text
            raise DataError(f"tokenizer model {self.path!r} is not a SentencePiece model: {e}") from e
        self._ids = {"vocab_size": self.sp.get_piece_size(), "bos": self.sp.bos_id(),
                     "eos": self.sp.eos_id(), "pad": self.sp.pad_id(), "unk": self.sp.unk_id()}

    def _load_hf(self) -> dict:
        """Load a tokenizer.json; its size and special ids (-1: none)."""
        from tokenizers import Tokenizer as HFTokenizer

        bad = f"tokenizer {self.path!r} is not a Hugging Face tokenizer.json"
        try:
            text = Path(self.path).read_text(encoding="utf-8")
            spec = json.loads(text)
            self.hf = HFTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - JSON or the tokenizers library's own errors
            raise DataError(f"{bad}: {str(e).splitlines()[0][:300]}") from None
        if not isinstance(spec, dict):
            raise DataError(f"{bad}: not a JSON object")
        # the whole text, always: a tokenizer.json may carry truncation or padding settings
        self.hf.no_truncation()
        self.hf.no_padding()
        self.hf.encode_special_tokens = True  # "<|end_of_text|>" in a document is text
        special = {t["content"]: t["id"] for t in spec.get("added_tokens") or []
                   if isinstance(t, dict) and t.get("special")}
        size = max([self.hf.get_vocab_size(with_added_tokens=True),
                    *(i + 1 for i in special.values())])

        def pick(template: Optional[str], names: tuple) -> int:
            if template is not None and self.hf.token_to_id(template) is not None:
                return self.hf.token_to_id(template)
            return next((special[n] for n in names if n in special), -1)

        before, after = _template_specials(spec.get("post_processor"))
        bos, eos = pick(before, BOS_NAMES), pick(after, EOS_NAMES)
        if eos < 0:
            raise DataError(
                f"tokenizer {self.path!r} (data.tokenizer) has no end-of-text token: documents "
                f"end with one in packing, and its post-processor appends none and none of "
                f"{', '.join(EOS_NAMES)} is among its special tokens "
                f"({', '.join(sorted(special)[:8]) or 'none'}). Add it as a special token "
                "(tokenizer.add_special_tokens([...]) in the tokenizers library) and save the "
                "tokenizer.json again")
        unk = (spec.get("model") or {}).get("unk_token")
        unk_id = self.hf.token_to_id(unk) if isinstance(unk, str) else None
        pad = (spec.get("padding") or {}).get("pad_id")
        return {"vocab_size": int(size), "bos": bos, "eos": eos,
                "pad": pad if isinstance(pad, int) else -1,
                "unk": unk_id if unk_id is not None else -1}

    # --- the ids ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids are below it: a tokenizer.json's added tokens (Llama 3's 256 specials) count."""
        return self._ids["vocab_size"]

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def unk_id(self) -> int:
        return self._ids["unk"]

    @property
    def file_name(self) -> str:
        """The name it is kept under beside the shards: tokenizer.model or tokenizer.json."""
        return FILE_NAMES[self.kind]

    def id_to_token(self, i: int) -> Optional[str]:
        """The piece (SentencePiece) or token (Hugging Face) of id ``i``."""
        return self.sp.id_to_piece(i) if self.sp is not None else self.hf.id_to_token(i)

    @property
    def sha256(self) -> str:
        """Content hash of the file (.model or tokenizer.json): what shards and checkpoints
        record."""
        if self._sha256 is None:
            self._sha256 = file_sha256(self.path)
        return self._sha256

    # --- encode / decode -------------------------------------------------------------------
    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = (self.sp.encode(text) if self.sp is not None
               else self.hf.encode(text, add_special_tokens=False).ids)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        if self.sp is not None:
            out = self.sp.encode(list(texts))
        else:
            out = [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]
        if bos or eos:
            pre = [self.bos_id] if bos else []
            post = [self.eos_id] if eos else []
            out = [pre + ids + post for ids in out]
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (BOS, EOS) leave none, as in SentencePiece."""
        ids = [int(i) for i in ids]
        if self.sp is not None:
            return self.sp.decode(ids)
        return self.hf.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path!r}, {self.kind}, vocab_size={self.vocab_size}, "
                f"sha256={self.sha256[:12]})")


def fits(kind: Optional[str], tokenizer_size: int, vocab_size: int) -> bool:
    """Whether a tokenizer's ids feed a model of ``vocab_size``. A SentencePiece tokenizer's
    size must be the model's (it is trained, or padded, to that size); a Hugging Face one's may
    be smaller (the extra embedding rows never see a token, as in models whose published
    vocabulary is padded beyond their tokenizer's). ``kind`` None: SentencePiece (meta.json
    written before Hugging Face tokenizers)."""
    if kind == HUGGINGFACE:
        return tokenizer_size <= vocab_size
    return tokenizer_size == vocab_size


def size_error(tok: "Tokenizer", vocab_size: int, key: str = "data.tokenizer") -> Optional[str]:
    """None where ``tok`` fits ``vocab_size`` (:func:`fits`), else the refusal: both sizes and
    the fix, naming ``key`` (the setting that chose the tokenizer)."""
    if fits(tok.kind, tok.vocab_size, vocab_size):
        return None
    if tok.kind == HUGGINGFACE:
        return (f"{key}={tok.path} has {tok.vocab_size} tokens (special tokens included) but "
                f"model.vocab_size={vocab_size}: token ids would fall outside the embedding. Set "
                f"model.vocab_size={tok.vocab_size} (or larger: the extra rows stay unused), or "
                f"use the model's own tokenizer")
    return (f"{key}={tok.path} has vocab_size={tok.vocab_size} but model.vocab_size="
            f"{vocab_size}: set model.vocab_size={tok.vocab_size} or use a tokenizer of the "
            f"model's size (a SentencePiece model must match it exactly)")


def _normalized_model(proto: bytes) -> bytes:
    """Drop the machine-specific trainer fields (output path, thread count) from the model.

    Why: the model file's sha256 identifies the tokenizer in meta.json and checkpoints, so two
    machines training on the same text must write identical bytes. Needs protobuf (a dependency
    of wandb); without it the raw model is kept (still valid, hash then depends on num_threads).
    """
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:  # pragma: no cover - protobuf missing
        return proto
    m = pb.ModelProto()
    m.ParseFromString(proto)
    for name in ("model_prefix", "num_threads", "input"):
        m.trainer_spec.ClearField(name)
    return m.SerializeToString(deterministic=True)


def _numbered_lines(texts: Iterable[str], max_sentences: int) -> Iterator[tuple]:
    """Documents split into non-empty lines, the unit SentencePiece trains on: (document,
    line, text), numbered from 1, the first `max_sentences` of them (0: all)."""
    n = 0
    for doc, text in enumerate(texts, 1):
        for i, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            yield doc, i, line
            n += 1
            if max_sentences and n >= max_sentences:
                return


class _Progress:
    """A log line every :data:`PROGRESS_EVERY_S` seconds, from a thread, while a step that says
    nothing runs (SentencePiece's training releases the GIL): ``say()`` is the line. Why: on a
    large corpus tokenizer training was minutes of silence, read as a hang."""

    def __init__(self, say):
        self.say, self._stop = say, threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenizer-progress", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY_S):
            log.info("%s", self.say())

    def __enter__(self) -> "_Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class _LongLines:
    """The training lines longer than SentencePiece takes: how many, their bytes, the longest
    and where it is (``where(document, line)``)."""

    def __init__(self, max_bytes: int, where):
        self.max_bytes, self.where = max_bytes, where
        self.lines = self.skipped = self.skipped_bytes = self.longest = 0
        self.longest_at = ""

    def too_long(self, doc: int, i: int, line: str) -> bool:
        self.lines += 1
        if len(line) * 4 <= self.max_bytes:  # UTF-8: at most 4 bytes a character
            return False
        n = len(line.encode("utf-8", "surrogatepass"))
        if n <= self.max_bytes:
            return False
        self.skipped += 1
        self.skipped_bytes += n
        if n > self.longest:
            self.longest, self.longest_at = n, self.where(doc, i)
        return True

    def say(self) -> str:
        return (f"the longest, {self.longest:,} bytes, is {self.longest_at}")

    def fix(self) -> str:
        return (f"put line breaks in the text (the tokenizer trains on lines: one a sentence or "
                f"paragraph), raise data.tokenizer_max_line_bytes above {self.longest} (time "
                f"and memory grow with it), or set data.tokenizer= to a trained .model")


# LLaMA's SentencePiece recipe: byte-fallback BPE, digits split, no normalization and no
# whitespace collapsing (exact round trips). Part of the prepared-data fingerprint through
# meta.TOKENIZER_RECIPE: bump that when changing anything here.
_TRAINER_SETTINGS = dict(
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    split_by_unicode_script=True,
    split_by_whitespace=True,
    character_coverage=0.99995,
    allow_whitespace_only_pieces=True,
    remove_extra_whitespaces=False,
    normalization_rule_name="identity",
    add_dummy_prefix=True,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
    minloglevel=2,
)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    model_prefix: str | os.PathLike,
    *,
    max_sentences: int = 1_000_000,
    seed: int = 1234,
    num_threads: int | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
    source: str = "this source",
    where=None,
) -> str:
    """Train a LLaMA-style BPE model on `texts`; writes `<model_prefix>.model` and returns its path.

    `max_sentences` caps the lines read (the first N non-empty lines) so training stays fast on
    large sources; BPE merges saturate long before that on natural text. The same texts give a
    byte-identical model file (same sha256) whatever the path, thread count or machine.
    Lines longer than `max_line_bytes` are left out (SentencePiece's own limit): a warning says
    how many, a DataError if no line is left. `source` and `where(document, line) -> str` name
    them in those messages.
    """
    import io

    import sentencepiece as spm

    _check_vocab_size(vocab_size)
    prefix = str(model_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    counted = {"sentences": 0, "all_read": False}
    source_error: list[BaseException] = []
    long = _LongLines(max_line_bytes, where or (lambda doc, i: f"line {i} of document {doc}"))

    def sentences() -> Iterator[str]:
        # SentencePiece stops at an exception raised inside its iterator but turns it into a
        # RuntimeError carrying a traceback: keep the source's own error (a DataError naming
        # the file and row) to raise as it is.
        try:
            for doc, i, s in _numbered_lines(texts, max_sentences):
                counted["sentences"] += 1
                if not long.too_long(doc, i, s):  # SentencePiece would skip it: the same model
                    yield s
            counted["all_read"] = True
        except Exception as e:
            source_error.append(e)
            raise

    t0 = time.perf_counter()
    spm.set_random_generator_seed(seed)
    writer = io.BytesIO()
    try:
        with _Progress(_progress_line(source, vocab_size, counted, t0)):
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(), model_writer=writer, vocab_size=vocab_size,
                num_threads=num_threads or os.cpu_count() or 1,
                max_sentence_length=max_line_bytes, **_TRAINER_SETTINGS)
    except RuntimeError as e:
        _raise_training_failure(e, source_error, long, source, vocab_size, counted["sentences"])
    if long.skipped:
        log.warning("tokenizer training on %s left out %d of %d lines (%s bytes) longer than "
                    "data.tokenizer_max_line_bytes=%d (%s): to train on them, %s", source,
                    long.skipped, long.lines, f"{long.skipped_bytes:,}", max_line_bytes,
                    long.say(), long.fix())
    path = _write_model(prefix, writer.getvalue())
    # no path: it is usually a temporary directory; the caller names the final one
    log.info("trained a %d-piece tokenizer on %d lines in %.1f s", vocab_size,
             counted["sentences"], time.perf_counter() - t0)
    return path


def _check_vocab_size(vocab_size: int) -> None:
    """Refuse a vocabulary too small for byte fallback before any text is read."""
    if vocab_size < 260:
        raise DataError(
            f"vocab_size={vocab_size} is too small: byte fallback needs 256 byte pieces + "
            "<unk>, <s>, </s>; use vocab_size >= 512"
        )


def _progress_line(source: str, vocab_size: int, counted: dict, t0: float):
    """The line :class:`_Progress` logs while training runs: what stage it is in, so far."""
    def progress() -> str:
        n, s = counted["sentences"], time.perf_counter() - t0
        if not n:
            return f"tokenizer training on {source}: opening the source ({s:.0f} s)"
        if not counted["all_read"]:
            return f"tokenizer training on {source}: {n:,} lines read ({s:.0f} s)"
        return (f"tokenizer training on {source}: learning {vocab_size:,} pieces from {n:,} "
                f"lines ({s:.0f} s)")

    return progress


def _raise_training_failure(e: RuntimeError, source_error: list, long: "_LongLines",
                            source: str, vocab_size: int, sentences: int) -> NoReturn:
    """Raise what SentencePiece's RuntimeError ``e`` stands for (call it in the ``except``)."""
    if source_error:
        raise source_error[0] from None
    if long.skipped and long.skipped == long.lines:
        raise DataError(
            f"cannot train a tokenizer on {source}: all {long.lines} of its non-empty lines "
            f"are longer than data.tokenizer_max_line_bytes={long.max_bytes}, the longest "
            f"line a tokenizer is trained on ({long.say()}): {long.fix()}") from None
    raise _training_error(e, vocab_size, sentences, long) from e


def _write_model(prefix: str, model: bytes) -> str:
    """Write the trained model, normalized, atomically to ``<prefix>.model``; returns its path."""
    path = prefix + ".model"
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_normalized_model(model))
    os.replace(tmp, path)
    return path


def _training_error(e: RuntimeError, vocab_size: int, sentences: int,
                    long: "_LongLines | None" = None) -> DataError:
    """SentencePiece's training failure, said in terms of the source and data.* settings."""
    msg = str(e)
    if long is not None and long.skipped:  # what is left may be too little: say what is not
        msg += (f" ({long.skipped} of the {long.lines} lines were left out as longer than "
                f"data.tokenizer_max_line_bytes={long.max_bytes}; {long.say()})")
    if sentences == 0:
        return DataError("cannot train a tokenizer: the source has no non-empty text")
    if "smaller than required_chars" in msg:
        return DataError(
            f"vocab_size={vocab_size} is too small for this source: its characters plus the "
            f"256 byte pieces and specials need more. Raise vocab_size. SentencePiece said: {msg}"
        )
    if "Vocabulary size" in msg or "vocab_size" in msg:
        return DataError(
            f"cannot train a tokenizer with vocab_size={vocab_size} on this source "
            f"({sentences} lines): it has too few distinct pieces. Use a larger "
            f"source or a smaller vocab_size. SentencePiece said: {msg}"
        )
    return DataError(f"SentencePiece training failed: {msg}")


def pad_vocabulary(src: str | os.PathLike, dst: str | os.PathLike, size: int) -> Path:
    """``src`` (a SentencePiece model) with unused pieces appended up to ``size`` ids, at ``dst``.

    Why: a large-vocabulary shape (Llama 3's 128256) measured on a corpus too small to train a
    tokenizer that large (``launch/gpu_check.sh``): the embedding and the logits have the real
    width, and text encodes exactly as with ``src`` (UNUSED pieces are never produced). The same
    ``src`` always gives the same bytes, so prepared data keyed by the tokenizer's sha256 is
    found again wherever it is made. Written atomically; left alone if already the same."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(Path(src).read_bytes())
    if len(m.pieces) > size:
        raise DataError(f"{src} has {len(m.pieces)} pieces, more than the {size} asked for")
    for i in range(len(m.pieces), size):
        p = m.pieces.add()
        p.piece, p.score, p.type = f"<unused_{i}>", 0.0, pb.ModelProto.SentencePiece.UNUSED
    data, dst = m.SerializeToString(), Path(dst)
    if not (dst.is_file() and dst.read_bytes() == data):
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    return dst
