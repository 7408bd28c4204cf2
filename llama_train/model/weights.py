"""Weights we did not write, checked against their config before they are used (issue 54).

A Hugging Face directory (:mod:`llama_train.hf`), a ``llama-import`` file and a checkpoint's
merged weights (:func:`llama_train.checkpoint.load_consolidated`) come with a config that says
what they are; nothing forced the two to agree. An int8 model was imported and trained on as
floats, a NaN went into the file, a config of 80 layers over files of 2 built the 80-layer
model first. Here every tensor's name, dtype and shape is compared with what the config implies
(from file headers or memory-mapped tensors: nothing is loaded or allocated), and every value
where they are used. Each refusal is one :class:`WeightsError` naming the tensor, its file and
the fix. Plain torch and :class:`ModelArgs`: the converters and the checkpoint code both import
it, and neither imports the other for it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

import torch

from llama_train.errors import BadInput
from llama_train.model.args import ModelArgs


class WeightsError(BadInput):
    """Weights that are not a float model of exactly their config's shapes (integer or quantized
    tensors, NaN or inf, a shape, layer count or vocabulary the config does not describe), or a
    file a model directory names outside itself: one message naming the tensor or file and the
    fix. A BadInput, so the CLIs refuse it in one line."""


FLOATS = ("float32", "bfloat16", "float16", "float64")  # what a model is read as
# the tensors quantizers add beside (or instead of) a weight: bitsandbytes (SCB, weight_format;
# absmax, quant_map, quant_state.* of 4-bit), GPTQ and AWQ (qweight, qzeros, scales, g_idx),
# FP8 and compressed-tensors (weight_scale, input_scale, weight_packed, weight_zero_point ...)
_QUANT_PARTS = {"SCB", "weight_format", "absmax", "quant_map", "nested_absmax",
                "nested_quant_map", "qweight", "qzeros", "scales", "g_idx", "weight_scale",
                "weight_scale_inv", "input_scale", "weight_packed", "weight_zero_point",
                "weight_shape", "weight_global_scale"}
REQUANT_FIX = ("llama_train reads float weights (float32, bfloat16 or float16) only: import "
               "the unquantized release of the model, or dequantize it first (transformers: "
               "model.dequantize(), then save_pretrained)")
# tensors a model's files may hold that are no weights of ours (RoPE tables, HF's inv_freq)
_IGNORED = ("rotary_emb.inv_freq", "rope_cos", "rope_sin")


def _quantization_part(name: str) -> Optional[str]:
    """The part of a tensor name that only a quantizer writes (``qweight``, ``SCB``, ...)."""
    return next((p for p in name.split(".") if p in _QUANT_PARTS or p.startswith("quant_state")),
                None)


def _itemsize(dtype: str) -> int:
    t = getattr(torch, dtype, None)
    return t.itemsize if isinstance(t, torch.dtype) else 4


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""  # pragma: no cover


def _layer_shapes(args: ModelArgs, hf: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Our per-layer suffix -> (its shape, the config fields that imply it, named as in HF's
    config.json or our model_args)."""
    d, f = args.dim, args.ffn_hidden_dim
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    D, F, Q, KV = (("hidden_size", "intermediate_size", "num_attention_heads x head_dim",
                    "num_key_value_heads x head_dim") if hf else
                   ("dim", "ffn_hidden_dim", "n_heads x head_dim", "n_kv_heads x head_dim"))
    return {
        "attention.wq.weight": ((q, d), f"[{Q}, {D}]"),
        "attention.wk.weight": ((kv, d), f"[{KV}, {D}]"),
        "attention.wv.weight": ((kv, d), f"[{KV}, {D}]"),
        "attention.wo.weight": ((d, q), f"[{D}, {Q}]"),
        "feed_forward.w1.weight": ((f, d), f"[{F}, {D}]"),
        "feed_forward.w2.weight": ((d, f), f"[{D}, {F}]"),
        "feed_forward.w3.weight": ((f, d), f"[{F}, {D}]"),
        "attention_norm.weight": ((d,), f"[{D}]"),
        "ffn_norm.weight": ((d,), f"[{D}]"),
    }


