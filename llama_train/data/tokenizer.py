"""SentencePiece BPE tokenizer, trained and used the way LLaMA does.

Settings that matter for exact round trips: identity normalization and no whitespace
collapsing (so `decode(encode(s)) == s` for any text), byte fallback (characters outside the
vocabulary become UTF-8 byte pieces instead of <unk>), digits split one per token.
Special ids: unk=0, bos=1, eos=2, pad=-1 (no pad piece, as in LLaMA: data is packed, so
nothing is ever padded; use ignore_index in the loss if a caller pads).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import DataError

log = logging.getLogger(__name__)

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, -1
# SentencePiece skips, without a word, training lines longer than this many bytes (its
# max_sentence_length): data.tokenizer_max_line_bytes's default, what every tokenizer trained
# before that key existed used. Longer lines are counted here and left out before they reach it
# (the same model), so a source of nothing but long lines is named, not SentencePiece's
# "INTERNAL ... [!sentences_.empty()]".
MAX_LINE_BYTES = 16384


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """A loaded SentencePiece model plus the facts the pipeline checks (ids, size, sha256)."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        self.path = str(model_path)
        if not Path(self.path).is_file():
            raise DataError(
                f"tokenizer model {self.path!r} does not exist: set data.tokenizer to a "
                "SentencePiece .model file, or leave it null to train one"
            )
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.path)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with C++ text
            raise DataError(f"tokenizer model {self.path!r} is not a SentencePiece model: {e}") from e
        self._sha256: str | None = None

    # --- the ids ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self.sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self.sp.unk_id()

    @property
    def sha256(self) -> str:
        """Content hash of the .model file: what shards and checkpoints record."""
        if self._sha256 is None:
            self._sha256 = file_sha256(self.path)
        return self._sha256

    # --- encode / decode -------------------------------------------------------------------
    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        out = self.sp.encode(list(texts))
        if bos or eos:
            pre = [self.bos_id] if bos else []
            post = [self.eos_id] if eos else []
            out = [pre + ids + post for ids in out]
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


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

    if vocab_size < 260:
        raise DataError(
            f"vocab_size={vocab_size} is too small: byte fallback needs 256 byte pieces + "
            "<unk>, <s>, </s>; use vocab_size >= 512"
        )
    prefix = str(model_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    counted = {"sentences": 0}
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
        except Exception as e:
            source_error.append(e)
            raise

    spm.set_random_generator_seed(seed)
    writer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=writer, vocab_size=vocab_size,
            num_threads=num_threads or os.cpu_count() or 1, max_sentence_length=max_line_bytes,
            **_TRAINER_SETTINGS)
    except RuntimeError as e:
        if source_error:
            raise source_error[0] from None
        if long.skipped and long.skipped == long.lines:
            raise DataError(
                f"cannot train a tokenizer on {source}: all {long.lines} of its non-empty lines "
                f"are longer than data.tokenizer_max_line_bytes={max_line_bytes}, the longest "
                f"line a tokenizer is trained on ({long.say()}): {long.fix()}") from None
        raise _training_error(e, vocab_size, counted["sentences"], long) from e
    if long.skipped:
        log.warning("tokenizer training on %s left out %d of %d lines (%s bytes) longer than "
                    "data.tokenizer_max_line_bytes=%d (%s): to train on them, %s", source,
                    long.skipped, long.lines, f"{long.skipped_bytes:,}", max_line_bytes,
                    long.say(), long.fix())
    path = prefix + ".model"
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_normalized_model(writer.getvalue()))
    os.replace(tmp, path)
    # no path: it is usually a temporary directory; the caller names the final one
    log.info("trained a %d-piece tokenizer on %d lines", vocab_size, counted["sentences"])
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
