"""Convert between llama_train checkpoints and Hugging Face ``transformers`` Llama.

Lives beside the model, not inside it. Two things differ between the layouts:

* names: ``layers.{i}.attention.wq`` <-> ``model.layers.{i}.self_attn.q_proj`` etc. (``_NAME_MAP``);
* RoPE pairing: our model rotates interleaved pairs (x0, x1), (x2, x3) ... of each head (Meta's
  layout, see ``llama_train.model``), HF rotates the halves (x_i, x_{i + hd/2}). Permuting the
  output rows of ``wq`` and ``wk`` within each head, ``[0, 2, 4, ..., 1, 3, 5, ...]``, makes one
  compute exactly what the other does (q.k is a sum over pairs, so the order of pairs is free).

``wv``/``wo`` and the MLP need no permutation. Tied embeddings are stored once (HF omits
``lm_head.weight``), and safetensors refuses shared tensors anyway.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from llama_train.data.errors import DataError
from llama_train.data.tokenizer import EXPORT_KEY  # light: no tokenizer library imported
from llama_train.errors import BadInput
from llama_train.model import ModelArgs, ffn_hidden_dim
from llama_train.weights import (REQUANT_FIX, WeightsError, check_finite, check_state_dict,
                               check_tensors)

log = logging.getLogger(__name__)

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
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_SHARD_BYTES = 5 * 2**30


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


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _sentencepiece_info(path: Path) -> dict:
    """Special-token ids/pieces of a sentencepiece model, with a warning where HF will differ."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    info = {}
    for name, idx in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()), ("pad", sp.pad_id())):
        info[f"{name}_id"] = idx if idx >= 0 else None
        info[f"{name}_token"] = sp.id_to_piece(idx) if idx >= 0 else None
    info["vocab_size"] = sp.vocab_size()
    # HF's LlamaTokenizer applies no normaliser and always prepends "▁": it reproduces
    # sentencepiece only for models trained like LLaMA's (identity rule, whitespace kept).
    probe = "a  b\n\tc ﬁ é"
    try:
        faithful = sp.normalize(probe) == "▁" + probe.replace(" ", "▁")
    except AttributeError:  # pragma: no cover - very old sentencepiece
        faithful = True
    if not faithful:
        log.warning("%s normalises text (non-identity rule or removes extra whitespace); the exported HF "
                    "tokenizer will not apply that normalisation. Train with normalization_rule_name="
                    "'identity', remove_extra_whitespaces=False for an exact match.", path)
    return info


def _write_tokenizer(tokenizer_model: Path, out_dir: Path, info: dict, max_len: int,
                     add_bos: bool) -> None:
    """``tokenizer.model`` plus the files ``AutoTokenizer`` loads, encoding every text to the ids
    our sentencepiece model gives it and prepending BOS only if training did (``data.add_bos``).

    Left to convert ``tokenizer.model`` itself, transformers' Llama tokenizer prepends "▁" only
    to text that does not start with a space (its Metaspace pre-tokenizer), where sentencepiece
    always adds its dummy prefix: "  two" came out as ["▁▁", "two"] instead of ["▁▁", "▁two"].
    So we write ``tokenizer.json`` ourselves: transformers' own conversion of the vocabulary and
    merges, with sentencepiece's normalisation (prepend "▁", spaces to "▁"), no pre-tokenizer,
    a decoder that drops the dummy prefix, and special-token strings in text taken literally."""
    shutil.copyfile(tokenizer_model, out_dir / "tokenizer.model")
    special = {k: info[f"{k}_token"] for k in ("bos", "eos", "unk", "pad") if info[f"{k}_token"] is not None}
    if add_bos and info["bos_id"] is None:
        raise DataError(f"the model was trained with a BOS token but {tokenizer_model} has none")
    cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_max_length": max_len,
        **{f"{k}_token": v for k, v in special.items()},
        # the weights' tokenizer is this file; tokenizer.json is a conversion of it (init_from)
        EXPORT_KEY: "tokenizer.model",
    }
    if _write_tokenizer_json(out_dir, info, add_bos):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({f"{k}_token": v for k, v in special.items()}, indent=2) + "\n")


