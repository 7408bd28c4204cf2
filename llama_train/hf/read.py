"""Reading a Hugging Face Llama directory we did not write (:func:`import_hf`,
``llama-import``, ``trainer.init_from``): checked before it is loaded or used (issue 54; the
checks themselves, shared with llama_train.checkpoint: llama_train.model.weights): config.json, the
safetensors headers, every file inside the directory, and the tokenizer it carries.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch

from llama_train.hf.convert import (NotALlamaModel, PathLike, _name_map, from_hf_config,
                                    from_hf_state_dict)
from llama_train.model import ModelArgs
from llama_train.model.weights import REQUANT_FIX, WeightsError, check_finite, check_tensors


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
