"""Data pipeline: SentencePiece tokenizer, source text -> packed token shards, exact resumable loading.

    prepare_data(cfg, vocab_size) -> PreparedData     # once per machine, every rank may call it
    TrainLoader(prepared.dir, seq_len, global_batch, micro_batch, dp_rank, dp_world, seed)
    eval_set(prepared.dir, seq_len, batch_size, sequences, dp_rank, dp_world)

Exports are imported lazily so that light users (the `llama-data` CLI, tokenization worker
processes) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "DataConfig": ".config",
    "DataError": ".errors",
    "Tokenizer": ".tokenizer",
    "train_tokenizer": ".tokenizer",
    "prepare_data": ".prepare",
    "find_prepared": ".prepare",
    "PreparedData": ".meta",
    "PackedTokens": ".packed",
    "read_meta": ".meta",
    "check_compatible": ".meta",
    "TrainLoader": ".loader",
    "eval_set": ".loader",
    "eval_sets": ".loader",
    "builtin_corpus": ".corpus",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from .config import DataConfig
    from .corpus import builtin_corpus
    from .errors import DataError
    from .loader import TrainLoader, eval_set, eval_sets
    from .meta import PreparedData, check_compatible, read_meta
    from .packed import PackedTokens
    from .prepare import find_prepared, prepare_data
    from .tokenizer import Tokenizer, train_tokenizer


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