def _hf_info(tok) -> dict:
    """Special-token ids/strings and size of a Hugging Face tokenizer (data.Tokenizer)."""
    info = {"vocab_size": tok.vocab_size}
    for name in ("bos", "eos", "unk", "pad"):
        idx = getattr(tok, f"{name}_id")
        info[f"{name}_id"] = idx if idx >= 0 else None
        info[f"{name}_token"] = tok.id_to_token(idx) if idx >= 0 else None
    return info


def _write_hf_tokenizer(tok, out_dir: Path, info: dict, max_len: int, add_bos: bool) -> None:
    """The run's ``tokenizer.json`` (a Hugging Face tokenizer) and a ``tokenizer_config.json``
    naming its special tokens, so ``AutoTokenizer`` loads the tokenizer the data was encoded
    with. transformers takes a tokenizer.json's post-processor as it is (``add_bos_token`` does
    not change it), so where it does not prepend BOS exactly when training did (``data.add_bos``)
    the copy gets one that does; otherwise the file is the run's, byte for byte (its sha256 is
    the data's: init_from the export reuses the prepared data). Special-token strings in text
    are taken literally, as in training (``split_special_tokens``)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    if add_bos and info["bos_id"] is None:
        raise DataError(f"the model was trained with a BOS token but {tok.path} has none")
    data = Path(tok.path).read_bytes()
    probe = HFTokenizer.from_str(data.decode("utf-8"))
    probe.no_padding()
    probe.no_truncation()
    want = ([info["bos_id"]] if add_bos else []) + tok.encode("a")
    if probe.encode("a").ids != want:  # with its post-processor, as AutoTokenizer encodes
        fixed = HFTokenizer.from_str(data.decode("utf-8"))
        bos = info["bos_token"]
        fixed.post_processor = (processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, info["bos_id"])])
            if add_bos else None)
        data = fixed.to_str(pretty=True).encode("utf-8")
        log.info("%s: its post-processor replaced in the export by one that %s, as training "
                 "did (data.add_bos=%s)", tok.path, "prepends BOS" if add_bos else "adds nothing",
                 add_bos)
    (out_dir / "tokenizer.json").write_bytes(data)
    (out_dir / "tokenizer.model").unlink(missing_ok=True)  # an earlier export's: not this one
    special = {k: info[f"{k}_token"] for k in ("bos", "eos", "unk", "pad")
               if info[f"{k}_token"] is not None}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_max_length": max_len,
        **{f"{k}_token": v for k, v in special.items()},
        EXPORT_KEY: "tokenizer.json",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({f"{k}_token": v for k, v in special.items()}, indent=2) + "\n")


def _write_tokenizer_json(out_dir: Path, info: dict, add_bos: bool) -> bool:
    """tokenizer.json next to the copied tokenizer.model (needs transformers; False without)."""
    try:
        from tokenizers import decoders, normalizers, processors
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("transformers is not installed: no tokenizer.json written; AutoTokenizer will "
                    "convert tokenizer.model itself and may tokenize leading spaces differently "
                    "from training (pip install transformers, then export again)")
        return False
    backend = AutoTokenizer.from_pretrained(str(out_dir)).backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bos = info["bos_token"]
    backend.post_processor = (processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, info["bos_id"])])
        if add_bos else None)
    backend.save(str(out_dir / "tokenizer.json"))
    return True


def trained_with_bos(checkpoint_dir: PathLike) -> bool:
    """``data.add_bos`` of the run that wrote this checkpoint (its config.yaml; False, the
    default, when the checkpoint has none)."""
    cfg_file = Path(checkpoint_dir) / "config.yaml"
    if not cfg_file.is_file():
        return False
    from omegaconf import OmegaConf

    return bool(OmegaConf.select(OmegaConf.load(cfg_file), "data.add_bos", default=False))


def _save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """safetensors' ``save_file`` with the permissions of any other file written here:
    safetensors creates its file 0600 whatever the umask, so a model exported for a team to
    read was readable by its owner only."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def export_hf(args: ModelArgs, state_dict: Mapping[str, torch.Tensor], out_dir: PathLike,
              tokenizer_model: Optional[PathLike] = None, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = _MAX_SHARD_BYTES, add_bos: bool = False) -> Path:
    """Write a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Files: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + index json when larger
    than ``max_shard_bytes``), ``config.json``, ``generation_config.json`` and, given the run's
    tokenizer (``tokenizer_model``: a sentencepiece model, or a Hugging Face tokenizer.json,
    whatever the file's name: a checkpoint keeps either as tokenizer.model), it and the files
    ``AutoTokenizer`` loads (``add_bos``: whether training prepended BOS, ``data.add_bos``).
    bos/eos ids come from the tokenizer (LLaMA's 1/2 without one).
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype} is not supported: use torch.float32, torch.bfloat16 or torch.float16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = {"bos_id": 1, "eos_id": 2, "pad_id": None}
    tok = None
    if tokenizer_model is not None:
        from llama_train.data import Tokenizer
        from llama_train.data.tokenizer import SENTENCEPIECE

        tokenizer_model = Path(tokenizer_model)
        if not tokenizer_model.is_file():
            raise DataError(f"tokenizer_model {str(tokenizer_model)!r} does not exist")
        tok = Tokenizer(tokenizer_model)  # DataError (bad input): not a tokenizer
        info = (_sentencepiece_info(tokenizer_model) if tok.kind == SENTENCEPIECE
                else _hf_info(tok))
        if info["vocab_size"] > args.vocab_size:
            raise WeightsError(f"tokenizer {tokenizer_model} has {info['vocab_size']} pieces but "
                               f"model.vocab_size={args.vocab_size}: export the matching tokenizer")

    hf_sd = {k: v.detach().to(device="cpu", dtype=dtype).contiguous()
             for k, v in sorted(to_hf_state_dict(state_dict, args).items())}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in hf_sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()  # a stale shard set would be mixed in on load
    if len(shards) == 1:
        _save_safetensors(shards[0], out / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            _save_safetensors(shard, out / name)
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in hf_sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    cfg = to_hf_config(args, bos_token_id=info["bos_id"], eos_token_id=info["eos_id"],
                       pad_token_id=info["pad_id"], torch_dtype=_DTYPE_NAMES[dtype])
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: info[f"{k.split('_')[0]}_id"] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(
        json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2) + "\n")
    if tok is not None and tok.sp is not None:
        _write_tokenizer(tokenizer_model, out, info, args.max_seq_len, add_bos)
    elif tok is not None:
        _write_hf_tokenizer(tok, out, info, args.max_seq_len, add_bos)
    return out


# --------------------------------------------------------------------------------------------
# Weights we did not write: checked before they are loaded or used (issue 54; the checks
# themselves, shared with llama_train.checkpoint: llama_train.weights)
# --------------------------------------------------------------------------------------------


# safetensors' dtype names -> (torch's name, bytes per element)
_ST_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
              "BF16": ("bfloat16", 2), "F8_E4M3": ("float8_e4m3fn", 1),
              "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8), "U64": ("uint64", 8),
              "I32": ("int32", 4), "U32": ("uint32", 4), "I16": ("int16", 2),
              "U16": ("uint16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1)}
_SAFETENSORS_MAX_HEADER = 100 * 2**20  # safetensors' own limit


def _inside(d: Path, name: Any, what: str) -> Path:
    """``d / name`` for a file a model directory reads (config.json, an index's shard): refused
    unless ``name`` is a relative path inside ``d`` and the file, followed through symlinks,
    lies inside ``d`` too; or, for a Hugging Face hub cache snapshot (``models--org--name/
    snapshots/<revision>/``, whose files are links to ``../../blobs/<sha256>``), inside that
    repository's ``blobs/``. So an index cannot make the importer open /etc/passwd or a file
    next to the model."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise WeightsError(f"{what} names {name!r}, not a file name: re-save the model with "
                           f"save_pretrained")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise WeightsError(
            f"{what} names {name!r}, outside the model directory {d}: every file an index "
            f"names must lie in the directory (a relative name without '..'). It is not a "
            f"file save_pretrained wrote: fix the entry, or download the model again.")
    path, root = d / rel, d.resolve()
    target = path.resolve()
    allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    if not any(target == a or a in target.parents for a in allowed):
        raise WeightsError(
            f"{what} names {name!r}, a link to {target}, outside the model directory {d}: "
            f"a model directory reads only its own files (a Hugging Face cache snapshot, its "
            f"blobs/ too). Copy the file into {d} (cp -L) if it is this model's.")
    return path


