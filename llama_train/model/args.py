"""The model's shape: :class:`ModelArgs` (validated in ``__post_init__``), its parameter and FLOP
counts and the presets in ``configs/model``. Plain Python (no torch), so configs, planning and
``llama-train --help`` never wait for torch to import; :mod:`llama_train.model` builds the
network from it and re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from llama_train.bounds import Range
from llama_train.errors import ConfigError
from llama_train.policy import may_change

ROPE_SCALING_TYPES = ("default", "linear", "llama3")

# Beyond these a shape builds nothing that could train (every field is also checked positive):
# 8x the width of Llama 3 405B (16384), 32x its depth (126), a uint32 token file's ids, RoPE
# tables for 16M positions (built whole at model build), a SwiGLU width rounded to 64K.
_RANGES = {
    "dim": Range(1, 2**17, integer=True, fix="the residual width (Llama 3 405B: 16384)"),
    "n_layers": Range(1, 2**12, integer=True, fix="transformer blocks (Llama 3 405B: 126)"),
    "vocab_size": Range(1, 2**32, integer=True, fix="token ids are stored as uint32 at most"),
    "multiple_of": Range(1, 2**16, integer=True, fix="the SwiGLU width's rounding (LLaMA: "
                                                     "256-4096)"),
    "max_seq_len": Range(1, 2**24, integer=True, fix="positions the RoPE tables cover"),
    "norm_eps": Range(0, 1, lo_open=True, hi_open=True, fix="RMSNorm's guard (LLaMA: 1e-5)"),
    "init_std": Range(0, 1, lo_open=True, fix="the weights' initial standard deviation (0.02)"),
    "ffn_dim_multiplier": Range(0, 16, lo_open=True, optional=True,
                                fix="null for the plain LLaMA rule, or e.g. 1.3 as in LLaMA-3"),
}

# model.loss_chunk_tokens: null: chunks from this vocabulary up, of at most this many fp32 logits
LOSS_CHUNK_MIN_VOCAB = 32000
LOSS_CHUNK_ELEMENTS = 2**28  # 1 GiB of fp32 logits per chunk
LOSS_CHUNK_RULE = (f"chunks of the largest power-of-two tokens whose fp32 logits fit in 1 GiB "
                   f"from vocab_size {LOSS_CHUNK_MIN_VOCAB} up, else whole logits")


@dataclass
class RopeScaling:
    """How RoPE frequencies are stretched so a model reaches past the context it was trained at.

    ``default``: none. ``linear``: every frequency divided by ``factor`` (position interpolation,
    Chen et al. 2023). ``llama3`` (Llama 3.1-3.3): wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept, those longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and the
    band between is interpolated smoothly. Keys under ``model.rope_scaling``; the names are
    Hugging Face's ``rope_scaling`` ones, so converters copy them across.
    """

    type: str = "default"
    """default | linear | llama3 (Hugging Face's ``rope_type``)."""
    factor: float = 1.0
    """How many times longer the target context is than the original (Llama 3.1: 8)."""
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths above original/low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths below original/high_freq_factor are left alone."""
    original_max_position_embeddings: int = 8192
    """llama3 only: the context the model was pretrained at (Llama 3: 8192)."""

    def check(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise ConfigError(f"model.rope_scaling.type={self.type!r} is not supported: choose one of "
                              f"{', '.join(ROPE_SCALING_TYPES)}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            setattr(self, name, _check_positive_float(f"rope_scaling.{name}", getattr(self, name)))
        _check_positive_int("rope_scaling.original_max_position_embeddings",
                            self.original_max_position_embeddings)
        for name, rng in (("factor", Range(hi=2**16, fix="Llama 3.1 stretches 8 times")),
                          ("original_max_position_embeddings", _RANGES["max_seq_len"])):
            msg = rng.message(f"model.rope_scaling.{name}", getattr(self, name))
            if msg is not None:
                raise ConfigError(msg)
        if self.type != "default" and self.factor < 1.0:
            raise ConfigError(f"model.rope_scaling.factor={self.factor} must be >= 1: it stretches the "
                              f"context by that many times (Llama 3.1 uses 8)")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must be greater than "
                f"low_freq_factor={self.low_freq_factor} (Llama 3.1: 4 and 1): the band between "
                f"them is interpolated")

    @classmethod
    def coerce(cls, value: Any) -> "RopeScaling":
        """From None, a mapping (a checkpoint's model_args.json, a plain dict) or itself."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            keys = ", ".join(f.name for f in fields(cls))
            raise ConfigError(f"model.rope_scaling must be a mapping of {keys}, got {value!r}")
        d = dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join('model.rope_scaling.' + k for k in unknown)}:"
                              f" valid keys are {', '.join(sorted(known))}")
        return cls(**d)


