"""Convert between llama_train checkpoints and Hugging Face ``transformers`` Llama.

The one place to import it from (``from llama_train.hf import ...``; the console scripts
``llama-export`` and ``llama-import`` are ``llama_train.hf:export_main`` and ``:import_main``).
Its modules: :mod:`.convert` (config.json <-> ModelArgs and state dicts: the names and the RoPE
row permutation), :mod:`.export` (writing a Hugging Face directory with the run's tokenizer),
:mod:`.read` (reading one we did not write, checked before anything is loaded),
:mod:`.init_from` (``trainer.init_from``: its weights and its tokenizer) and :mod:`.cli`.
"""

from __future__ import annotations

from llama_train.hf.cli import EXIT_NOT_A_CHECKPOINT, EXIT_UNLOADABLE, export_main, import_main
from llama_train.hf.convert import (NotALlamaModel, PathLike, _name_map, from_hf_config,
                                    from_hf_state_dict, to_hf_config, to_hf_state_dict)
from llama_train.hf.export import export_hf, trained_with_bos
from llama_train.hf.init_from import check_init_from, check_init_from_tokenizer, read_init_from
from llama_train.hf.read import import_hf, init_from_tokenizer_file

__all__ = [
    "EXIT_NOT_A_CHECKPOINT", "EXIT_UNLOADABLE", "NotALlamaModel", "PathLike",
    "check_init_from", "check_init_from_tokenizer", "export_hf", "export_main",
    "from_hf_config", "from_hf_state_dict", "import_hf", "import_main", "init_from_tokenizer_file",
    "read_init_from", "to_hf_config", "to_hf_state_dict", "trained_with_bos",
]