def _safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a safetensors file -> (dtype, shape), from its header alone (nothing
    loaded). A header that is malformed, larger than the file, or that places a tensor past the
    end of the data (a truncated file) is refused naming the file."""
    def bad(why: str) -> WeightsError:
        return WeightsError(f"{path} cannot be read as safetensors ({why}): download it again, "
                            f"or re-save the model with save_pretrained(safe_serialization=True)")

    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, _SAFETENSORS_MAX_HEADER):
                raise bad(f"a header of {n:,} bytes in a file of {size:,}" if n >= 0 else
                          f"{size} bytes: no header")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise bad(f"{type(e).__name__}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, not UTF-8
        raise bad(f"its header is not JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = isinstance(dtype, str) and all(type(x) is int and x >= 0
                                                for x in (*shape, start, end))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets")
        torch_name, itemsize = _ST_DTYPES.get(dtype, (dtype.lower(), None))
        if not start <= end <= data:
            raise bad(f"tensor {name} lies at bytes {start:,}-{end:,} of a data section of "
                      f"{data:,} bytes: the file is truncated")
        if itemsize is not None and end - start != math.prod(shape) * itemsize:
            raise bad(f"tensor {name} ({torch_name}, shape {list(shape)}) needs "
                      f"{math.prod(shape) * itemsize:,} bytes, its data_offsets hold "
                      f"{end - start:,}")
        out[name] = (torch_name, shape)
    return out


def _read_hf_dir(d: Path) -> tuple[ModelArgs, dict[str, Path], dict]:
    """(ModelArgs, tensor name -> its file, found) of an HF Llama directory, checked from
    config.json and the safetensors headers alone (:func:`weights.check_tensors`): nothing is
    loaded."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise NotALlamaModel(f"{cfg_path} does not exist: pass a Hugging Face model directory")
    _inside(d, "config.json", str(d))
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except ValueError as e:  # not JSON, not UTF-8
        raise NotALlamaModel(f"{cfg_path} is not a JSON config ({e})") from None
    if not isinstance(hf_cfg, dict):
        raise NotALlamaModel(f"{cfg_path} holds a JSON {type(hf_cfg).__name__}, not a config object")
    quant = hf_cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise WeightsError(f"{cfg_path} has a quantization_config (quant_method={method!r}): "
                           f"the model is quantized. {REQUANT_FIX}")
    args = from_hf_config(hf_cfg)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        _inside(d, index.name, str(d))
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a shard index ({type(e).__name__}: {e}): "
                               f"download it again, or re-save the model with "
                               f"save_pretrained") from None
        files = {}
        for name, f in weight_map.items():
            path = _inside(d, f, f"{index}: the entry for {name}")
            files[f] = path
    elif (d / "model.safetensors").is_file():
        weight_map, files = {}, {"model.safetensors": _inside(d, "model.safetensors", str(d))}
    else:
        raise NotALlamaModel(f"no model.safetensors or model.safetensors.index.json in {d}: only safetensors "
                             "weights are read (re-save with save_pretrained(safe_serialization=True))")
    owner: dict[str, Path] = {}
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise WeightsError(f"{path} does not exist, but {index.name} names it: download "
                               f"the missing shard")
        for name, (dtype, shape) in _safetensors_header(path).items():
            if name in owner:
                raise WeightsError(f"tensor {name} is in both {owner[name]} and {path}: one "
                                   f"model's shards hold each tensor once")
            owner[name], found[name] = path, (dtype, shape, str(path))
    for name, f in weight_map.items():
        if owner.get(name) != files[f]:
            raise WeightsError(f"{index} places tensor {name} in {f}, which does not hold it: "
                               f"the index is not these shards'")
    check_tensors(found, args, "config.json", names=_name_map(args))
    _check_tokenizer_fits(d, args.vocab_size)
    return args, owner, found


