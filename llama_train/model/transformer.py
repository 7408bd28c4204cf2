"""The LLaMA decoder-only transformer in plain ``torch.nn``.

Nothing here knows about DeepSpeed, process groups or devices: parallelism and precision are
applied from outside (``llama_train.engine``), weights are initialised by
``Transformer.init_weights()``, one parameter at a time from (seed, name), so a model can be built
on the meta device to count parameters or plan memory of a 70B model instantly, or partitioned
by ZeRO-3 before any weight exists, and the module names follow Meta's reference code
(``tok_embeddings``, ``layers.{i}.attention.wq`` ...), which checkpoints and the Hugging Face
converter (``llama_train.hf``) rely on.

Shape letters: B batch, T query length, S key length (cached prefix + T), D model dim,
H query heads, KV key/value heads, hd head dim, V vocabulary.

RoPE convention: Meta's *interleaved* pairs. Feature pairs (x0, x1), (x2, x3), ... of each head are
rotated together, pair i by angle ``pos * theta^(-2i/hd)``. We keep Meta's layout (not the
Hugging Face/NeoX "half-split" pairs (x_i, x_{i+hd/2})) so that weights stay in the reference
layout together with the reference names: a Meta ``consolidated.pth`` maps onto this model by name
alone, and exactly one place, ``llama_train.hf``, permutes the rows of ``wq``/``wk`` for
Hugging Face. Both conventions compute the same function once the rows are permuted.

Document masking (LLaMA 3): a packed window holds several documents back to back, each ending
with EOS. ``Transformer.forward(..., doc_ids=document_ids(tokens, eos_id))`` lets a token attend
only to earlier tokens of its own document. Positions are not reset per document: RoPE scores
depend only on the distance between query and key, so a document scores the same at any offset.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from llama_train.errors import BadInput
from llama_train.model.args import (ModelArgs, RopeScaling, count_params, ffn_hidden_dim,
                                    flops_per_token, list_presets, load_preset)
from llama_train.model.ops import (apply_rotary_emb, cross_entropy, document_ids, document_mask,
                                   linear_cross_entropy, rope_inv_freq, rope_tables,
                                   sample_next_token)

# model_args' and model_ops' names are this module's API too (from llama_train.model import
# ModelArgs, document_ids): model_args holds the torch-free config half (ModelArgs, counts, presets)
__all__ = ["ModelArgs", "RopeScaling", "ffn_hidden_dim", "count_params", "flops_per_token",
           "list_presets", "load_preset", "RMSNorm", "KVCache", "CoreAttention", "Attention",
           "FeedForward", "TransformerBlock", "OutputHead",
           "Transformer", "apply_rotary_emb", "cross_entropy", "document_ids", "document_mask",
           "linear_cross_entropy", "rope_inv_freq", "rope_tables", "sample_next_token"]

# `enable_gqa` appeared in torch 2.5; older torch gets the K/V heads repeated explicitly.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 5)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, normalised in fp32 (bf16 sums of squares drift)."""

    def __init__(self, dim: int, eps: float, device: Optional[torch.device] = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


# SDPA device types that get K/V heads repeated for a masked GQA call. CUDA's flash kernel takes
# no mask, and its memory-efficient kernel (the fused one that does) accepted only equal head
# counts until recently (pytorch#191085, 2026): there, enable_gqa with a mask silently falls back
# to the math kernel, which materialises (B, H, T, T) scores. The CPU flash kernel takes both.
_MASKED_GQA_EXPANDS_KV = ("cuda",)


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, KV, S, hd) -> (B, KV * rep, S, hd), head j serving query heads j*rep .. j*rep+rep-1
    (the grouping ``enable_gqa`` uses)."""
    B, KV, S, hd = x.shape
    return x[:, :, None].expand(B, KV, rep, S, hd).reshape(B, KV * rep, S, hd)


class KVCache:
    """Per-layer key/value buffers for incremental decoding.

    ``k[i]``, ``v[i]``: (B, KV, max_len, hd), laid out as SDPA reads them so no transpose is needed.
    The cache does not track a position: the caller passes ``start_pos`` to ``Transformer.forward``
    (the number of tokens already written), which keeps the cache a plain pair of tensors per layer.
    """

    def __init__(self, args: ModelArgs, batch_size: int, max_len: int,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        shape = (batch_size, args.kv_heads, max_len, args.head_dim)
        self.max_len = max_len
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]


class CoreAttention(nn.Module):
    """``softmax(q k^T / sqrt(hd) + mask) v`` over (B, T, heads, hd) inputs, K/V heads grouped
    (GQA). No parameters: the part of attention that sequence parallelism wraps
    (``llama_train.engine.sequence`` puts DeepSpeed's Ulysses all-to-all around it, so each rank
    runs it on the whole sequence for a share of the heads)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor] = None, causal: bool = True) -> torch.Tensor:
        """q (B, T, H, hd), k and v (B, S, KV, hd); ``mask``: boolean or additive, broadcast to
        (B, H, T, S), replacing ``causal``. Returns (B, T, H, hd)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        gqa = bool(k.size(1) != q.size(1))  # traced with dynamic shapes: SDPA takes no SymBool
        if gqa and mask is not None and q.device.type in _MASKED_GQA_EXPANDS_KV:
            rep = q.size(1) // k.size(1)
            k, v, gqa = _repeat_kv(k, rep), _repeat_kv(v, rep), False  # (B, H, S, hd)
        if _SDPA_HAS_GQA:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 enable_gqa=gqa)
        else:  # pragma: no cover - torch < 2.5
            rep = q.size(1) // k.size(1)  # 1 if already repeated for a mask
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return out.transpose(1, 2)  # (B, T, H, hd)


class Attention(nn.Module):
    """Causal self-attention with grouped-query K/V heads and RoPE, no biases."""

    def __init__(self, args: ModelArgs, device: Optional[torch.device] = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, q, bias=False, device=device)
        self.wk = nn.Linear(args.dim, kv, bias=False, device=device)
        self.wv = nn.Linear(args.dim, kv, bias=False, device=device)
        self.wo = nn.Linear(q, args.dim, bias=False, device=device)
        self.core = CoreAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None, start_pos: int = 0,
                doc_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``doc_mask``: the additive (B, 1, T, T) mask of :func:`document_mask`, replacing the
        causal mask (it is causal itself); not with ``cache``."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)  # (B, T, heads, hd)

        if cache is None:
            mask = None if doc_mask is None else doc_mask.to(q.dtype)  # a no-op unless autocast
            out = self.core(q, k, v, mask=mask, causal=mask is None)
        else:
            # decoding runs on one rank, whatever wraps the core for training
            core = getattr(self.core, "local", self.core)
            k_cache, v_cache = cache  # (B, KV, max_len, hd)
            end = start_pos + T
            k_cache[:B, :, start_pos:end] = k.transpose(1, 2)
            v_cache[:B, :, start_pos:end] = v.transpose(1, 2)
            k = k_cache[:B, :, :end].transpose(1, 2)  # (B, S, KV, hd)
            v = v_cache[:B, :, :end].transpose(1, 2)
            mask = None
            if start_pos > 0 and T > 1:
                # SDPA's is_causal aligns the mask top-left, wrong for a chunk after a prefix:
                # query i sits at absolute position start_pos + i and sees keys 0..start_pos + i.
                q_pos = torch.arange(start_pos, end, device=x.device)
                mask = torch.arange(end, device=x.device)[None, :] <= q_pos[:, None]  # (T, S)
            # one new token (T == 1) sees the whole prefix
            out = core(q, k, v, mask=mask, causal=mask is None and T > 1 and start_pos == 0)
        return self.wo(out.reshape(B, T, self.n_heads * self.head_dim))  # (B, T, H*hd)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``, hidden size from ``ModelArgs.ffn_hidden_dim``."""

    def __init__(self, args: ModelArgs, device: Optional[torch.device] = None):
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False, device=device)  # gate
        self.w2 = nn.Linear(hidden, args.dim, bias=False, device=device)  # down
        self.w3 = nn.Linear(args.dim, hidden, bias=False, device=device)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, args: ModelArgs, device: Optional[torch.device] = None):
        super().__init__()
        self.attention = Attention(args, device=device)
        self.feed_forward = FeedForward(args, device=device)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, device=device)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None, start_pos: int = 0,
                doc_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, start_pos, doc_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputHead(nn.Linear):
    """The output projection D -> V (``output.weight``, the embedding matrix when tied). Given
    targets, the mean cross-entropy straight from the hidden states, ``chunk`` tokens at a time
    (:func:`linear_cross_entropy`), so the whole (B, T, V) logits never exist. Either way it runs
    as this module's forward, where ZeRO-3 gathers the weight (and again for its backward)."""

    def forward(self, h: torch.Tensor, targets: Optional[torch.Tensor] = None,
                chunk: int = 0) -> torch.Tensor:
        """h (B, T, D) -> logits (B, T, V), or with targets (B, T) the 0-d fp32 loss."""
        if targets is None:
            return super().forward(h)
        return linear_cross_entropy(h.reshape(-1, h.size(-1)), self.weight, targets.reshape(-1),
                                    chunk)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """``tok_embeddings -> layers -> norm -> output``.

    Parameters are created on the meta device and materialised once: ``Transformer(args)`` (or
    ``Transformer(args, device=d, seed=s)``) allocates them on the target device and runs
    :meth:`init_weights`, never torch's default layer init. ``Transformer(args, device="meta")``
    allocates nothing (planning, or construction inside ``deepspeed.zero.Init``, which partitions
    each module as ``to_empty`` materialises it); ``model.to_empty(device=d); model.init_weights()``
    then makes it real.
    """

    def __init__(self, args: ModelArgs, device: Optional[Union[torch.device, str]] = None,
                 seed: Optional[int] = None):
        super().__init__()
        self.args = args
        target = torch.empty(0, device=device).device  # honours `with torch.device(...)`
        meta = torch.device("meta")
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, device=meta)
        self.layers = nn.ModuleList(TransformerBlock(args, device=meta) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, device=meta)
        self.output = OutputHead(args.dim, args.vocab_size, bias=False, device=meta)
        # Non-persistent: derived from args, so they never enter a checkpoint.
        self.register_buffer("rope_cos", torch.empty(0, device=meta), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0, device=meta), persistent=False)
        self.tie_weights()
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights(seed)

    def tie_weights(self) -> None:
        """Make ``output.weight`` the very tensor ``tok_embeddings.weight`` (if tied).

        ``to_empty()`` creates fresh parameters and silently unties them; ``init_weights`` re-ties.
        """
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """Every parameter from :meth:`init_param`, and the RoPE tables. ``seed`` None draws
        one from torch's global generator (so ``torch.manual_seed`` still decides the model)."""
        self.tie_weights()
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        for name, p in self.named_parameters():
            self.init_param(name, p, seed)
        self.reset_rope()

    @torch.no_grad()
    def init_param(self, name: str, p: torch.Tensor, seed: int) -> None:
        """LLaMA pretraining init, GPT-2/OLMo style, of the parameter called ``name`` (a full,
        unpartitioned tensor).

        normal(0, init_std) for the embedding and every linear; the residual output projections
        (``wo``, ``w2``) get ``init_std / sqrt(2 * n_layers)`` so the residual stream's variance
        does not grow with depth (two residual adds per block); norm weights 1. Each parameter
        draws from its own generator seeded by (seed, name), so its values do not depend on the
        order parameters are visited in, the ZeRO stage, the world size or the dtype: ZeRO-3
        initialises it alone, gathered, and gets what a whole-model build gets.
        """
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            return
        std = self.args.init_std
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            std = std / math.sqrt(2 * self.args.n_layers)
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
        gen = torch.Generator(device=p.device).manual_seed(int.from_bytes(digest, "little") >> 1)
        if p.dtype == torch.float32:
            p.normal_(0.0, std, generator=gen)
        else:  # draw in fp32 and round once, as casting an fp32 model would
            p.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, std, generator=gen))

    def reset_rope(self) -> None:
        """(Re)compute the fp32 RoPE tables on the model's device."""
        self.rope_cos, self.rope_sin = rope_tables(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta,
            device=self.rope_cos.device, scaling=self.args.rope_scaling)

    def new_kv_cache(self, batch_size: int, max_len: Optional[int] = None,
                     dtype: Optional[torch.dtype] = None) -> KVCache:
        """An empty cache on the model's device, in the model's dtype unless told otherwise."""
        w = self.tok_embeddings.weight
        max_len = self.args.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= self.args.max_seq_len:
            raise ValueError(f"KV cache max_len={max_len} must be in 1..model.max_seq_len={self.args.max_seq_len}")
        return KVCache(self.args, batch_size, max_len, device=w.device, dtype=dtype or w.dtype)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                start_pos: int = 0, kv_cache: Optional[KVCache] = None,
                doc_ids: Optional[torch.Tensor] = None):
        """tokens (B, T) -> logits (B, T, V) in fp32, or ``(logits, loss)`` when targets are given.

        Loss is the mean cross-entropy over targets != -100. With ``args.loss_chunk`` > 0 it is
        computed that many tokens at a time and the whole logits never exist: ``(None, loss)``
        (ask without targets for logits). For incremental decoding pass a
        ``kv_cache`` from ``new_kv_cache`` and ``start_pos`` = number of tokens already in it; the
        new tokens sit at positions ``start_pos .. start_pos + T - 1``.

        ``doc_ids`` (B, T), e.g. ``document_ids(tokens, eos_id)``: a token attends only to earlier
        tokens with the same id (document masking of packed windows). Without it attention is
        plain causal. Training/scoring only: refused with ``kv_cache``.

        Sequence parallelism (attention cores wrapped by ``llama_train.engine.sequence``):
        ``tokens`` are this rank's slice of each sequence, starting at ``start_pos``, and
        ``doc_ids`` are (B, S) for the whole sequence, since attention sees all of it.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq_len), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if doc_ids is not None:
            if kv_cache is not None:
                raise ValueError(
                    "doc_ids (document masking) cannot be combined with kv_cache: the cache serves "
                    "incremental decoding of one sequence per row; pass doc_ids only to full "
                    "forwards (training, scoring) and decode without it")
            S = doc_ids.size(-1)
            whole = S == T or (S % T == 0 and start_pos % T == 0 and start_pos + T <= S)
            if doc_ids.dim() != 2 or doc_ids.size(0) != B or not whole:
                raise ValueError(f"doc_ids must have the shape of tokens {(B, T)} (or of the "
                                 f"whole sequence they are a slice of), got {tuple(doc_ids.shape)}")
        end = start_pos + T
        limit = self.args.max_seq_len if kv_cache is None else min(kv_cache.max_len, self.args.max_seq_len)
        if start_pos < 0 or end > limit:
            raise ValueError(
                f"positions {start_pos}..{end - 1} exceed the limit of {limit} tokens "
                f"(model.max_seq_len={self.args.max_seq_len}): raise model.max_seq_len or shorten the input")
        cos, sin = self.rope_cos[start_pos:end], self.rope_sin[start_pos:end]  # (T, hd/2)

        h = self.tok_embeddings(tokens)  # (B, T, D)
        # Built once here and shared by every layer (one tensor saved for backward, not n_layers).
        doc_mask = None if doc_ids is None else document_mask(doc_ids, dtype=h.dtype)  # (B, 1, S, S)
        ckpt = self.args.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if kv_cache is not None:
                h = layer(h, cos, sin, (kv_cache.k[i], kv_cache.v[i]), start_pos)
            elif doc_mask is not None:
                if ckpt:
                    h = checkpoint(layer, h, cos, sin, None, 0, doc_mask, use_reentrant=False)
                else:
                    h = layer(h, cos, sin, None, 0, doc_mask)
            elif ckpt:
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        h = self.norm(h)
        chunk = self.args.loss_chunk
        if targets is not None and chunk > 0:
            return None, self.output(h, targets, chunk)
        logits = self.output(h).float()  # (B, T, V)
        if targets is None:
            return logits
        loss = cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, prompt: Union[torch.Tensor, Sequence[Sequence[int]]], max_new_tokens: int,
                 temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_id: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 pad_id: Optional[int] = None) -> torch.Tensor:
        """Prompt + continuation, (B, max_prompt_len + max_new_tokens) LongTensor.

        ``prompt`` is a (B, T) tensor or a list of token lists of any lengths. temperature 0 is
        greedy. Decoding starts at the shortest prompt; longer prompts are teacher-forced until
        their own end, so one KV cache serves a ragged batch. Row i holds ``len_i +
        max_new_tokens`` tokens, then ``pad_id`` (default ``eos_id``, else 0); after a row emits
        ``eos_id`` the rest of it is ``eos_id``, and the result is cut short once all rows have.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        device = self.tok_embeddings.weight.device
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 2 or prompt.size(1) == 0:
                raise ValueError(f"prompt tensor must be (batch, seq_len>0), got {tuple(prompt.shape)}")
            rows = prompt.to(device=device, dtype=torch.long)
            lens = torch.full((rows.size(0),), rows.size(1), device=device)
        else:
            prompt = [list(p) for p in prompt]
            if not prompt or any(len(p) == 0 for p in prompt):
                raise ValueError("prompt must be a non-empty list of non-empty token lists")
            rows = None
            lens = torch.tensor([len(p) for p in prompt], device=device)
        B, max_len, min_len = lens.numel(), int(lens.max()), int(lens.min())
        total = max_len + max_new_tokens
        if total > self.args.max_seq_len:  # the user's prompt and request: bad input
            raise BadInput(
                f"prompt ({max_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"model.max_seq_len={self.args.max_seq_len}")
        pad = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        buf = torch.full((B, total), pad, dtype=torch.long, device=device)
        if rows is not None:
            buf[:, :max_len] = rows
        else:
            for i, p in enumerate(prompt):
                buf[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        in_prompt = torch.arange(total, device=device)[None, :] < lens[:, None]  # (B, total)

        was_training = self.training
        self.eval()
        try:
            cache = self.new_kv_cache(B, total)
            done = torch.zeros(B, dtype=torch.bool, device=device)
            prev, end = 0, total
            for cur in range(min_len, total):
                logits = self(buf[:, prev:cur], start_pos=prev, kv_cache=cache)[:, -1]  # (B, V)
                nxt = sample_next_token(logits, temperature, top_k, top_p, generator)
                nxt = torch.where(in_prompt[:, cur], buf[:, cur], nxt)
                if eos_id is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                    done |= ~in_prompt[:, cur] & (nxt == eos_id)
                buf[:, cur] = nxt
                prev = cur
                if eos_id is not None and bool(done.all()):
                    end = cur + 1
                    break
        finally:
            self.train(was_training)
        buf = buf[:, :end]
        beyond = torch.arange(end, device=device)[None, :] >= (lens + max_new_tokens)[:, None]
        return buf.masked_fill(beyond, pad)
