"""DataConfig: the `data` group of the Hydra config (configs/data/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .errors import DataError
from .mixture import MixtureEntry, as_entries, check_entries

DTYPES = ("auto", "uint16", "uint32")
SAMPLE_BY = ("document", "paragraph", "line")


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and packed, and how it is loaded.

    Fields that change the tokens (source, tokenizer, split, column, val_fraction, add_bos,
    dtype, max_documents, text_sample_by, tokenizer_max_sentences) are hashed into the prepared
    directory name; the rest (num_proc, shard_tokens, num_workers, ...) only change speed/layout.
    """

    name: Optional[str] = None
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
    streaming: bool = False
    """Stream the source instead of materializing it in the HF cache (large hub datasets)."""
    text_sample_by: str = "document"
    """For .txt files: one document per `document` (file), `paragraph` or `line`."""
    tokenizer: Optional[str] = None
    """Path to a SentencePiece .model. None: train one of the model's vocab size on the source
    and store it with the shards (prepared_dir/tokenizer.model)."""
    tokenizer_max_sentences: int = 1_000_000
    """Cap on the lines used to train a tokenizer (speed)."""
    prepared_dir: Optional[str] = None
    """None: `llama_train.paths.cache_dir()/<name>-<hash>`."""
    val_fraction: float = 0.01
    """Fraction of documents held out for validation (every 1/f-th non-empty document)."""
    add_bos: bool = False
    """Prepend BOS to every document (EOS is always appended)."""
    dtype: str = "auto"
    """Token file dtype: auto (uint16 if vocab <= 65535 else uint32), uint16 or uint32."""
    num_proc: int = 0
    """Tokenization processes; 0 = auto (all cores, max 8; in-process for sources < 32 MB),
    1 = in-process."""
    shard_tokens: int = 50_000_000
    """Tokens per shard file."""
    num_workers: int = 1
    """Background DataLoader workers of the training loader (0 = in the main process)."""
    seed: int = 1234
    """Seed of the training-window shuffle and of tokenizer training."""
    max_documents: Optional[int] = None
    """Read at most this many documents of the source (quick experiments)."""
    verify: bool = False
    """prepare_data checks every shard's sha256 up front when it finds existing data (reads it
    all). Without it every block of a shard is still checked, lazily: its crc32, by each
    process that reads it, the first time it does, before any of its tokens is used
    (PackedTokens; data prepared before block checksums: each shard's sha256 instead)."""

    def __post_init__(self) -> None:
        self.mixture = as_entries(self.mixture)
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
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.num_proc < 0:
            raise DataError(f"data.num_proc={self.num_proc} must be >= 0 (0 = all cores)")
        if self.shard_tokens < 1:
            raise DataError(f"data.shard_tokens={self.shard_tokens} must be >= 1")
        if self.num_workers < 0:
            raise DataError(f"data.num_workers={self.num_workers} must be >= 0")
        if self.max_documents is not None and self.max_documents < 1:
            raise DataError(f"data.max_documents={self.max_documents} must be >= 1 or null")
        if self.tokenizer_max_sentences < 0:
            raise DataError(f"data.tokenizer_max_sentences={self.tokenizer_max_sentences} must be >= 0")

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