def expected_shapes(args: ModelArgs, names: Optional[Mapping[str, str]] = None
                    ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a model of ``args`` -> (its shape, the config fields that imply it), in
    the model's order: our names, or another layout's through ``names`` (ours -> theirs, e.g.
    Hugging Face's, whose config fields the rules then name). Tied embeddings: the output
    matrix too (optional in a file). From the config alone: nothing is built or allocated."""
    hf = names is not None
    d, v = args.dim, args.vocab_size
    D = "hidden_size" if hf else "dim"
    ours = {"tok_embeddings.weight": ((v, d), f"[vocab_size, {D}]"),
            "norm.weight": ((d,), f"[{D}]"), "output.weight": ((v, d), f"[vocab_size, {D}]")}
    layer = _layer_shapes(args, hf)
    for i in range(args.n_layers):
        ours.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    return ours if names is None else {names[k]: s for k, s in ours.items()}


def parameters(args: ModelArgs) -> int:
    """What ``args`` implies in parameters (tied embeddings once), from the config alone."""
    layer = sum(math.prod(s) for s, _ in _layer_shapes(args, False).values())
    return (args.n_layers * layer + args.dim
            + args.vocab_size * args.dim * (1 if args.tie_embeddings else 2))


def check_tensors(found: Mapping[str, tuple[str, tuple[int, ...], str]], args: ModelArgs,
                  config: str, names: Optional[Mapping[str, str]] = None) -> None:
    """``found``: every tensor's name -> (dtype as torch names it, shape, the file holding it),
    read from file headers or memory-mapped tensors: nothing is loaded. WeightsError unless
    they are a float model of exactly the shapes ``config`` (``args``) implies: no quantization
    tensors, no integer or float8 dtype, as many layers, as large a vocabulary, the same
    tensors, every shape equal (``names``: ours -> the files' names, as in
    :func:`expected_shapes`). Each message names the tensor, its file and the fix, and where
    the shapes differ, the parameters and bytes the config implies beside what the files hold:
    names, dtypes and shapes are all these checks read, so a config that claims far more than
    the files hold (80 layers where they hold 2, a width that would need TiB) is refused before
    anything of its size is allocated."""
    hf = names is not None
    held = sum(math.prod(shape) for _, shape, _ in found.values())
    held_bytes = sum(math.prod(shape) * _itemsize(dt) for dt, shape, _ in found.values())
    want = parameters(args)
    sizes = (f"{config} implies {want:,} parameters ({human_bytes(2 * want)} in bfloat16), "
             f"the files hold {held:,} ({human_bytes(held_bytes)})")

    _check_float(found)
    _check_layer_count(found, args, config, hf, sizes)

    expected = expected_shapes(args, names)
    embed, head = (names or {}).get("tok_embeddings.weight", "tok_embeddings.weight"), \
        (names or {}).get("output.weight", "output.weight")
    _check_vocab_rows(found, args, config, (embed, head))

    optional = {head} if args.tie_embeddings else set()
    have = {n for n in found if not n.endswith(_IGNORED)} - optional
    missing, unexpected = sorted(set(expected) - optional - have), sorted(have - set(expected))
    if missing or unexpected:
        def show(keys: list) -> str:
            return ", ".join(keys[:5]) + (f" ... (+{len(keys) - 5})" if len(keys) > 5 else "")
        parts = ([f"missing {len(missing)} tensor(s): {show(missing)}"] if missing else [])
        parts += ([f"unexpected {len(unexpected)}: {show(unexpected)}"] if unexpected else [])
        fix = (f"save the unwrapped model's state_dict (the names carry a wrapper's prefix)"
               if any(k.startswith(("module.", "_orig_mod.")) for k in unexpected) else
               f"use the {config} they were saved with")
        raise WeightsError(f"the tensors do not match {config}: {'; '.join(parts)} ({sizes}): "
                           f"{fix}")
    bad = [(n, found[n], expected[n]) for n in expected  # in the model's order
           if n in have and found[n][1] != expected[n][0]]
    if bad:
        name, (_, shape, file), (want_shape, rule) = bad[0]
        more = f"; {len(bad) - 1} more tensor(s) differ" if len(bad) > 1 else ""
        raise WeightsError(
            f"tensor {name} in {file} has shape {list(shape)} but {config} implies "
            f"{list(want_shape)} ({rule}){more}; {sizes}. The config does not describe these "
            f"weights: use the {config} they were saved with.")


def _check_float(found: Mapping[str, tuple[str, tuple[int, ...], str]]) -> None:
    """check_tensors' first check: no quantization tensors, then no non-float dtype."""
    for name, (_, _, file) in found.items():
        part = _quantization_part(name)
        if part is not None:
            raise WeightsError(f"tensor {name} in {file} is quantization data ({part!r}): the "
                               f"model is quantized (bitsandbytes, GPTQ, AWQ or FP8). "
                               f"{REQUANT_FIX}")
    odd = [(n, dt, f) for n, (dt, _, f) in found.items() if dt not in FLOATS]
    if odd:
        name, dtype, file = odd[0]
        raise WeightsError(
            f"tensor {name} in {file} is {dtype} ({len(odd)} of {len(found)} tensors are not "
            f"float16, bfloat16, float32 or float64): integer or quantized weights, which would "
            f"be cast to float and trained on as if they were the model. {REQUANT_FIX}")


def _check_layer_count(found: Mapping[str, tuple[str, tuple[int, ...], str]], args: ModelArgs,
                       config: str, hf: bool, sizes: str) -> None:
    """check_tensors' layer check: the files hold exactly ``args.n_layers`` layers."""
    n_layers_key = "num_hidden_layers" if hf else "n_layers"
    layer_re = re.compile(r"model\.layers\.(\d+)\." if hf else r"layers\.(\d+)\.")
    layers = sorted({int(m.group(1)) for n in found for m in [layer_re.match(n)] if m})
    if len(layers) != args.n_layers:
        span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layer tensors"
        fix = (f"these weights are another model's: use the {config} they were saved with"
               if len(layers) > args.n_layers else
               "give the files that hold the model's weights" if not layers else
               f"set {n_layers_key}={len(layers)} in {config} if these are all the weights, or "
               f"add the missing shard files")
        raise WeightsError(f"{config} says {n_layers_key}={args.n_layers} but the weights hold "
                           f"{len(layers)} layer(s) ({span}); {sizes}: {fix}.")


def _check_vocab_rows(found: Mapping[str, tuple[str, tuple[int, ...], str]], args: ModelArgs,
                      config: str, keys: tuple[str, str]) -> None:
    """check_tensors' vocabulary check: the embedding and output (``keys``) have vocab_size rows."""
    for key in keys:
        if key in found and len(found[key][1]) == 2 and found[key][1][0] != args.vocab_size:
            rows, file = found[key][1][0], found[key][2]
            raise WeightsError(
                f"{config} says vocab_size={args.vocab_size} but {key} in {file} has {rows:,} "
                f"rows, one per token: the recorded vocabulary is not these weights'. Set "
                f"vocab_size={rows} in {config} (the tokenizer must have at most {rows:,} "
                f"tokens).")


def check_finite(sd: Mapping[str, torch.Tensor], where: Mapping[str, str]) -> None:
    """WeightsError naming the first tensor holding a NaN or inf (a model trained or saved after
    it diverged: every loss from it would be NaN), its file (``where``), how many and the index
    of the first. Read in chunks of 16M values, by their min and max (NaN propagates through
    both, and a finite min and max bound every value): 1.6 GiB/s in bf16 and 4.5 in fp32 on
    the 2-core development machine, where ``isfinite(t).all()`` read 0.2-0.4 (an 8B model in
    bf16, 15 GiB: about 10 s, not a minute)."""
    chunk = 1 << 24
    for name in sorted(sd):
        t = sd[name]
        if not t.is_floating_point() or t.numel() == 0:
            continue
        flat = t.reshape(-1)  # a view: tensors read from files are contiguous
        parts = [flat[s:s + chunk] for s in range(0, flat.numel(), chunk)]
        for i, part in enumerate(parts):
            lo, hi = torch.aminmax(part)
            if bool(torch.isfinite(lo) & torch.isfinite(hi)):
                continue
            nan = sum(int(torch.isnan(p).sum()) for p in parts)
            inf = sum(int(torch.isinf(p).sum()) for p in parts)
            first = i * chunk + int((~torch.isfinite(part)).nonzero()[0])
            index = []
            for size in reversed(t.shape):  # the flat index as one per dimension
                index.insert(0, first % size)
                first //= size
            raise WeightsError(
                f"tensor {name} in {where.get(name, '?')} holds {nan:,} NaN and {inf:,} inf "
                f"value(s) (the first at index {index}): non-finite weights never train or "
                f"generate (every loss is NaN). Use a copy saved before the model diverged, or "
                f"download it again.")


def check_state_dict(sd: Mapping[str, Any], args: ModelArgs, source: str, config: str,
                     finite: bool = True) -> None:
    """WeightsError unless ``sd`` (our names: a llama-import .pt, a checkpoint's merged
    weights) is a float model of exactly ``args``' shapes and, with ``finite``, every value is
    finite. ``source``: the file named in messages; ``config``: where ``args`` came from."""
    found = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise WeightsError(f"{source}: model[{name!r}] is a {type(t).__name__}, not a tensor")
        found[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), source)
    check_tensors(found, args, config)
    if finite:
        check_finite(sd, {n: source for n in sd})
