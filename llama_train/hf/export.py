"""Writing a Hugging Face model directory (:func:`export_hf`, ``llama-export``): sharded
safetensors, config.json, generation_config.json, and the run's tokenizer with the files
``AutoTokenizer`` loads, so the export encodes text to the ids training saw.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional

import torch

from llama_train.data.errors import DataError
from llama_train.data.tokenizer import EXPORT_KEY  # light: no tokenizer library imported
from llama_train.hf.convert import PathLike, to_hf_config, to_hf_state_dict
from llama_train.model import ModelArgs
from llama_train.model.weights import WeightsError

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_SHARD_BYTES = 5 * 2**30


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
