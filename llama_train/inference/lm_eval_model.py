"""lm-evaluation-harness's view of our model: :class:`LlamaTrainLM`, an lm-eval ``TemplateLM``
over a model :func:`llama_train.inference.generate.load` read. Its own module because it subclasses
lm-eval's base class: only ``llama-eval`` imports it (and with it lm-eval)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

# While the model works through a kind of request, a progress line at least this often (s):
# lm-eval gives its own backends a progress bar, and ours said nothing for the whole of a task.
PROGRESS_EVERY_S = 30.0


def say(text: str) -> None:
    """A llama-eval progress line, on stderr (stdout keeps the results)."""
    print(f"llama-eval: {text}", file=sys.stderr, flush=True)


class Progress:
    """One kind of request (loglikelihood, loglikelihood_rolling, generate_until) as the model
    works through it: a line with its count per task when it starts, one at least every
    PROGRESS_EVERY_S with the count done and the time left at that pace, one when it ends."""

    def __init__(self, kind: str, requests: Sequence[Any], unit: str = "requests"):
        self.kind, self.unit, self.total = kind, unit, len(requests)
        self.t0 = self.last = time.perf_counter()
        tasks = Counter(getattr(r, "task_name", None) or "?" for r in requests)
        say(f"{kind}: {self.total} {unit} ({', '.join(f'{t} {n}' for t, n in tasks.items())})")

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY_S or done >= self.total:
            return
        self.last = now
        left = (now - self.t0) / max(done, 1) * (self.total - done)
        say(f"{self.kind}: {done}/{self.total} {self.unit} in {now - self.t0:.0f}s, "
            f"about {left:.0f}s left")

    def end(self) -> None:
        say(f"{self.kind}: {self.total} {self.unit} done in {time.perf_counter() - self.t0:.1f}s")


class LlamaTrainLM(TemplateLM):
    """lm-eval's view of a loaded model (:class:`llama_train.inference.generate.Loaded`)."""

    def __init__(self, loaded, batch_size: int = 8, max_length: Optional[int] = None,
                 add_bos_token: bool = False):
        super().__init__()
        self.loaded, self.model, self.tok = loaded, loaded.model, loaded.tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.model.args.max_seq_len)
        self.add_bos_token = add_bos_token
        self._device = self.model.tok_embeddings.weight.device
        self._progress: Optional[Progress] = None  # loglikelihood's, for its batches

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS where the tokenizer has one (as lm-eval's HF
        backend), else EOS."""
        return self.tok.bos_id if self.tok.bos_id >= 0 else self.tok.eos_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.source)

    def tok_encode(self, string: str, **kwargs) -> List[int]:
        return self.tok.encode(string, bos=self.add_bos_token, eos=False)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens))

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        """lm-eval's (tokenize, then :meth:`_loglikelihood_tokens`), with progress lines."""
        self._progress = Progress("loglikelihood", requests)
        try:
            out = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            progress, self._progress = self._progress, None
        progress.end()
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> List[Tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives it) per
        ``(cache_key, context_ids, continuation_ids)``; longest first in batches, right
        padding (causal attention: padding after a row changes nothing before it)."""
        out: List[Any] = [None] * len(requests)
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            rows = []
            for i in idx:
                _, ctx, cont = requests[i]
                whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
                rows.append((whole[:-1], whole[-len(cont):]))
            width = max(len(inp) for inp, _ in rows)
            x = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            for j, (inp, _) in enumerate(rows):
                x[j, :len(inp)] = torch.tensor(inp, dtype=torch.long)
            with torch.inference_mode():
                logp = F.log_softmax(self.model(x.to(self._device)).float(), dim=-1)  # (B,T,V)
            for j, i in enumerate(idx):
                inp, target = rows[j]
                n = len(target)
                lp = logp[j, len(inp) - n:len(inp)]  # the positions that predict them
                t = torch.tensor(target, device=lp.device)
                res = (float(lp.gather(-1, t[:, None]).sum()),
                       bool((lp.argmax(-1) == t).all()))
                out[i] = res
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], res)
            if self._progress is not None:
                self._progress.update(start + len(idx))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Each document's whole log-likelihood, in windows of max_length that score every
        token once (lm-eval's rolling windows, as its HF backend uses them)."""
        out = []
        progress = Progress("loglikelihood_rolling", requests, "documents")
        for (text,) in [r.args for r in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            lls = self._loglikelihood_tokens([(None, *w) for w in windows])
            total = sum(ll for ll, _ in lls)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
            progress.update(len(out))
        progress.end()
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Greedy continuations (KV cache), cut at the first of the request's ``until``
        strings; at most ``max_gen_toks`` new tokens (default 256)."""
        out = []
        progress = Progress("generate_until", requests)
        for context, kw in [r.args for r in requests]:
            kw = dict(kw or {})
            until = kw.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            n = int(kw.get("max_gen_toks", 256))
            ids = self.tok_encode(context)[-max(1, self.max_length - n):]
            with torch.inference_mode():
                row = self.model.generate([ids], max_new_tokens=n, temperature=0.0,
                                          eos_id=self.eot_token_id)[0].tolist()
            cont = row[len(ids):]
            if self.eot_token_id in cont:
                cont = cont[:cont.index(self.eot_token_id)]
            text = self.tok_decode(cont)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, kw), text)
            out.append(text)
            progress.update(len(out))
        progress.end()
        return out