def _check_tokenizer_fits(d: Path, rows: int) -> None:
    """A tokenizer in the directory with more tokens than the embedding has rows is not the
    weights' own: ids from ``rows`` on would index past the embedding."""
    try:
        tok = init_from_tokenizer_file(str(d))
        n = None
        if tok is not None:
            from llama_train.data import Tokenizer

            n = Tokenizer(tok).vocab_size
    except Exception:  # noqa: BLE001 - a tokenizer that does not load is not checked here
        return
    if n is not None and n > rows:
        raise WeightsError(
            f"{tok} has {n:,} tokens but the embedding (model.embed_tokens.weight) has "
            f"{rows:,} rows: ids from {rows:,} on would index past it, so it is not these "
            f"weights' tokenizer. Put the model's own tokenizer in {d}, or remove it and give "
            f"the tokenizer where it is used (data.tokenizer, --tokenizer).")


def import_hf(hf_dir: PathLike) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(ModelArgs, our state dict) from an HF Llama directory (config.json + safetensors,
    sharded or not). Checked before anything is loaded (:func:`_read_hf_dir`: a quantized or
    integer model, a shape, layer count or vocabulary config.json does not describe, a file
    outside the directory), and every value after (:func:`weights.check_finite`): WeightsError."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    args, owner, _ = _read_hf_dir(d)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(set(owner.values())):
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors' own error type, OSError, ...
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise NotALlamaModel(f"{f} cannot be read as safetensors "
                                 f"({type(e).__name__}: {first})") from None
    check_finite(sd, {n: str(f) for n, f in owner.items()})
    return args, from_hf_state_dict(sd, args)