@dataclass
class ModelArgs:
    """Shape of a LLaMA model. Defaults are a valid tiny model (~1 M parameters).

    Field names are the Hydra keys under ``model.`` (``configs/model/<preset>.yaml`` lists them all).
    """

    dim: int = 128
    """Residual stream width D."""
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    vocab_size: int = 2048
    multiple_of: int = 64
    """SwiGLU hidden size is rounded up to a multiple of this (see ``ffn_hidden_dim``)."""
    ffn_dim_multiplier: Optional[float] = None
    """Scales the SwiGLU hidden size before rounding (LLaMA-2 70B and LLaMA-3 use 1.3)."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """Frequency scaling for a context beyond the pretraining one (Llama 3.1: type llama3)."""
    max_seq_len: int = 256
    """Longest sequence the RoPE tables (and the KV cache) cover."""
    tie_embeddings: bool = False
    """Share the output head with the token embedding matrix."""
    init_std: float = 0.02
    activation_checkpointing: bool = may_change(False)
    """Recompute each block in backward (per-block, non-reentrant); training mode only."""
    loss_chunk_tokens: Optional[int] = may_change(None)
    """Compute the output projection and the loss this many tokens at a time, never the whole
    (tokens, vocab) logits nor their gradient (training and evaluation losses; logits asked for
    without targets stay whole). 0: off; null: :attr:`loss_chunk` picks (on from a 32000-token
    vocabulary). Same loss and gradients up to float rounding, so it may change on resume."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is not None:
            _check_positive_int("n_kv_heads", self.n_kv_heads)
        for name in ("norm_eps", "rope_theta", "init_std"):
            setattr(self, name, _check_positive_float(name, getattr(self, name)))
        if self.ffn_dim_multiplier is not None:
            self.ffn_dim_multiplier = _check_positive_float(
                "ffn_dim_multiplier", self.ffn_dim_multiplier,
                hint="use null for the plain LLaMA rule, or e.g. 1.3 as in LLaMA-3")
        for name, rng in _RANGES.items():  # the upper bounds (and norm_eps, init_std below 1)
            msg = rng.message(f"model.{name}", getattr(self, name))
            if msg is not None:
                raise ConfigError(msg)
        self.rope_scaling = RopeScaling.coerce(self.rope_scaling)
        self.rope_scaling.check()
        for name in ("tie_embeddings", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.{name}={getattr(self, name)!r} must be true or false")
        c = self.loss_chunk_tokens
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 2**24):
            raise ConfigError(f"model.loss_chunk_tokens={c!r} must be a whole number of tokens in "
                              f"0..{2**24} (0: whole logits) or null (auto: {LOSS_CHUNK_RULE})")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                "choose n_heads that divides dim (head_dim = dim / n_heads)")
        if self.head_dim % 2:
            raise ConfigError(
                f"model.dim={self.dim} / model.n_heads={self.n_heads} gives an odd head_dim="
                f"{self.head_dim}, but RoPE rotates feature pairs: choose dim and n_heads so that "
                "dim / n_heads is even")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads="
                f"{self.n_kv_heads}: choose n_kv_heads that divides n_heads (each key/value head "
                "serves n_heads / n_kv_heads query heads), or null for plain multi-head attention")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads with the ``None`` default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, by Meta's rule.

        A SwiGLU block has three matrices instead of two, so LLaMA starts from 2/3 of the usual
        4*dim to keep the parameter count of a 4*dim MLP: ``hidden = int(2 * 4 * dim / 3)``.
        Optionally scale it, ``hidden = int(ffn_dim_multiplier * hidden)``, then round UP to a
        multiple of ``multiple_of`` for hardware-friendly matmul shapes. Examples: 7B
        (4096, 256) -> 11008; LLaMA-3 8B (4096, 1024, x1.3) -> 14336; 70B (8192, 4096, x1.3) -> 28672.
        """
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the loss (0: whole logits): ``loss_chunk_tokens``, or when null
        the largest power of two whose fp32 logits fit in 1 GiB from a 32000-token vocabulary
        (LLaMA 1/2's) up: 8192 tokens at 32000, 2048 at Llama 3's 128256. Below that the whole
        logits are small next to the blocks' activations (docs/performance.md, "Chunked loss")."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        if self.vocab_size < LOSS_CHUNK_MIN_VOCAB:
            return 0
        return 1 << max((LOSS_CHUNK_ELEMENTS // self.vocab_size).bit_length() - 1, 0)

    SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim",
                    "tie_embeddings")

    def shape_differences(self, other: "ModelArgs") -> list:
        """``[(name, ours, theirs)]`` for each field that gives ``other``'s weights other shapes
        than ours: their state dict would not load into this model."""
        return [(n, getattr(self, n), getattr(other, n)) for n in self.SHAPE_FIELDS
                if getattr(self, n) != getattr(other, n)]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelArgs":
        """Build from a plain dict or an OmegaConf ``DictConfig``; unknown keys are an error."""
        try:  # a Hydra/OmegaConf node: resolve interpolations into plain Python values
            from omegaconf import DictConfig, OmegaConf

            if isinstance(d, DictConfig):
                d = OmegaConf.to_container(d, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        if not isinstance(d, Mapping):
            raise ConfigError(f"model config must be a mapping of ModelArgs fields, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"unknown model config key(s) {', '.join('model.' + k for k in unknown)}: "
                f"valid keys are {', '.join(sorted(known))}")
        return cls(**dict(d))


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """The LLaMA SwiGLU hidden-size rule; see ``ModelArgs.ffn_hidden_dim``."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"model.{name}={value!r} must be an integer (got {type(value).__name__})")
    if value <= 0:
        raise ConfigError(f"model.{name}={value} must be a positive integer")


