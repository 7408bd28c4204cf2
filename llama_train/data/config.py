"""DataConfig: the `data` group of the Hydra config (configs/data/*.yaml), and the entries of
``data.mixture`` (MixtureEntry) with their checks. Imports nothing else of the data package but
its errors: every other module of it reads this one."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from .errors import DataError
from llama_train.bounds import INT32_MAX, INT64_MAX, SEED_MAX, Range
from llama_train.policy import may_change

DTYPES = ("auto", "uint16", "uint32")
# Each shard is a file (and its .crc32) opened, mapped and checked on its own: one per 512
# tokens is already ~2,000 files per million tokens, and fewer tokens per file only multiply
# them (data.shard_tokens=1 wrote 26,175 files for 20 documents). A shard of 2**40 tokens is a
# multi-terabyte file.
MIN_SHARD_TOKENS = 512
RANGES = {
    "val_fraction": Range(0, 1, hi_open=True, fix="the fraction of documents held out"),
    # processes forked at once: more than any machine has cores is a fork bomb, not speed
    "num_proc": Range(0, 1024, integer=True, fix="tokenization processes, 0 for all cores "
                                                 "(at most 8)"),
    "shard_tokens": Range(MIN_SHARD_TOKENS, 2**40, integer=True,
                          fix="tokens per shard file (default 50000000)"),
    "num_workers": Range(0, 64, integer=True, fix="DataLoader processes per rank (0: in the "
                                                  "rank's own process)"),
    "seed": Range(0, SEED_MAX, integer=True, fix="SentencePiece's seed is unsigned 32-bit"),
    "max_documents": Range(1, INT64_MAX, integer=True, optional=True,
                           fix="documents read from the source, null for all"),
    "tokenizer_max_sentences": Range(0, INT64_MAX, integer=True,
                                     fix="lines a tokenizer is trained on, 0 for all"),
    "tokenizer_max_line_bytes": Range(1, INT32_MAX, integer=True,
                                      fix="SentencePiece's max_sentence_length is an int32"),
}
SAMPLE_BY = ("document", "paragraph", "line")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a mixture entry's name


@dataclass
class MixtureEntry:
    """One source of ``data.mixture``: a name (metric keys, directory names), any source
    ``data.source`` accepts, and a weight (relative; 0 = evaluated, never trained on)."""

    name: str = ""
    source: str = ""
    weight: float = 1.0
    text_column: Optional[str] = None  # None: data.text_column
    hub_config: Optional[str] = None  # None: data.hub_config
    split: Optional[str] = None  # None: data.split


def check_entries(entries: Sequence[MixtureEntry]) -> None:
    """Refuse a mixture that cannot be trained on, naming the entry (before any data is read)."""
    seen = {}
    for i, e in enumerate(entries):
        where = f"data.mixture[{i}]" + (f" ({e.name})" if e.name else "")
        if not e.name or not _NAME.match(str(e.name)):
            raise DataError(f"{where}: name={e.name!r} must be a non-empty name of letters, "
                            f"digits, '_', '.' or '-' (it names the val_loss/<name> metric and "
                            f"the source's directory)")
        if e.name in seen:
            raise DataError(f"{where}: name {e.name!r} is also data.mixture[{seen[e.name]}]'s: "
                            f"give every source its own name")
        seen[e.name] = i
        if not e.source:
            raise DataError(f"{where}: source is empty: set it to 'builtin', a hub dataset name "
                            f"or a local file, directory or glob")
        try:
            w = float(e.weight)
        except (TypeError, ValueError):
            w = float("nan")
        if not math.isfinite(w) or w < 0:
            raise DataError(f"{where}: weight={e.weight!r} must be a finite number >= 0 "
                            f"(weights are relative: 3 and 1 draw 75% and 25% of the windows)")
    if entries and sum(float(e.weight) for e in entries) <= 0:
        raise DataError(f"data.mixture: all {len(entries)} weights are 0: give at least one "
                        f"source a weight > 0")


def as_entries(items: Any) -> List[MixtureEntry]:
    """data.mixture as given (dicts from YAML or the command line, or entries) -> entries."""
    out = []
    for i, item in enumerate(items or []):
        if isinstance(item, MixtureEntry):
            out.append(item)
            continue
        if not isinstance(item, dict):
            from omegaconf import DictConfig, OmegaConf

            if not isinstance(item, DictConfig):
                raise DataError(f"data.mixture[{i}]={item!r} must be a mapping "
                                f"{{name: ..., source: ..., weight: ...}}")
            item = OmegaConf.to_container(item, resolve=True)
        unknown = sorted(set(item) - set(MixtureEntry.__dataclass_fields__))
        if unknown:
            raise DataError(f"data.mixture[{i}]: unknown key(s) {unknown}; valid keys: "
                            f"{sorted(MixtureEntry.__dataclass_fields__)}")
        out.append(MixtureEntry(**item))
    return out


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and packed, and how it is loaded.

    Fields that change the tokens (source, tokenizer, split, column, val_fraction, add_bos,
    dtype, max_documents, text_sample_by, tokenizer_max_sentences, tokenizer_max_line_bytes when
    not its default) are hashed into the prepared
    directory name; the rest (num_proc, shard_tokens, num_workers, ...) only change speed/layout.
    """

    name: Optional[str] = may_change(None)
    """Prefix of the prepared directory name under the cache: `<name>-<settings hash>`. None:
    from the source (`builtin`, `local` for files, the hub dataset's name), so `llama-data` and
    `llama-train` name the same data the same way."""
    source: str = "builtin"
    """`builtin` (Python docs + stdlib docstrings/comments), a HF hub dataset name, or a local
    file / directory / glob of .txt, .jsonl, .json or .parquet files."""
    mixture: List[MixtureEntry] = field(default_factory=list)
    """Several sources at set proportions, in place of `source`: a list of `{name, source,
    weight}` (optional per entry: text_column, hub_config, split). One tokenizer for all (given,
    or trained on the mixture in proportion to the weights); each source prepared into its own
    shards; training windows drawn in proportion to the weights (llama_train.data.mixture)."""
    hub_config: Optional[str] = None
    """Hub dataset configuration name (the second argument of `datasets.load_dataset`)."""
    split: str = "train"
    """Hub split to read. Local files are always read whole (the builders call it `train`)."""
    text_column: str = "text"
    streaming: bool = may_change(False)
    """Stream the source instead of materializing it in the HF cache (large hub datasets)."""
    text_sample_by: str = "document"
    """For .txt files: one document per `document` (file), `paragraph` or `line`."""
    tokenizer: Optional[str] = may_change(None)
    """Path to a SentencePiece .model, a Hugging Face tokenizer.json, or a directory holding
    either (a Hugging Face model's: read as the file in it, see tokenizer.tokenizer_file_in).
    A SentencePiece model's size must be model.vocab_size; a tokenizer.json's may be smaller.
    None: train a SentencePiece one of the model's vocab size on the source. Either way it is
    stored with the shards (prepared_dir/tokenizer.model or tokenizer.json)."""
    tokenizer_max_sentences: int = may_change(1_000_000)
    """Cap on the lines used to train a tokenizer (speed)."""
    tokenizer_max_line_bytes: int = may_change(16384)
    """Longest line, in UTF-8 bytes, a tokenizer is trained on (SentencePiece's
    max_sentence_length; 16384 = tokenizer.MAX_LINE_BYTES). Longer lines are left out of
    training (a warning says how many); a source with no shorter line is an error naming this
    key. Encoding is not limited by it. Changes the tokenizer trained, so the data's hash."""
    prepared_dir: Optional[str] = may_change(None)
    """None: `llama_train.paths.cache_dir()/<name>-<hash>`."""
    val_fraction: float = 0.01
    """Fraction of documents held out for validation (every 1/f-th non-empty document)."""
    add_bos: bool = False
    """Prepend BOS to every document (EOS is always appended)."""
    dtype: str = may_change("auto")
    """Token file dtype: auto (uint16 if vocab <= 65535 else uint32), uint16 or uint32."""
    num_proc: int = may_change(0)
    """Tokenization processes; 0 = auto (all cores, max 8; in-process for sources < 32 MB),
    1 = in-process."""
    shard_tokens: int = may_change(50_000_000)
    """Tokens per shard file."""
    num_workers: int = may_change(1)
    """Background DataLoader workers of the training loader (0 = in the main process)."""
    seed: int = 1234
    """Seed of the training-window shuffle and of tokenizer training."""
    max_documents: Optional[int] = None
    """Read at most this many documents of the source (quick experiments)."""
    verify: bool = may_change(False)
    """prepare_data checks every shard's sha256 up front when it finds existing data (reads it
    all). Without it every block of a shard is still checked, lazily: its crc32, by each
    process that reads it, the first time it does, before any of its tokens is used
    (PackedTokens; data prepared before block checksums: each shard's sha256 instead)."""

    def __post_init__(self) -> None:
        self.mixture = as_entries(self.mixture)
        if self.tokenizer is not None and os.path.isdir(os.path.expanduser(str(self.tokenizer))):
            from .tokenizer import tokenizer_file_in  # reads a byte: no tokenizer loaded

            found = tokenizer_file_in(os.path.expanduser(str(self.tokenizer)))
            if found is not None:  # none: loading the directory says so, naming this key
                self.tokenizer = str(found)
        self.validate()

    def validate(self) -> None:
        if self.mixture:
            check_entries(as_entries(self.mixture))
        if not self.source:
            raise DataError("data.source is empty: set it to 'builtin', a hub name or a local path")
        if self.dtype not in DTYPES:
            raise DataError(f"data.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.text_sample_by not in SAMPLE_BY:
            raise DataError(
                f"data.text_sample_by={self.text_sample_by!r} is not one of {', '.join(SAMPLE_BY)}"
            )
        # every numeric field's range (llama_train.bounds), before any data is read or written
        for name, rng in RANGES.items():
            msg = rng.message(f"data.{name}", getattr(self, name))
            if msg is not None:
                raise DataError(msg)

    @classmethod
    def from_any(cls, cfg) -> "DataConfig":
        """Accept a DataConfig, a dict or an OmegaConf DictConfig (what Hydra hands over)."""
        if isinstance(cfg, cls):
            return cfg
        if not isinstance(cfg, dict):
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        unknown = sorted(set(cfg) - set(cls.__dataclass_fields__))
        if unknown:
            raise DataError(
                f"unknown data config key(s) {unknown}; valid keys: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**cfg)
