"""``trainer.init_from``: weights to start a run from (a Hugging Face Llama directory or a
``llama-import`` .pt), checked against the model config before the process group starts, and
the tokenizer a fresh start from them must tokenize its data with (issue 53).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

import torch

from llama_train.hf.convert import NotALlamaModel, from_hf_config
from llama_train.hf.read import _read_hf_dir, import_hf, init_from_tokenizer_file
from llama_train.model import ModelArgs
from llama_train.model.weights import WeightsError, check_state_dict


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