def _check_positive_float(name: str, value: Any, hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"model.{name}={value!r} must be a number (got {type(value).__name__})")
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"model.{name}={value} must be a positive finite number" + (f": {hint}" if hint else ""))
    return float(value)


# --------------------------------------------------------------------------------------------
# Analytic helpers (no module is built)
# --------------------------------------------------------------------------------------------


def _layer_matmul_params(args: ModelArgs) -> int:
    d, hd = args.dim, args.head_dim
    attn = d * args.n_heads * hd * 2 + d * args.kv_heads * hd * 2  # wq, wo + wk, wv
    ffn = 3 * d * args.ffn_hidden_dim  # w1, w2, w3
    return attn + ffn


def count_params(args: ModelArgs) -> dict:
    """Parameter counts computed from the args alone.

    ``total`` counts a tied embedding/output matrix once; ``embedding`` is ``tok_embeddings`` only;
    ``non_embedding = total - embedding`` (so it includes the output head when untied).
    """
    embedding = args.vocab_size * args.dim
    per_layer = _layer_matmul_params(args) + 2 * args.dim  # + attention_norm, ffn_norm
    output = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = embedding + args.n_layers * per_layer + args.dim + output  # + final norm
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


def param_shapes(args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of each parameter, as ``Transformer.named_parameters()`` yields them
    (a tied output matrix once): what planning needs of a model (its largest parameter, the
    small ones ZeRO-3 keeps whole) without building one, which took llama3_8b a minute on a
    busy 2-core machine (tests check it equals a meta-device build of every preset)."""
    d, hd, f = args.dim, args.head_dim, args.ffn_hidden_dim
    layer = [("attention.wq", (args.n_heads * hd, d)), ("attention.wk", (args.kv_heads * hd, d)),
             ("attention.wv", (args.kv_heads * hd, d)), ("attention.wo", (d, args.n_heads * hd)),
             ("feed_forward.w1", (f, d)), ("feed_forward.w2", (d, f)), ("feed_forward.w3", (f, d)),
             ("attention_norm", (d,)), ("ffn_norm", (d,))]
    shapes = [("tok_embeddings.weight", (args.vocab_size, d))]
    shapes += [(f"layers.{i}.{name}.weight", shape) for i in range(args.n_layers)
               for name, shape in layer]
    shapes.append(("norm.weight", (d,)))
    if not args.tie_embeddings:
        shapes.append(("output.weight", (args.vocab_size, d)))
    return shapes


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B convention.

    ``6 * N_matmul + 12 * n_layers * dim * seq_len``: ``N_matmul`` counts every weight used in a
    matmul, the output head included (even when tied, the matmul still happens) and the embedding
    lookup and norms excluded; the second term is the attention score/value matmuls (QK^T and AV,
    full T x T, no discount for the causal mask).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive")
    n_matmul = args.n_layers * _layer_matmul_params(args) + args.vocab_size * args.dim
    return float(6 * n_matmul + 12 * args.n_layers * args.dim * seq_len)


def list_presets() -> list[str]:
    """Names of the model presets in ``configs/model``."""
    from llama_train.paths import CONFIG_DIR

    return sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml"))


def load_preset(name_or_path: Union[str, Path]) -> ModelArgs:
    """ModelArgs from ``configs/model/<name>.yaml`` or from a yaml file path."""
    from omegaconf import OmegaConf

    from llama_train.paths import CONFIG_DIR

    p = Path(name_or_path)
    if p.suffix not in (".yaml", ".yml") and len(p.parts) == 1:
        p = Path(CONFIG_DIR) / "model" / f"{name_or_path}.yaml"
        if not p.is_file():
            raise ConfigError(
                f"unknown model preset {str(name_or_path)!r}: choose one of {', '.join(list_presets())} "
                f"(files in {Path(CONFIG_DIR) / 'model'}) or pass a yaml path")
    elif not p.is_file():
        raise ConfigError(f"model config file {str(p)!r} does not exist")
    cfg = OmegaConf.load(p)
    try:
        return ModelArgs.from_dict(cfg)
    except ValueError as e:
        raise ConfigError(f"{p}: {e}") from None