# --------------------------------------------------------------------------------------------
# CLIs
# --------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# trainer.init_from: weights to start a run from


def read_init_from(path: str, with_weights: bool, checked: bool = True):
    """(ModelArgs, state dict or None) of trainer.init_from: a Hugging Face Llama directory or a
    llama-import file (memory-mapped: reading its shape costs no copy of the weights). With
    ``checked`` (always, with weights) the tensors are checked against the config before
    anything is allocated (quantized or integer tensors, shapes, layers, vocabulary:
    :func:`weights.check_tensors`), and every value when ``with_weights`` (NaN, inf); ConfigError
    naming the tensor. Without, only the config is read."""
    from llama_train.config import ConfigError

    p = Path(path)
    what = (f"trainer.init_from={path} is not weights we can start from: give a Hugging Face "
            f"Llama directory (config.json + safetensors) or a .pt written by llama-import "
            f"(a llama_train checkpoint directory: llama-export it first, or continue it with "
            f"trainer.resume=<it>)")
    try:
        if p.is_dir():
            if with_weights:
                return import_hf(p)
            if checked:
                return _read_hf_dir(p)[0], None  # config.json and the safetensors headers
            if not (p / "config.json").is_file():
                raise ValueError(f"{p / 'config.json'} does not exist")
            return from_hf_config(json.loads((p / "config.json").read_text())), None
        blob = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(blob, dict) or not {"model_args", "model"} <= set(blob):
            raise ValueError(f"it holds {type(blob).__name__} "
                             f"{sorted(blob)[:5] if isinstance(blob, dict) else ''}, not "
                             f"{{'model_args', 'model'}}")
        args, sd = ModelArgs(**blob["model_args"]), blob["model"]
        if not isinstance(sd, Mapping):
            raise ValueError(f"its 'model' is a {type(sd).__name__}, not a state dict")
        if checked or with_weights:  # shapes and dtypes from the memory-mapped tensors; every
            check_state_dict(sd, args, str(p), config=f"{p}'s model_args",  # value when used
                             finite=with_weights)
        return args, (sd if with_weights else None)
    except WeightsError as e:
        if not isinstance(e, NotALlamaModel):  # a model, but not weights to train or decode
            raise ConfigError(f"trainer.init_from={path}: {e}") from None
        cause: Exception = e  # not a model this code reads: say what init_from accepts
    except Exception as e:  # noqa: BLE001 - whatever the reader says, the answer is the same
        cause = e
    raise ConfigError(f"{what}. Reading it said: {str(cause).strip().splitlines()[0][:300]}") \
        from None


