"""The tensor functions of the LLaMA model (llama_train.model, which re-exports every one):
RoPE frequencies (with Llama 3.1's scaling), tables and the interleaved-pair rotation, the
cross-entropy with a lean backward, document masks of packed windows, and next-token sampling. Plain torch: no nn.Module, no ModelArgs, no
DeepSpeed or process groups.

RoPE convention and document masking: see llama_train.model's module docstring.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F


def rope_inv_freq(head_dim: int, theta: float, scaling: Any = None,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """fp32 (head_dim // 2,) angular frequencies: pair i turns at ``theta^(-2i/hd)`` radians per
    position, stretched by ``scaling`` (a :class:`llama_train.model_args.RopeScaling`; None or
    type ``default`` leaves them alone)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    kind = "default" if scaling is None else scaling.type
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "llama3":
        # Meta's apply_scaling (Llama 3.1): keep short wavelengths, divide long ones by factor,
        # blend linearly in 1/wavelength across the band between.
        old = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        out = torch.where(wavelen > old / lo, inv_freq / scaling.factor, blended)
        return torch.where(wavelen < old / hi, inv_freq, out)
    return inv_freq


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                device: Optional[torch.device] = None,
                scaling: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables, each (max_seq_len, head_dim // 2), from :func:`rope_inv_freq`."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)  # (max_seq_len, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved feature pairs (x0, x1), (x2, x3), ... (Meta's convention).

    x: (B, T, heads, hd); cos, sin: (T, hd/2). Computed in fp32 and cast back, like the reference.
    Pair (x0, x1) read as the complex number x0 + i*x1 times cos + i*sin is exactly
    (x0*cos - x1*sin, x0*sin + x1*cos): one complex multiply forward and one backward instead of
    ~7 elementwise kernels and a stack each way (4.5x faster on CPU, same bits; see
    docs/performance.md).
    """
    xf = x.float()
    if xf.stride(-1) != 1 or xf.storage_offset() % 2:  # view_as_complex needs whole pairs
        xf = xf.clone(memory_format=torch.contiguous_format)
    xc = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))  # (B, T, heads, hd/2) complex
    rot = torch.complex(cos.float(), sin.float())[:, None, :]  # (T, 1, hd/2)
    return torch.view_as_real(xc * rot).flatten(-2).type_as(x)


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over targets != ignore_index whose backward writes the gradient once.

    ``F.cross_entropy`` backward zero-fills an (N, V) buffer for nll_loss, scatters into it, then
    runs log_softmax's backward over two more (N, V) passes. The gradient is simply
    ``(softmax - onehot) * g / n``: exp of the saved log-probabilities, minus one at the targets,
    scaled in place. Same forward, same loss bits; the gradient agrees to float rounding.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)  # (N, V)
        valid = targets != ignore_index  # (N,)
        safe = torch.where(valid, targets, 0)
        n = valid.sum()
        loss = -(logp.gather(1, safe[:, None]).squeeze(1) * valid).sum() / n
        ctx.save_for_backward(logp, safe, valid, n)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logp, safe, valid, n = ctx.saved_tensors
        grad = logp.exp()  # softmax, (N, V)
        grad.scatter_add_(1, safe[:, None], torch.full_like(grad[:, :1], -1.0))
        grad.mul_((grad_loss / n * valid)[:, None].to(grad.dtype))
        return grad, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, ignore_index=ignore_index)`` (mean) with a leaner
    backward. logits (N, V) floating point, targets (N,) int64."""
    if not torch.is_grad_enabled() or not logits.requires_grad:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    return _CrossEntropy.apply(logits, targets, ignore_index)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) tokens -> (B, T) long id of the document each position belongs to, for ``doc_ids``.

    Documents are numbered 0, 1, ... from the start of each row; an EOS belongs to the document it
    ends (exclusive cumulative sum of ``tokens == eos_id``), so it never sees the next document
    and the next document's first token is still predicted from it.
    """
    eos = (tokens == eos_id).long()
    return eos.cumsum(-1) - eos


def document_mask(doc_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, T) document ids -> additive (B, 1, T, T) SDPA mask: 0 where query i may attend key j
    (j <= i, same document), -inf elsewhere.

    Additive in the compute dtype rather than boolean: SDPA converts a boolean mask to exactly
    this in every call, i.e. once per layer, and the fused kernels save the converted copy for
    backward; one tensor built here is shared by all layers. Every row keeps its diagonal, so no
    row is fully masked (no NaN).
    """
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (batch, seq_len), got shape {tuple(doc_ids.shape)}")
    T = doc_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal  # (B, T, T)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]  # (B, 1, T, T)


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                      top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). Greedy at temperature 0, else top-k then nucleus (top-p).

    Nucleus keeps the smallest set of most likely tokens whose probability reaches top_p (the top
    token is always kept).
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] or None")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # probability of strictly more likely tokens
        sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
