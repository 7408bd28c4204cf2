"""Convert between llama_train checkpoints and Hugging Face ``transformers`` Llama.

Lives beside the model, not inside it. Two things differ between the layouts:

* names: ``layers.{i}.attention.wq`` <-> ``model.layers.{i}.self_attn.q_proj`` etc. (``_NAME_MAP``);
* RoPE pairing: our model rotates interleaved pairs (x0, x1), (x2, x3) ... of each head (Meta's
  layout, see ``llama_train.model``), HF rotates the halves (x_i, x_{i + hd/2}). Permuting the
  output rows of ``wq`` and ``wk`` within each head, ``[0, 2, 4, ..., 1, 3, 5, ...]``, makes one
  compute exactly what the other does (q.k is a sum over pairs, so the order of pairs is free).

``wv``/``wo`` and the MLP need no permutation. Tied embeddings are stored once (HF omits
``lm_head.weight``), and safetensors refuses shared tensors anyway.

The converters only (config.json <-> ModelArgs, state dict <-> state dict); the package
:mod:`llama_train.hf` re-exports them with the files (:mod:`.export`, :mod:`.read`), the
``trainer.init_from`` reader (:mod:`.init_from`) and the CLIs (:mod:`.cli`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from llama_train.model import ModelArgs, ffn_hidden_dim
from llama_train.model.weights import WeightsError

PathLike = Union[str, Path]

# our per-layer suffix -> HF per-layer suffix
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _name_map(args: ModelArgs) -> dict[str, str]:
    """Every key of our state dict -> its HF key (``output.weight`` included even when tied)."""
    m = dict(_TOP_MAP)
    for i in range(args.n_layers):
        for ours, theirs in _LAYER_MAP.items():
            m[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return m


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def to_hf_config(args: ModelArgs, *, bos_token_id: Optional[int] = 1, eos_token_id: Optional[int] = 2,
                 pad_token_id: Optional[int] = None, torch_dtype: str = "float32") -> dict:
    """A ``transformers.LlamaConfig`` dict (config.json) for these args.

    RoPE is written both the transformers 4 way (flat ``rope_theta``, ``rope_scaling``) and the
    transformers 5 way (``rope_parameters``), so either version reads it.
    """
    scaling = _hf_rope_scaling(args)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": args.rope_theta},
        "rope_scaling": scaling,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": args.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }


_LLAMA3_ROPE_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _hf_rope_scaling(args: ModelArgs) -> Optional[dict]:
    """Hugging Face's ``rope_scaling`` dict for our ``model.rope_scaling`` (None: plain RoPE)."""
    rs = args.rope_scaling
    if rs.type == "default":
        return None
    out = {"rope_type": rs.type, "factor": rs.factor}
    if rs.type == "llama3":
        out.update({k: getattr(rs, k) for k in _LLAMA3_ROPE_KEYS})
    return out


class NotALlamaModel(WeightsError):
    """A file or directory that is not a Hugging Face Llama model this code reads (no
    config.json, not JSON, another architecture or RoPE, no safetensors, tensors of another
    model): bad input, as any WeightsError; ``trainer.init_from`` answers it with what it
    accepts (:func:`read_init_from`)."""