def check_init_from(path: str, model_args) -> None:
    """trainer.init_from must be readable weights of this model's shape: checked before the
    process group starts (its config against the model config first, then its tensors against
    its config, from file headers or memory-mapped tensors: nothing of the model's size is
    allocated; their values are checked when the trainer reads them)."""
    from llama_train.config import ConfigError

    args, _ = read_init_from(path, with_weights=False, checked=False)
    diff = model_args.shape_differences(args)
    if diff:
        raise ConfigError(
            f"trainer.init_from={path} has "
            + ", ".join(f"{n}={theirs}" for n, _, theirs in diff) + " but the model config has "
            + ", ".join(f"{n}={ours}" for n, ours, _ in diff) + ": pick the matching model preset.")
    read_init_from(path, with_weights=False)


def init_from_tokenizer_file(path: str) -> Optional[Path]:
    """The tokenizer trainer.init_from's weights were trained with, where it carries one: in a
    Hugging Face directory, the file its tokenizer_config.json names (llama-export copies the
    run's tokenizer there, as ``tokenizer.model`` or ``tokenizer.json``, and names it), else its
    SentencePiece ``tokenizer.model``, else its ``tokenizer.json`` (a Llama 3 download:
    data.tokenizer.tokenizer_file_in). None for a llama-import .pt (weights only), a directory
    without one, or one whose file is none (a tiktoken file named tokenizer.model)."""
    from llama_train.data import DataError, Tokenizer
    from llama_train.data.tokenizer import tokenizer_file_in

    tok = tokenizer_file_in(path) if Path(path).is_dir() else None
    if tok is None:
        return None
    try:
        Tokenizer(tok)
    except DataError:
        return None
    return tok


def _hf_difference(ours, theirs) -> Optional[str]:
    """None where two Hugging Face tokenizers (data.Tokenizer) encode alike: the same tokens,
    model (merges), normalizer, pre-tokenizer and added tokens. Their post-processors and
    decoders may differ (llama_train encodes with no post-processor; an export may get its
    own), else the first difference, in words."""
    if ours.vocab_size != theirs.vocab_size:
        return f"{ours.vocab_size} tokens, not {theirs.vocab_size}"
    a, b = ours.hf.get_vocab(with_added_tokens=True), theirs.hf.get_vocab(with_added_tokens=True)
    if a != b:
        t = next(t for t in sorted(a, key=a.get) if b.get(t) != a[t])
        return f"token {t!r} has id {a[t]}, not {b.get(t)}"
    x, y = (json.loads(Path(t.path).read_text(encoding="utf-8")) for t in (ours, theirs))
    for key in ("model", "normalizer", "pre_tokenizer", "added_tokens"):
        if x.get(key) != y.get(key):
            return f"the same tokens, but another {key.replace('_', '-')} (merges or settings)"
    return None


