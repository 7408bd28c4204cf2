"""The tensor functions of the LLaMA model (llama_train.model, which re-exports every one):
RoPE frequencies (with Llama 3.1's scaling), tables and the interleaved-pair rotation, the
cross-entropy with a lean backward and the chunked one that never holds the whole logits
(``linear_cross_entropy``), document masks of packed windows, and next-token sampling. Plain
torch: no nn.Module, no ModelArgs, no DeepSpeed or process groups.

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
    position, stretched by ``scaling`` (a :class:`llama_train.model.args.RopeScaling`; None or
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
    if torch.compiler.is_compiling():
        # traced: real pairs, which inductor fuses into one kernel (it generates no code for
        # complex ops), and no layout check (a graph break: storage_offset is no tensor op)
        x0, x1 = xf.unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, heads, hd/2) each
        c, s = cos.float()[:, None, :], sin.float()[:, None, :]  # (T, 1, hd/2)
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2).type_as(x)
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


def _chunked_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                           ignore_index: int, chunk: int, scale: Optional[torch.Tensor] = None,
                           grad_h: Optional[torch.Tensor] = None,
                           grad_w: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 sum over targets != ignore_index of the cross-entropy of ``h @ w^T``, ``chunk`` rows
    at a time: one (chunk, V) fp32 buffer holds a chunk's logits, then (in place) their
    softmax and gradient. Given ``scale`` (0-d), also writes ``grad_h`` and adds into ``grad_w``
    the gradient of ``scale * sum``, ``(softmax - onehot) * scale`` per valid row as in
    :class:`_CrossEntropy`. h (N, D) and w (V, D) in the compute dtype, targets (N,) int64."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for lo in range(0, h.size(0), chunk):
        hc, tc = h[lo:lo + chunk], targets[lo:lo + chunk]  # (c, D), (c,)
        x = (hc @ w.t()).float()  # (c, V) logits
        valid = tc != ignore_index
        safe = torch.where(valid, tc, 0)[:, None]  # (c, 1)
        x.sub_(x.amax(-1, keepdim=True))  # shifted, so exp cannot overflow
        picked = x.gather(1, safe).squeeze(1)  # (c,) target logit - max
        x.exp_()
        z = x.sum(-1, keepdim=True)  # (c, 1)
        total += ((z.squeeze(1).log() - picked) * valid).sum()  # logsumexp - target logit
        if scale is None:
            del x  # before the next chunk's logits exist
            continue
        x.div_(z).scatter_add_(1, safe, torch.full_like(picked[:, None], -1.0))  # softmax - onehot
        g = x.mul_((scale * valid)[:, None]).to(h.dtype)  # (c, V) in the compute dtype
        del x
        if grad_h is not None:
            grad_h[lo:lo + chunk] = g @ w  # (c, D)
        if grad_w is not None:
            if grad_w.dtype == g.dtype:
                grad_w.addmm_(g.t(), hc)  # (V, D)
            else:  # an fp32 weight under autocast: 16-bit product, summed in fp32
                grad_w.add_(g.t() @ hc)
        del g
    return total


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ w^T`` whose whole (N, V) logits never exist: see
    :func:`linear_cross_entropy`.

    ``eager``: the gradients (for a loss gradient of 1) are made in forward, chunk by chunk
    while each chunk's logits exist, and backward only scales them by the loss gradient: no
    logits are recomputed, so the FLOPs are those of the unchunked loss, and what is kept from
    forward to backward is grad_h (N, D) and grad_w (V, D) in place of the plain path's saved h
    (N, D) and the weight gradient its backward makes. Not eager (fp16): forward keeps h and w,
    backward recomputes each chunk's logits with the loss gradient (fp16's loss scale) applied
    before the 16-bit cast, as the plain path does; gradients of ~1/n per row would underflow
    fp16 without it.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                chunk: int, dtype: torch.dtype, eager: bool) -> torch.Tensor:
        n = (targets != ignore_index).sum()
        ctx.meta = (ignore_index, chunk, dtype, eager)
        with torch.autocast(h.device.type, enabled=False):  # the compute dtype is explicit
            hc, wc = h.to(dtype), w.to(dtype)
            if not eager:
                ctx.save_for_backward(h, w, targets, n)
                return _chunked_cross_entropy(hc, wc, targets, ignore_index, chunk) / n
            grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None  # (N, D)
            grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None  # (V, D)
            total = _chunked_cross_entropy(hc, wc, targets, ignore_index, chunk,
                                           1.0 / n.clamp(min=1), grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        return total / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        ignore_index, chunk, dtype, eager = ctx.meta
        if eager:
            if getattr(ctx, "scaled", False):
                raise RuntimeError("the chunked loss (model.loss_chunk_tokens) scales its saved "
                                   "gradients in place: backward through it once, without "
                                   "retain_graph, or set model.loss_chunk_tokens=0")
            ctx.scaled = True
            grad_h, grad_w = ctx.saved_tensors
            for g in (grad_h, grad_w):
                if g is not None:
                    g.mul_(grad_loss)  # in place: no second (V, D) buffer
            return grad_h, grad_w, None, None, None, None, None
        h, w, targets, n = ctx.saved_tensors
        with torch.autocast(h.device.type, enabled=False):
            grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
            _chunked_cross_entropy(h.to(dtype), w.to(dtype), targets, ignore_index, chunk,
                                   grad_loss / n.clamp(min=1), grad_h, grad_w)
        return grad_h, grad_w, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int, ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy(h @ weight.T, targets)`` computed ``chunk_tokens`` rows at a time: the
    memory of one chunk's logits and gradient, (chunk, V), instead of the whole (N, V) and
    its gradient (15.7 GiB per rank for Llama 3 8B at 32K tokens). h (N, D), weight (V, D),
    targets (N,) int64. The matmuls run in the autocast dtype if autocast is on (as
    ``F.linear`` would), else in h's; softmax and loss in fp32. Same loss and gradients to
    float rounding, the output weight's gradient summed chunk by chunk in its own dtype."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    kind = h.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, ignore_index, chunk_tokens, dtype,
                                         dtype != torch.float16)
    with torch.autocast(kind, enabled=False):
        total = _chunked_cross_entropy(h.to(dtype), weight.to(dtype), targets, ignore_index,
                                       chunk_tokens)
    return total / (targets != ignore_index).sum()


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
