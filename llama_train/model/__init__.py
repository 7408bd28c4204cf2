"""The model: the LLaMA transformer in plain ``torch.nn`` and everything that describes it.

    args.py         ModelArgs, presets, parameter and FLOP counts: plain Python, no torch
    ops.py          the functions the layers use (RoPE, masks, losses, sampling): plain torch
    transformer.py  the layers and the Transformer (nothing of DeepSpeed or devices)
    weights.py      weights we did not write, checked against their ModelArgs

``from llama_train.model import X`` gives every name of the model's API (:mod:`.transformer`'s
``__all__``, which re-exports :mod:`.args` and :mod:`.ops`). Importing this package imports no
torch: the config, planning and ``llama-train --help`` read ModelArgs from it (the args names
are here at once); any other name imports :mod:`.transformer` (torch) when first asked for.
"""

from llama_train.model.args import (ModelArgs, RopeScaling, count_params, ffn_hidden_dim,
                                    flops_per_token, list_presets, load_preset)

__all__ = ["ModelArgs", "RopeScaling", "ffn_hidden_dim", "count_params", "flops_per_token",
           "list_presets", "load_preset", "RMSNorm", "KVCache", "CoreAttention", "Attention",
           "FeedForward", "TransformerBlock", "OutputHead",
           "Transformer", "apply_rotary_emb", "cross_entropy", "document_ids", "document_mask",
           "linear_cross_entropy", "rope_inv_freq", "rope_tables", "sample_next_token"]

_SUBMODULES = ("args", "ops", "transformer", "weights")


def __getattr__(name: str):
    """The torch half, imported when first asked for (PEP 562): a submodule by its name, any
    other name from :mod:`.transformer` (what ``llama_train.model`` held when it was one
    module)."""
    if name.startswith("__"):  # probes (__wrapped__, __path__ lookups): nothing to import
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    import llama_train.model.transformer  # torch

    try:
        return getattr(llama_train.model.transformer, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(__all__))