def _tokenizer_difference(ours: Path, theirs: Path) -> Optional[str]:
    """None where two tokenizers tokenize alike (the same file; two SentencePiece models with
    the same pieces, scores, normalisation and model settings: only the trainer's bookkeeping
    differs; two tokenizer.json that encode alike: :func:`_hf_difference`), else the first
    difference, in words."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from llama_train.data import Tokenizer
    from llama_train.data.tokenizer import file_sha256

    mine, other = Tokenizer(ours), Tokenizer(theirs)  # a directory: the tokenizer file in it
    if file_sha256(mine.path) == file_sha256(other.path):
        return None
    if mine.kind != other.kind:
        return f"a {mine.kind} tokenizer, not a {other.kind} one"
    if mine.hf is not None:
        return _hf_difference(mine, other)
    a, b = pb.ModelProto(), pb.ModelProto()
    a.ParseFromString(Path(mine.path).read_bytes())
    b.ParseFromString(Path(other.path).read_bytes())
    if len(a.pieces) != len(b.pieces):
        return f"{len(a.pieces)} pieces, not {len(b.pieces)}"
    for i, (x, y) in enumerate(zip(a.pieces, b.pieces)):
        if x != y:
            return (f"piece {i} is {x.piece!r}, not {y.piece!r}" if x.piece != y.piece else
                    f"piece {i} ({x.piece!r}) has another score or type")
    for m in (a, b):  # where the model was trained from, with how many threads: no difference
        for name in ("model_prefix", "num_threads", "input"):
            m.trainer_spec.ClearField(name)
    if a.SerializeToString(deterministic=True) != b.SerializeToString(deterministic=True):
        return "the same pieces, but other normalisation or model settings"
    return None


def check_init_from_tokenizer(path: str, given: Optional[str], vocab_size: int) -> str:
    """The tokenizer a fresh start from trainer.init_from tokenizes its data with: the one its
    weights were trained with (the directory's tokenizer.model), or ``given`` (data.tokenizer)
    where it tokenizes alike. Training the weights on another tokenizer's ids raises no error,
    only a first loss far above theirs (issue 53), so anything else is refused here, before the
    data is prepared and the process group starts."""
    from llama_train.config import ConfigError
    from llama_train.data import Tokenizer
    from llama_train.data.tokenizer import fits

    own = init_from_tokenizer_file(path)
    if own is None:
        if given is not None:
            return given  # the user names the tokenizer the weights were trained with
        what = ("a llama-import .pt holds weights only" if not Path(path).is_dir() else
                "the directory has no SentencePiece tokenizer.model or Hugging Face "
                "tokenizer.json that loads")
        raise ConfigError(
            f"trainer.init_from={path} carries no tokenizer ({what}), and no data.tokenizer is "
            f"given: a tokenizer trained here would not be the one its weights were trained "
            f"with. Set data.tokenizer=<the SentencePiece .model or tokenizer.json they were "
            f"trained with> (a llama-export directory carries it: init_from that directory).")
    if given is None:
        tok = Tokenizer(own)
        if not fits(tok.kind, tok.vocab_size, vocab_size):
            exactly = ("match the embedding exactly" if tok.sp is not None else
                       "fall inside the embedding")
            raise ConfigError(
                f"trainer.init_from={path}: its {own.name} has {tok.vocab_size} pieces but its "
                f"weights have vocab_size={vocab_size}, and the data's ids must {exactly}. Set "
                f"data.tokenizer to the tokenizer of {vocab_size} pieces the weights were "
                f"trained with.")
        return str(own)
    Tokenizer(given)  # not a SentencePiece model: data.tokenizer's own message
    diff = _tokenizer_difference(Path(given), own)
    if diff:
        raise ConfigError(
            f"data.tokenizer={given} is not the tokenizer trainer.init_from={path} was trained "
            f"with ({own}): {diff}. Its weights would train on another tokenizer's ids. Leave "
            f"data.tokenizer unset (null) to tokenize the data with init_from's own "
            f"tokenizer.model, or give it that file.")
    return given


# The CLIs' exit codes (docs/reliability.md): 2 the path is not a checkpoint at all (bad input),
# 3 a checkpoint that cannot be loaded (incomplete, corrupt, foreign or tampered). Nothing in a
# checkpoint is unpickled unrestricted, so a refused file never runs code.
EXIT_NOT_A_CHECKPOINT, EXIT_UNLOADABLE = 2, 3


def _cli_fail(prog: str, code: int, e: Any) -> None:
    """One line, ``<prog>: error: ...``, and the exit code: no traceback for a bad checkpoint."""
    msg = " ".join(str(e).split())
    print(f"{prog}: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def export_main(argv: Optional[list[str]] = None) -> None:
    """``llama-export <checkpoint_dir> <out_dir> [--dtype fp32|bf16|fp16]``. Exit 2: the path
    is not a checkpoint; 3: the checkpoint cannot be loaded or does not fit its model args."""
    p = argparse.ArgumentParser(prog="llama-export", description="Export a llama_train checkpoint to Hugging Face format.")
    p.add_argument("checkpoint_dir", help="a llama_train checkpoint directory")
    p.add_argument("out_dir", help="where to write the Hugging Face model")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="weight dtype (default fp32)")
    a = p.parse_args(argv)
    from llama_train.checkpoint import (CheckpointError, NotACheckpoint, checkpoint_step,
                                        load_consolidated, resolve_checkpoint)
    from llama_train.paths import PathRefused, check_output

    try:  # before the checkpoint is read and converted: a read-only out_dir fails at once
        check_output(a.out_dir, "out_dir", directory=True)
    except PathRefused as e:
        _cli_fail(p.prog, EXIT_NOT_A_CHECKPOINT, e)

    try:
        ckpt = resolve_checkpoint(a.checkpoint_dir)
        args, state_dict, tokenizer_model = load_consolidated(str(ckpt))
        add_bos = bool(tokenizer_model) and trained_with_bos(ckpt)
        out = export_hf(args, state_dict, a.out_dir, tokenizer_model=tokenizer_model,
                        dtype=_DTYPES[a.dtype], add_bos=add_bos)
    except NotACheckpoint as e:
        _cli_fail(p.prog, EXIT_NOT_A_CHECKPOINT, e)
    except CheckpointError as e:
        _cli_fail(p.prog, EXIT_UNLOADABLE, e)
    except (BadInput, RuntimeError) as e:  # its weights or tokenizer do not fit its model args
        _cli_fail(p.prog, EXIT_UNLOADABLE, f"{a.checkpoint_dir} cannot be exported: "
                                           f"{type(e).__name__}: {e}")
    step = checkpoint_step(ckpt)
    print(f"exported step {step} ({ckpt}) -> {out} "
          f"({a.dtype}{', with tokenizer' if tokenizer_model else ''})")


def import_main(argv: Optional[list[str]] = None) -> None:
    """``llama-import <hf_dir> <out_file.pt>``: writes ``{"model_args": ..., "model": state_dict}``.
    Exit 2: ``hf_dir`` is not a Hugging Face model directory; 3: its config or weights cannot be
    read or are not a Llama this model implements."""
    p = argparse.ArgumentParser(prog="llama-import", description="Import a Hugging Face Llama model.")
    p.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("out_file", help="output .pt file")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast weights (default: keep)")
    a = p.parse_args(argv)
    d = Path(a.hf_dir)
    if not (d / "config.json").is_file():
        found = "it does not exist" if not d.exists() else (
            "it is not a directory" if not d.is_dir() else "it has no config.json")
        _cli_fail(p.prog, EXIT_NOT_A_CHECKPOINT,
                  f"{d} is not a Hugging Face model directory: {found}. Give the directory "
                  f"save_pretrained wrote (config.json + model*.safetensors).")
    try:
        args, sd = import_hf(d)
    except BadInput as e:  # WeightsError, or ModelArgs' ConfigError: config.json's values
        _cli_fail(p.prog, EXIT_UNLOADABLE, f"{d} cannot be imported: {e}")
    if a.dtype:
        sd = {k: v.to(_DTYPES[a.dtype]) for k, v in sd.items()}
    out = Path(a.out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_args": asdict(args), "model": sd}, out)
    print(f"imported {a.hf_dir} -> {out}")
