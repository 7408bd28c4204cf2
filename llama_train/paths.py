"""Where the package finds its Hydra configs and caches."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = Path(os.environ.get("LLAMA_TRAIN_CONFIG_DIR", REPO_ROOT / "configs"))


def cache_dir() -> Path:
    """Prepared data and tokenizers live here unless a config says otherwise."""
    return Path(os.environ.get("LLAMA_TRAIN_CACHE", Path.home() / ".cache" / "llama_train"))
