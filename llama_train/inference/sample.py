"""The text sample a run ends with: a quick look at what the model learnt (``sample.*``)."""

from __future__ import annotations

import torch

from llama_train.config import SampleConfig
from llama_train.data import Tokenizer


def generate_sample(engine, sample_cfg: SampleConfig, seed: int, tokenizer_path: str,
                    device: torch.device, is_main: bool) -> str:
    """Text from the trained model. Rank 0 generates; under ZeRO-3 every rank runs the same
    decoding (same seed, same logits, so the same number of steps), and DeepSpeed gathers one
    layer at a time as it does in training, never the whole model."""
    tok = Tokenizer(tokenizer_path)
    model = engine.module
    model.eval()
    prompt = tok.encode(sample_cfg.prompt, bos=False, eos=False)
    gen = torch.Generator(device=device).manual_seed(seed)
    text = ""
    if is_main or engine.zero_stage == 3:
        out = model.generate(torch.tensor([prompt], device=device),
                             max_new_tokens=sample_cfg.tokens, temperature=sample_cfg.temperature,
                             top_k=sample_cfg.top_k, eos_id=tok.eos_id, generator=gen)
        text = tok.decode(out[0].tolist())
    model.train()
    return text
