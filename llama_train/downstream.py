"""``llama-eval``: downstream evaluation of our model with lm-evaluation-harness, no export step.

    llama-eval outputs/llama-train --tasks hellaswag,arc_easy --num-fewshot 0
    llama-eval out/hf_model --tasks my_task --include-path ./tasks --limit 100 --output res.json

:class:`LlamaTrainLM` is an lm-eval model (``TemplateLM``): batched log-likelihoods of
continuations, rolling log-likelihoods for perplexity tasks and greedy generation, computed by
our ``Transformer`` on a checkpoint that :func:`llama_train.generate.load` reads (ours, ZeRO
shards merged; a Hugging Face directory; a ``llama-import`` file). It tokenizes as lm-eval's own
HF backend does on an export (context and continuation encoded together, then split; no BOS
unless ``add_bos_token``), so its scores on a checkpoint equal that backend's on the export
(tested within 1e-4). Hub tasks need their datasets (network or a local HF cache); a task over
local JSON files (``--include-path`` with its YAML) needs nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from llama_train.generate import EXIT_BAD_INPUT, GenerateError, device_and_dtype, load


def lm_class():
    """The lm-eval model class (built on first use: lm-eval is imported only by llama-eval)."""
    import torch
    import torch.nn.functional as F
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class LlamaTrainLM(TemplateLM):
        """lm-eval's view of a loaded model (:class:`llama_train.generate.Loaded`)."""

        def __init__(self, loaded, batch_size: int = 8, max_length: Optional[int] = None,
                     add_bos_token: bool = False):
            super().__init__()
            self.loaded, self.model, self.tok = loaded, loaded.model, loaded.tokenizer
            self.batch_size = int(batch_size)
            self.max_length = int(max_length or self.model.args.max_seq_len)
            self.add_bos_token = add_bos_token
            self._device = self.model.tok_embeddings.weight.device

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
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
            """Each document's whole log-likelihood, in windows of max_length that score every
            token once (lm-eval's rolling windows, as its HF backend uses them)."""
            out = []
            for (text,) in [r.args for r in requests]:
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)]
                lls = self._loglikelihood_tokens([(None, *w) for w in windows])
                total = sum(ll for ll, _ in lls)
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
                out.append(total)
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
            """Greedy continuations (KV cache), cut at the first of the request's ``until``
            strings; at most ``max_gen_toks`` new tokens (default 256)."""
            out = []
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
            return out

    return LlamaTrainLM


def evaluate(checkpoint: str, tasks: Sequence[str], include_path: Optional[str] = None,
             num_fewshot: Optional[int] = None, limit: Optional[float] = None,
             batch_size: int = 8, tokenizer: Optional[str] = None, device: str = "cpu",
             dtype: str = "fp32", seed: int = 1234) -> dict:
    """lm-eval's ``simple_evaluate`` of the model at ``checkpoint`` on ``tasks``: its results
    dict (``results[task]["acc,none"]`` ...)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    loaded = load(checkpoint, tokenizer, device, dtype)
    model = lm_class()(loaded, batch_size=batch_size)
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise GenerateError(f"unknown task(s) {unknown}: lm-eval knows {len(manager.all_tasks)} "
                            f"(`lm-eval ls tasks`); a task of your own: --include-path DIR with "
                            f"its YAML", EXIT_BAD_INPUT)
    res = lm_eval.simple_evaluate(model=model, tasks=list(tasks), num_fewshot=num_fewshot,
                                  limit=limit, task_manager=manager, random_seed=seed,
                                  numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed, log_samples=False)
    res["source"] = loaded.source
    return res


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(
        prog="llama-eval",
        description="Evaluate a llama_train checkpoint (or an export) with lm-evaluation-harness.")
    p.add_argument("checkpoint", help="a checkpoint, output or checkpoints directory; a Hugging "
                                      "Face model directory; or a llama-import .pt")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", help="a directory of task YAMLs of your own")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None,
                   help="examples per task (a fraction below 1)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokenizer", help="a sentencepiece model (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda if present)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "auto"), default="auto")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.batch_size < 1:
        p.error(f"--batch-size={a.batch_size} must be >= 1")
    try:
        device, dtype = device_and_dtype(a)
        res = evaluate(a.checkpoint, [t for t in a.tasks.split(",") if t], a.include_path,
                       a.num_fewshot, a.limit, a.batch_size, a.tokenizer, device, dtype, a.seed)
    except GenerateError as e:
        print(f"llama-eval: error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(e.code) from None
    from lm_eval.utils import make_table

    print(f"llama-eval: {res['source']}")
    print(make_table(res))
    if a.output:
        Path(a.output).write_text(json.dumps({"source": res["source"],
                                              "results": res["results"],
                                              "n-samples": res.get("n-samples")},
                                             indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
