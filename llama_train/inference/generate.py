"""``llama-generate``: text from a trained model, ours or an export, decoded with the KV cache.

    llama-generate outputs/llama-train --prompt "The" --max-new-tokens 64
    llama-generate out/hf_model --prompt-file prompt.txt --temperature 0      # greedy
    llama-generate ckpt.pt --tokenizer tok.model --prompt A --prompt B --top-p 0.9
    llama-generate llama3.pt --tokenizer Meta-Llama-3-8B/tokenizer.json --prompt A
    llama-generate outputs/llama-train --interactive                        # a prompt per line

What it reads: a llama_train checkpoint (a ``step_N`` directory, or an output or checkpoints
directory: its newest complete checkpoint, ZeRO shards merged as ``llama-export`` merges them), a
Hugging Face Llama directory (``llama-export``'s or any ``save_pretrained``), or a ``.pt`` from
``llama-import``. The tokenizer and whether to prepend BOS come with the checkpoint (the run's
``data.add_bos``) or the export (``add_bos_token``); ``--tokenizer`` overrides (a SentencePiece
``.model``, a Hugging Face ``tokenizer.json`` or a directory holding one: data.Tokenizer). Each
prompt's text and continuation go to stdout; a line with new tokens, seconds and tokens/s goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

from llama_train.bounds import INT32_MAX, SEED_MAX, Range, check_options
from llama_train.errors import BadInput

EXIT_BAD_INPUT, EXIT_UNLOADABLE = 2, 3
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class Loaded:
    """A model ready to decode and what it came from."""

    model: Any  # model.Transformer (torch is imported when a model loads: a fast --help)
    tokenizer: Any  # data.Tokenizer
    add_bos: bool
    source: str  # "step 6 of outputs/x/checkpoints/step_00000006", "Hugging Face export d"


class GenerateError(Exception):
    """A bad argument or an unreadable model: one line, and its exit code."""

    def __init__(self, message: str, code: int = EXIT_UNLOADABLE):
        super().__init__(message)
        self.code = code


def _read_weights(path: Path, tokenizer: Optional[str]):
    """(ModelArgs, state dict, tokenizer path or None, add_bos, source) of ``path``."""
    from llama_train.checkpoint import (CheckpointError, NotACheckpoint, checkpoint_step,
                                        load_consolidated, resolve_checkpoint)
    from llama_train.hf import import_hf, read_init_from, trained_with_bos

    if path.is_file():  # llama-import's .pt: weights only
        try:
            args, sd = read_init_from(str(path), with_weights=True)
        except Exception as e:  # noqa: BLE001 - ConfigError naming what it expected
            raise GenerateError(str(e).replace("trainer.init_from=", ""), EXIT_BAD_INPUT) from None
        return args, sd, tokenizer, False, f"{path} (llama-import)"
    if (path / "config.json").is_file():  # a Hugging Face directory
        try:
            args, sd = import_hf(path)
        except BadInput as e:  # WeightsError; ModelArgs' ConfigError (config.json's values)
            raise GenerateError(f"{path} cannot be read: {e}") from None
        from llama_train.data.tokenizer import tokenizer_file_in

        tok = tokenizer_file_in(path)  # the export's own, its tokenizer.model, or tokenizer.json
        add_bos = False
        if (path / "tokenizer_config.json").is_file():
            add_bos = bool(json.loads((path / "tokenizer_config.json").read_text())
                           .get("add_bos_token", False))
        return args, sd, tokenizer or (str(tok) if tok is not None else None), add_bos, \
            f"Hugging Face model {path}"
    try:
        ckpt = resolve_checkpoint(str(path))
        args, sd, tok = load_consolidated(str(ckpt))
    except NotACheckpoint as e:
        raise GenerateError(f"{e} (or give a Hugging Face model directory, or a llama-import "
                            f".pt with --tokenizer)", EXIT_BAD_INPUT) from None
    except CheckpointError as e:
        raise GenerateError(str(e)) from None
    return args, sd, tokenizer or tok, trained_with_bos(ckpt), \
        f"step {checkpoint_step(ckpt)} of {ckpt}"


def load(path: str, tokenizer: Optional[str] = None, device: str = "cpu",
         dtype: str = "fp32") -> Loaded:
    """The model at ``path`` on ``device`` in ``dtype``, in eval mode, and its tokenizer."""
    import torch

    from llama_train.data import Tokenizer
    from llama_train.model import Transformer

    p = Path(path)
    if not p.exists():
        raise GenerateError(f"{path} does not exist: give a checkpoint or output directory, a "
                            f"Hugging Face model directory or a llama-import .pt", EXIT_BAD_INPUT)
    args, sd, tok_path, add_bos, source = _read_weights(p, tokenizer)
    if tok_path is None:
        raise GenerateError(f"{source} has no tokenizer (tokenizer.model or tokenizer.json): "
                            f"pass --tokenizer PATH (the run's data.tokenizer, or its prepared "
                            f"data's tokenizer.model or tokenizer.json)", EXIT_BAD_INPUT)
    try:
        tok = Tokenizer(tok_path)
    except Exception as e:  # noqa: BLE001 - sentencepiece's or tokenizers' own errors
        raise GenerateError(f"tokenizer {tok_path} cannot be loaded: {e}", EXIT_BAD_INPUT) from None
    if tok.vocab_size > args.vocab_size:
        raise GenerateError(f"tokenizer {tok_path} has {tok.vocab_size} pieces but the model's "
                            f"vocab_size is {args.vocab_size}: pass the run's tokenizer",
                            EXIT_BAD_INPUT)
    model = Transformer(args, device="meta")
    model.to_empty(device=device)
    model.tie_weights()
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise GenerateError(f"{source}: its weights do not fit its model args: "
                            f"{str(e).splitlines()[0]}") from None
    model.reset_rope()
    model.to(dtype=getattr(torch, _DTYPES[dtype])).eval()
    return Loaded(model, tok, add_bos, source)


@dataclass
class Generated:
    texts: List[str]  # each prompt's continuation, without the prompt
    new_tokens: int  # over the batch, up to and excluding EOS
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def complete(loaded: Loaded, prompts: Sequence[str], max_new_tokens: int,
             temperature: float = 0.8, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: int = 1234) -> Generated:
    """Continue each prompt (one ragged batch, one KV cache) by up to ``max_new_tokens``."""
    import torch

    tok, model = loaded.tokenizer, loaded.model
    ids = [tok.encode(p, bos=loaded.add_bos, eos=False) for p in prompts]
    if any(not i for i in ids):
        raise GenerateError("an empty prompt has no tokens to continue: give some text",
                            EXIT_BAD_INPUT)
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    eos = tok.eos_id if tok.eos_id >= 0 else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, eos_id=eos, generator=gen)
    except BadInput as e:  # prompt + max_new_tokens > max_seq_len
        raise GenerateError(str(e), EXIT_BAD_INPUT) from None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    texts, new = [], 0
    for row, prompt in zip(out.tolist(), ids):
        cont = row[len(prompt):len(prompt) + max_new_tokens]
        if eos is not None and eos in cont:
            cont = cont[:cont.index(eos)]
        new += len(cont)
        # decoded with its prompt, so a continuation that starts a word keeps its space
        # (sentencepiece drops a leading "▁" from a piece decoded alone)
        shown, full = tok.decode(prompt), tok.decode(prompt + cont)
        texts.append(full[len(shown):] if full.startswith(shown) else tok.decode(cont))
    return Generated(texts, new, seconds)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-generate",
        description="Sample text from a llama_train checkpoint or a Hugging Face Llama export.")
    p.add_argument("checkpoint", help="a checkpoint, output or checkpoints directory; a Hugging "
                                      "Face model directory; or a llama-import .pt")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None,
                     help="text to continue; repeat for a batch (default: 'The')")
    src.add_argument("--prompt-file", help="a file whose text is the prompt ('-': stdin)")
    src.add_argument("--interactive", "-i", action="store_true",
                     help="read prompts from stdin, one per line, until EOF")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set with this probability mass")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer", help="a sentencepiece model, a Hugging Face tokenizer.json or "
                   "a directory holding one (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda if present)")
    p.add_argument("--dtype", choices=(*_DTYPES, "auto"), default="auto",
                   help="auto: bf16 on a GPU that has it, else fp32")
    return p


# The range of each numeric option (llama_train.bounds), checked before anything is loaded:
# `--temperature nan` was a traceback after the load, and `inf` sampled uniformly.
OPTIONS = {
    "max_new_tokens": Range(1, INT32_MAX, integer=True, fix="tokens generated per prompt"),
    # above 100 any trained model's logits are flattened to a uniform draw
    "temperature": Range(0, 100, fix="0 is greedy, 1 samples the model's distribution"),
    "top_k": Range(1, INT32_MAX, integer=True, optional=True,
                   fix="sample from the k most likely tokens"),
    "top_p": Range(0, 1, lo_open=True, optional=True,
                   fix="sample from the smallest set with this probability mass"),
    "seed": Range(0, SEED_MAX, integer=True),
}


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    msg = check_options(a, OPTIONS)
    if msg is not None:
        p.error(msg)  # exit 2, before the checkpoint is read


def device_and_dtype(a: argparse.Namespace):
    import torch

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerateError(f"--device={device}: no CUDA device here (use --device cpu)",
                            EXIT_BAD_INPUT)
    dtype = a.dtype
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "fp32"
    return device, dtype


def _report(loaded: Loaded, g: Generated, a: argparse.Namespace, device: str, dtype: str) -> None:
    how = "greedy" if a.temperature == 0 else "temperature {}{}{}".format(
        a.temperature, f", top-k {a.top_k}" if a.top_k else "", f", top-p {a.top_p}" if a.top_p else "")
    print(f"llama-generate: {g.new_tokens} new tokens in {g.seconds:.2f} s "
          f"({g.tokens_per_s:,.1f} tokens/s; {how}; {device} {dtype}) from {loaded.source}",
          file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = _parser()
    a = p.parse_args(argv)
    _check(p, a)
    try:
        if a.prompt_file:
            prompts = [_read_prompt_file(a.prompt_file)]
        else:
            prompts = a.prompt or ["The"]
        device, dtype = device_and_dtype(a)
        loaded = load(a.checkpoint, a.tokenizer, device, dtype)
        settings = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                        top_k=a.top_k, top_p=a.top_p, seed=a.seed)
        if a.interactive:
            _interactive(loaded, settings, a, device, dtype)
            return
        g = complete(loaded, prompts, **settings)
        for prompt, text in zip(prompts, g.texts):
            print(prompt + text, flush=True)
        _report(loaded, g, a, device, dtype)
    except OSError as e:  # the prompt file
        print(f"llama-generate: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    except GenerateError as e:
        print(f"llama-generate: error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(e.code) from None


def _read_prompt_file(name: str) -> str:
    """The text of --prompt-file (``-``: stdin), read as UTF-8 before anything loads:
    GenerateError (exit 2) naming the file, the first byte that is not UTF-8 and the fix."""
    where = "stdin" if name == "-" else name
    if name == "-":
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream already decoded (an embedding program's)
            return sys.stdin.read()
        data = stream.read()
    else:
        data = Path(name).read_bytes()  # OSError: named by main
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerateError(
            f"--prompt-file {where} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
            f"{e.start} ({e.reason}). Save the prompt as UTF-8 (e.g. `iconv -f latin1 -t "
            f"utf-8 {where if name != '-' else 'FILE'} > prompt.txt`).", EXIT_BAD_INPUT) from None


def _interactive(loaded: Loaded, settings: dict, a: argparse.Namespace, device: str,
                 dtype: str) -> None:
    """One prompt per line from stdin (a prompt marker when it is a terminal), until EOF."""
    tty = sys.stdin.isatty()
    print(f"llama-generate: {loaded.source}; a prompt per line, Ctrl-D to quit", file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            break
        prompt = line.rstrip("\n")
        if not prompt.strip():
            continue
        try:
            g = complete(loaded, [prompt], **settings)
        except GenerateError as e:  # a prompt too long: say so, take the next one
            print(f"llama-generate: error: {e}", file=sys.stderr)
            continue
        print(prompt + g.texts[0], flush=True)
        _report(loaded, g, a, device, dtype)


if __name__ == "__main__":
    main()