def _number(key: str, value: Any) -> float:
    """A number of a config.json (``float(value)``): NotALlamaModel naming the key where it is
    none, as for every other refusal of the file."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NotALlamaModel(f"HF config {key}={value!r} is not a number") from None


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, dict]:
    """(rope_theta, our rope_scaling dict) from a config.json of transformers 4 or 5; refuses RoPE
    types this model does not implement (dynamic, yarn, longrope ...) instead of importing a model
    that would compute something else."""
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or rope)
    theta = _number("rope_theta", rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, {}
    if kind not in ("linear", "llama3"):
        raise NotALlamaModel(f"HF config uses RoPE scaling of type {kind!r} ({scaling}); this model "
                             f"implements default, linear and llama3 (model.rope_scaling.type)")
    extra = _number("rope_scaling.attention_factor", scaling.get("attention_factor") or 1.0)
    if extra != 1.0:
        raise NotALlamaModel(f"HF config rope attention_factor={extra} is not supported (only 1.0)")
    out = {"type": kind, "factor": _number("rope_scaling.factor", scaling.get("factor", 1.0))}
    if kind == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
        if missing:
            raise NotALlamaModel(f"HF config's llama3 RoPE scaling lacks {', '.join(missing)}: {scaling}")
        out.update({k: scaling[k] for k in _LLAMA3_ROPE_KEYS})
    return theta, out


# (hidden_size, intermediate_size) -> Meta's params.json (multiple_of, ffn_dim_multiplier) where the
# search below finds another recipe of the same size first: Llama 3.2 1B (x1.5 with 256, not x1.3
# with 4096) and 3B (x1.0 with 256, not the plain rule)
_META_FFN = {(2048, 8192): (256, 1.5), (3072, 8192): (256, 1.0)}


def _ffn_settings(dim: int, intermediate: int) -> tuple[int, Optional[float]]:
    """(multiple_of, ffn_dim_multiplier) for which ``ModelArgs.ffn_hidden_dim == intermediate``.

    Prefers Meta's published recipes (``_META_FFN`` for Llama 3.2, then the plain rule with
    multiple_of 256 ..., x1.3 with 4096/1024, or x1.2 with 4096 as in Llama 3.1 405B)
    so LLaMA checkpoints come back with their params.json values; otherwise falls back to
    ``multiple_of = intermediate`` (with a multiplier < 1 when intermediate is below the plain
    rule's 8/3 * dim), which rounds to ``intermediate`` exactly by construction.
    """
    if (dim, intermediate) in _META_FFN:
        return _META_FFN[dim, intermediate]
    candidates = [(m, None) for m in (256, 128, 64, 32, 16, 8, 4, 2, 1)]
    candidates += [(m, x) for x in (1.3, 1.2) for m in (4096, 1024, 2048, 512, 256)]
    for mult_of, mult in candidates:
        if ffn_hidden_dim(dim, mult_of, mult) == intermediate:
            return mult_of, mult
    base = int(2 * 4 * dim / 3)
    # int(mult * base) lands on intermediate (not below, and never 0), which is already a multiple
    mult = None if intermediate >= base else (intermediate + 0.5) / base
    if ffn_hidden_dim(dim, intermediate, mult) != intermediate:  # pragma: no cover - guarded by construction
        raise ValueError(f"cannot express intermediate_size={intermediate} with the LLaMA FFN rule")
    return intermediate, mult


def from_hf_config(cfg: Mapping[str, Any]) -> ModelArgs:
    """ModelArgs from a Llama config.json dict; rejects features this model does not implement."""
    def need(key: str) -> Any:
        if key not in cfg or cfg[key] is None:
            raise NotALlamaModel(f"HF config lacks {key!r}: not a Llama config.json?")
        return cfg[key]

    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise NotALlamaModel(f"HF config model_type={model_type!r}: only 'llama' checkpoints can be imported")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key in cfg and cfg[key] != ok:
            raise NotALlamaModel(f"HF config {key}={cfg[key]!r} is not supported (this model needs {ok!r})")
    theta, rope_scaling = _rope_from_hf(cfg)

    dim, n_heads = need("hidden_size"), need("num_attention_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and n_heads * head_dim != dim:
        raise NotALlamaModel(f"HF config head_dim={head_dim} != hidden_size/num_attention_heads="
                             f"{dim}/{n_heads}: decoupled head sizes are not supported")
    kv = cfg.get("num_key_value_heads") or n_heads
    multiple_of, mult = _ffn_settings(dim, need("intermediate_size"))
    return ModelArgs(
        dim=dim, n_layers=need("num_hidden_layers"), n_heads=n_heads, n_kv_heads=None if kv == n_heads else kv,
        vocab_size=need("vocab_size"), multiple_of=multiple_of, ffn_dim_multiplier=mult,
        norm_eps=_number("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=rope_scaling,
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=_number("initializer_range", cfg.get("initializer_range", 0.02)),
    )


# --------------------------------------------------------------------------------------------
# State dicts
# --------------------------------------------------------------------------------------------


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection, per head: pair i = rows (2i, 2i+1) -> rows (i, i + hd/2)."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``_interleaved_to_half``."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, 2, hd // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _check_keys(have: set, want: set, what: str) -> None:
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        def show(keys: list) -> str:
            return ", ".join(keys[:5]) + (f" ... (+{len(keys) - 5})" if len(keys) > 5 else "")
        parts = ([f"missing {len(missing)} key(s): {show(missing)}"] if missing else [])
        parts += ([f"unexpected {len(unexpected)} key(s): {show(unexpected)}"] if unexpected else [])
        hint = ""
        if any(k.startswith(("module.", "_orig_mod.")) for k in unexpected):
            hint = " (keys carry a wrapper prefix: save the unwrapped model's state_dict)"
        raise WeightsError(f"{what} does not match the model args: " + "; ".join(parts) + hint)


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF ``LlamaForCausalLM`` state dict (q/k rows permuted for HF's RoPE)."""
    names = _name_map(args)
    want = set(names) - ({"output.weight"} if args.tie_embeddings else set())
    have = {k for k in sd if k not in ("rope_cos", "rope_sin")}
    if args.tie_embeddings:
        have.discard("output.weight")  # the same tensor as tok_embeddings.weight
    _check_keys(have, want, "state dict")
    out = {}
    for k in want:
        t = sd[k]
        if k.endswith("attention.wq.weight"):
            t = _interleaved_to_half(t, args.n_heads)
        elif k.endswith("attention.wk.weight"):
            t = _interleaved_to_half(t, args.kv_heads)
        out[names[k]] = t
    return out


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF Llama state dict -> ours; with tied embeddings ``output.weight`` is the embedding tensor."""
    names = {theirs: ours for ours, theirs in _name_map(args).items()}
    have = {k for k in sd if not k.endswith("rotary_emb.inv_freq")}
    want = set(names)
    if args.tie_embeddings:
        want.discard("lm_head.weight")
        have.discard("lm_head.weight")
    _check_keys(have, want, "HF state dict")
    out = {}
    for k in want:
        t = sd[k]
        if k.endswith("self_attn.q_proj.weight"):
            t = _half_to_interleaved(t, args.n_heads)
        elif k.endswith("self_attn.k_proj.weight"):
            t = _half_to_interleaved(t, args.kv_heads)
        out[names[k]] = t
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
