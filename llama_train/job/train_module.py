"""One global batch, trained: micro-batches, gradient accumulation, the learning rate and the
optimizer step, and the one collective per step that makes every rank agree on the result.

The :class:`~llama_train.job.trainer.Trainer` decides *when* (the loop, timing, evaluation, saves,
recovery); :class:`TrainModule` decides *how* one batch turns into an optimizer step, the way
OLMo-core's TrainModule splits them. It talks to DeepSpeed only through
:class:`llama_train.engine.Engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from llama_train.config import BatchPlan, OptimConfig
from llama_train.data import DataError
from llama_train.hooks import Hook
from llama_train.job.optim import lr_at
from llama_train.model import document_ids


@dataclass
class BatchResult:
    """What training one global batch did."""

    loss: float  # token mean over the global batch; NaN if any rank saw a non-finite loss
    lr: float
    result: Any  # engine.StepResult: applied?, non-finite?, grad norm
    data_wait_s: float  # time this rank waited for its micro-batches
    stop_requested: bool  # a SIGTERM/SIGINT reached some rank


class TrainModule:
    """Trains one global batch on this rank's slice of it (``plan.grad_accum`` micro-batches of
    ``plan.micro_batch`` sequences) and evaluates micro-batches, with the model's document mask
    when ``document_mask``. ``hooks``' ``on_loss`` sees each micro-batch's loss.

    ``sequence=(r, N)`` (parallel.sequence=N, r this rank's place in its group): the N ranks of
    a group get the same micro-batches and each trains tokens [r*T/N, (r+1)*T/N) of every
    sequence, its loss weighted by its share of the group's target tokens (DeepSpeed sums
    gradients over the group and averages over data-parallel replicas), so the step is the
    token mean over the global batch as without it."""

    def __init__(self, engine, plan: BatchPlan, device: torch.device, optim: OptimConfig,
                 max_steps: int, *, vocab_size: int, eos_id: int, document_mask: bool,
                 data_dir: str, hooks: Sequence[Hook] = (), sequence: Tuple[int, int] = (0, 1)):
        self.engine, self.plan, self.device = engine, plan, device
        self.optim, self.max_steps = optim, max_steps
        self.vocab_size, self.eos_id, self.document_mask = vocab_size, eos_id, document_mask
        self.data_dir = data_dir  # named when a batch holds token ids outside the vocabulary
        self.hooks = list(hooks)
        self.sp_rank, self.sp_size = sequence

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
        o = self.optim
        return lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, max_steps=self.max_steps,
                     min_lr_ratio=o.min_lr_ratio)

    def train_batch(self, batches: Iterator, step: int, batch_no: int, window_start: int,
                    stop_received: bool = False) -> BatchResult:
        """Optimizer step ``step`` (1-based) over the next ``grad_accum`` micro-batches of
        ``batches``, global batch ``batch_no`` of the stream, which starts at sample
        ``window_start``."""
        import time

        lr = self.lr_at(step)
        self.engine.set_lr(lr)
        loss_sum = torch.zeros((), dtype=torch.float64)
        data_wait = 0.0
        for micro in range(self.plan.grad_accum):
            t_data = time.perf_counter()
            x, y = next(batches)  # x, y: (micro_batch, seq_len) token ids
            data_wait += time.perf_counter() - t_data
            check_token_ids(x, y, self.vocab_size, self.data_dir, window_start)
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            loss = self.micro_loss(x, y)
            for h in self.hooks:
                loss = h.on_loss(batch_no, loss)
            self.engine.backward(loss)
            loss_sum += loss.detach().double().cpu()
            if micro < self.plan.grad_accum - 1:
                self.engine.micro_step()
        loss, nonfinite, stop_requested = self._all_ranks(loss_sum, stop_received)
        result = self.engine.step(nonfinite)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return BatchResult(loss, lr, result, data_wait, stop_requested)

    def micro_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's part of the micro-batch's token-mean loss (all of it without sequence
        parallelism)."""
        xs, ys, kwargs = self.inputs(x, y)
        logits, loss = self.engine(xs, ys, **kwargs)
        if self.sp_size == 1:
            return loss
        mine, everyone = int((ys != -100).sum()), int((y != -100).sum())
        if mine == 0:  # no target here: nothing to add, but the backward runs on every rank
            # (the chunked loss returns no logits; its loss over no targets is NaN: zeroed)
            return (loss.nan_to_num(0.0) if logits is None else logits.sum()) * 0.0
        return loss * (mine / everyone)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """(token-mean loss, number of target tokens) of this rank's part of one evaluation
        micro-batch; the caller holds ``torch.no_grad`` and the engine in eval mode."""
        xs, ys, kwargs = self.inputs(x.to(self.device), y.to(self.device))
        _, loss = self.engine(xs, ys, **kwargs)
        return loss, int((ys != -100).sum())

    def inputs(self, x: torch.Tensor, y: torch.Tensor):
        """(tokens, targets, forward kwargs) this rank feeds the model: with
        trainer.document_mask the ``doc_ids`` of the whole window (documents ending at EOS);
        with sequence parallelism this rank's slice of the tokens and targets and its first
        position (attention sees the whole window, so the document ids stay whole)."""
        kwargs: Dict[str, Any] = {}
        if self.document_mask:
            kwargs["doc_ids"] = document_ids(x, self.eos_id)  # (B, T)
        if self.sp_size == 1:
            return x, y, kwargs
        part = x.size(1) // self.sp_size
        lo = self.sp_rank * part
        kwargs["start_pos"] = lo
        return x[:, lo:lo + part], y[:, lo:lo + part], kwargs  # (B, T/N)

    def _all_ranks(self, loss_sum: torch.Tensor, stop_received: bool):
        """One small all-reduce per step: the mean loss (NaN if any rank saw a non-finite one),
        whether any rank did, and whether any rank was asked to stop."""
        finite = bool(torch.isfinite(loss_sum))
        stats = torch.tensor([loss_sum.item() if finite else 0.0, 0.0 if finite else 1.0,
                              1.0 if stop_received else 0.0], dtype=torch.float64).to(self.device)
        dist.all_reduce(stats)
        total, bad, stopping = stats.cpu().tolist()
        n = self.plan.grad_accum * self.plan.world_size
        return (float("nan") if bad > 0 else total / n), bad > 0, stopping > 0


def check_token_ids(x, y, vocab_size: int, prepared_dir: str, window_start: int) -> None:
    """Token ids outside the vocabulary (a shard changed on disk after prepare) would index
    past the embedding: refuse them before the forward pass."""
    lo, hi = int(x.min()), int(x.max())
    bad_y = bool(((y >= vocab_size) | ((y < 0) & (y != -100))).any())
    if lo < 0 or hi >= vocab_size or bad_y:
        raise DataError(
            f"token ids outside [0, model.vocab_size={vocab_size}) in the global batch starting "
            f"at sample {window_start} of {prepared_dir} (min {lo}, max {hi}): the shards are "
            f"corrupt or from another tokenizer. Check them with data.verify=true, or delete "
            f"{prepared_dir} and prepare again."
        )
