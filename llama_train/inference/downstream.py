"""``llama-eval``: downstream evaluation of our model with lm-evaluation-harness, no export step.

    llama-eval outputs/llama-train --tasks hellaswag,arc_easy --num-fewshot 0
    llama-eval out/hf_model --tasks my_task --include-path ./tasks --limit 100 --output res.json

:class:`~llama_train.inference.lm_eval_model.LlamaTrainLM` is an lm-eval model (``TemplateLM``):
batched log-likelihoods of continuations, rolling log-likelihoods for perplexity tasks and
greedy generation, computed by our ``Transformer`` on a checkpoint that
:func:`llama_train.inference.generate.load` reads (ours, ZeRO
shards merged; a Hugging Face directory; a ``llama-import`` file). It tokenizes as lm-eval's own
HF backend does on an export (context and continuation encoded together, then split; no BOS
unless ``add_bos_token``), so its scores on a checkpoint equal that backend's on the export
(tested within 1e-4). Hub tasks need their datasets (network or a local HF cache); a task over
local JSON files (``--include-path`` with its YAML) needs nothing. Progress goes to stderr: a
line per phase (loading, lm-eval's task index, each kind of request with its count per task)
and, while the model works, at least one every 30 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from llama_train.bounds import INT32_MAX, SEED_MAX, Range, check_options
from llama_train.inference.generate import EXIT_BAD_INPUT, GenerateError, device_and_dtype, load
from llama_train.paths import PathRefused, check_output

# The range of each numeric option (llama_train.bounds), checked before the model loads:
# `--limit -1` failed after 72 s of building the tasks, a negative --seed in numpy's seeding.
OPTIONS = {
    "num_fewshot": Range(0, 1024, integer=True, optional=True,
                         fix="worked examples put before each question (tasks use 0-25)"),
    "limit": Range(0, INT32_MAX, lo_open=True, optional=True,
                   fix="examples per task, or a fraction below 1 of them"),
    "batch_size": Range(1, 2**16, integer=True, fix="requests per forward"),
    "seed": Range(0, SEED_MAX, integer=True, fix="numpy's seed is unsigned 32-bit"),
}




def evaluate(checkpoint: str, tasks: Sequence[str], include_path: Optional[str] = None,
             num_fewshot: Optional[int] = None, limit: Optional[float] = None,
             batch_size: int = 8, tokenizer: Optional[str] = None, device: str = "cpu",
             dtype: str = "fp32", seed: int = 1234) -> dict:
    """lm-eval's ``simple_evaluate`` of the model at ``checkpoint`` on ``tasks``: its results
    dict (``results[task]["acc,none"]`` ...)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from llama_train.inference.lm_eval_model import LlamaTrainLM, say

    t0 = time.perf_counter()
    say(f"loading {checkpoint} ({device}, {dtype})")
    loaded = load(checkpoint, tokenizer, device, dtype)
    model = LlamaTrainLM(loaded, batch_size=batch_size)
    say(f"loaded {loaded.source} in {time.perf_counter() - t0:.1f}s; indexing lm-eval's tasks")
    t0 = time.perf_counter()
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    say(f"lm-eval knows {len(manager.all_tasks)} tasks ({time.perf_counter() - t0:.1f}s)")
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise GenerateError(f"unknown task(s) {unknown}: lm-eval knows {len(manager.all_tasks)} "
                            f"(`lm-eval ls tasks`); a task of your own: --include-path DIR with "
                            f"its YAML", EXIT_BAD_INPUT)
    say(f"evaluating {', '.join(tasks)}: their requests are built (a hub task's dataset read "
        f"first), then run by kind")
    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(model=model, tasks=list(tasks), num_fewshot=num_fewshot,
                                  limit=limit, task_manager=manager, random_seed=seed,
                                  numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed, log_samples=False)
    say(f"evaluated {len(tasks)} task(s) in {time.perf_counter() - t0:.1f}s")
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
    p.add_argument("--output", help="write the results as JSON here (checked before the "
                                    "evaluation; missing directories are created)")
    a = p.parse_args(argv)
    msg = check_options(a, OPTIONS)  # before lm-eval is imported and a task's data is read
    if msg is None and a.limit is not None and a.limit >= 1 and not a.limit.is_integer():
        msg = (f"--limit={a.limit:g}: a fraction below 1 takes that share of each task's "
               f"examples; from 1 up it is a count of examples, a whole number")
    if msg is not None:
        p.error(msg)
    if a.output:  # checked before the model loads: an evaluation is never lost for its file
        try:
            check_output(a.output, "--output")
        except PathRefused as e:
            print(f"llama-eval: error: {e}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
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
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)  # checked at the start
        Path(a.output).write_text(json.dumps({"source": res["source"],
                                              "results": res["results"],
                                              "n-samples": res.get("n-samples")},
                                             indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
