"""`llama-bench data`: how fast the data pipeline is, next to what it feeds.

Measures, with repeats interleaved (A B C A B C ...) so machine noise hits every variant alike:
  * prepare throughput (MB/s of source text, tokens/s) with num_proc=1 and 2, against plain
    single-process `sentencepiece` encoding of the same documents (the floor: no packing, no files);
  * the one-off costs of a cold `prepare` of the default data (built-in corpus + tokenizer
    training + tokenizing + writing), which is what `make train` pays on first use;
  * TrainLoader time per (8 x 256) micro-batch, 0 and 1 workers, against one forward+backward+
    AdamW step of the `small` model (or, if llama_train.model is missing, a matmul stand-in).
Prints medians and the command that reproduces them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from llama_train.bench import COUNT, check_options
from llama_train.bounds import Range


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_now() -> float:
    """CPU seconds of this process plus its finished children (the tokenization workers)."""
    import resource

    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def _timed_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    c0, t0 = _cpu_now(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, _cpu_now() - c0


def _cold_prepare(vocab: int, workdir: Path) -> dict:
    """`llama-data prepare` of the default data in a fresh process and an empty cache."""
    cache = Path(tempfile.mkdtemp(dir=workdir, prefix="cold-"))
    env = {**os.environ, "LLAMA_TRAIN_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "llama_train.data.cli", "prepare", "--source", "builtin",
           "--vocab-size", str(vocab), "--val-fraction", "0.05"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"cold prepare failed: {out.stderr[-2000:]}")
    summary = json.loads(out.stdout)
    meta = json.loads((Path(summary["dir"]) / "meta.json").read_text())
    return {"wall_s": wall, "tokenizer_s": meta["timing_s"]["tokenizer"],
            "tokenize_write_s": meta["timing_s"]["tokenize_and_write"],
            "tokens": sum(summary["tokens"].values())}


def _model_step(seq_len: int, batch: int, vocab: int):
    """(callable doing one train step, description). The `small` model if it can be imported."""
    import torch

    x = torch.randint(0, vocab, (batch, seq_len))
    y = torch.randint(0, vocab, (batch, seq_len))
    try:
        from llama_train.model import Transformer, load_preset

        args = load_preset("small")
        if getattr(args, "vocab_size", vocab) != vocab:
            import dataclasses

            args = dataclasses.replace(args, vocab_size=vocab)
        model = Transformer(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        n = sum(p.numel() for p in model.parameters())

        def step() -> None:
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, f"`small` model fwd+bwd+AdamW ({n / 1e6:.1f}M params, {batch}x{seq_len})"
    except Exception as e:  # noqa: BLE001 - any import/shape problem: fall back, and say so
        a = torch.randn(batch * seq_len, 384, requires_grad=True)
        w = torch.randn(384, 4 * 384, requires_grad=True)

        def step() -> None:
            (a @ w).relu().sum().backward()

        return step, f"reference matmul workload (llama_train.model unavailable: {type(e).__name__})"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="llama-bench data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=int, default=4, help="prepare-throughput source = built-in corpus x N")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--loader-batches", type=int, default=100, help="batches timed per loader repeat")
    ap.add_argument("--model-steps", type=int, default=3, help="train steps timed per repeat")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-prepare subprocess")
    ap.add_argument("--cached-corpus", action="store_true",
                    help="read the built-in corpus from the cache instead of timing its extraction")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    check_options("data", args, OPTIONS)
    return args


OPTIONS = {
    "vocab_size": Range(256, 2**20, integer=True, fix="the trained tokenizer's pieces"),
    "repeats": COUNT, "scale": Range(1, 1000, integer=True, fix="copies of the built-in corpus"),
    "seq_len": COUNT, "micro_batch": COUNT, "loader_batches": COUNT, "model_steps": COUNT,
}


def _one_off_costs(args: argparse.Namespace, work: Path, res: dict):
    """Cold prepare, corpus build, tokenizer training (into ``res``); (documents, tokenizer
    path, tokenizer)."""
    from llama_train.data import Tokenizer, train_tokenizer
    from llama_train.data.corpus import extract_builtin

    if not args.no_cold:
        res["cold_prepare"] = _cold_prepare(args.vocab_size, work)
    t0 = time.perf_counter()
    if args.cached_corpus:  # a re-run that times the rest: the corpus as training reads it
        from llama_train.data import builtin_corpus

        docs = list(builtin_corpus())
        res["corpus_build_s"] = None
    else:
        docs = list(extract_builtin())  # the extraction itself, not the cache the cold run left
        res["corpus_build_s"] = time.perf_counter() - t0
    res["corpus"] = {"documents": len(docs), "MB": sum(len(d.encode("utf-8")) for d in docs) / 1e6}
    t0 = time.perf_counter()
    tok_path = train_tokenizer(docs, args.vocab_size, work / "tok")
    res["tokenizer_train_s"] = time.perf_counter() - t0
    return docs, tok_path, Tokenizer(tok_path)


def _prepare_throughput(args: argparse.Namespace, work: Path, docs: list, tok, tok_path,
                        res: dict) -> None:
    """Plain sentencepiece against prepare_data with num_proc=1 and 2, interleaved.

    The built-in corpus repeated --scale times as a .jsonl file: the local-file path of real
    runs (HF json builder, streaming) on enough text for worker processes to matter."""
    from llama_train.data import DataConfig, prepare_data

    src = work / "corpus.jsonl"
    with open(src, "w") as f:
        for _ in range(args.scale):
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    big = docs * args.scale
    src_bytes = res["corpus"]["MB"] * 1e6 * args.scale
    res["prepare_source"] = {"file": "built-in corpus x %d as .jsonl" % args.scale, "MB": src_bytes / 1e6}
    times: dict[str, list[float]] = {"sentencepiece": [], "prepare_np1": [], "prepare_np2": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    ntokens = sum(len(x) + 1 for x in tok.sp.encode(docs)) * args.scale
    res["prepare_source"]["tokens"] = ntokens
    import datasets  # noqa: F401 - a one-off import (~2 s) that is not throughput

    for r in range(args.repeats):
        wall, c = _timed_cpu(lambda: tok.sp.encode(big))
        times["sentencepiece"].append(wall)
        cpu["sentencepiece"].append(c)
        for np_ in (1, 2):
            cfg = DataConfig(source=str(src), tokenizer=tok_path, num_proc=np_, val_fraction=0.05,
                             streaming=True, prepared_dir=str(work / f"prep-{r}-{np_}"))
            wall, c = _timed_cpu(lambda: prepare_data(cfg, args.vocab_size))
            times[f"prepare_np{np_}"].append(wall)
            cpu[f"prepare_np{np_}"].append(c)
    res["prepare"] = {
        k: {"median_s": _median(v), "MB_per_s": src_bytes / 1e6 / _median(v),
            "tokens_per_s": ntokens / _median(v), "cpu_s": _median(cpu[k]), "all_s": v}
        for k, v in times.items()
    }


def _loader_vs_step(args: argparse.Namespace, work: Path, tok, tok_path, res: dict) -> None:
    """TrainLoader per micro-batch (0 and 1 workers) against one train step, interleaved."""
    from llama_train.data import DataConfig, TrainLoader, prepare_data

    loader_cfg = DataConfig(source="builtin", tokenizer=tok_path, num_proc=1, val_fraction=0.05,
                            prepared_dir=str(work / "prep-builtin"))
    prepared_dir = prepare_data(loader_cfg, args.vocab_size).dir
    L, B = args.seq_len, args.micro_batch
    step, step_desc = _model_step(L, B, tok.vocab_size)
    step()  # warm-up (allocations)
    loaders = {w: TrainLoader(prepared_dir, L, B, B, 0, 1, seed=1, num_workers=w) for w in (0, 1)}
    iters = {w: iter(ld) for w, ld in loaders.items()}
    for it in iters.values():
        next(it)  # worker start-up is a one-off, not a per-batch cost
    lt: dict[str, list[float]] = {"loader_w0": [], "loader_w1": [], "model_step": []}
    for _ in range(args.repeats):
        for w, it in iters.items():
            lt[f"loader_w{w}"].append(_timed(lambda: [next(it) for _ in range(args.loader_batches)])
                                      / args.loader_batches)
        lt["model_step"].append(_timed(lambda: [step() for _ in range(args.model_steps)]) / args.model_steps)
    res["loader"] = {k: {"median_ms": 1e3 * _median(v), "all_ms": [1e3 * x for x in v]} for k, v in lt.items()}
    res["loader"]["model_step"]["what"] = step_desc
    loaders.clear()
    iters.clear()


def format_report(res: dict, args: argparse.Namespace, vocab_size: int) -> str:
    p, lo, src = res["prepare"], res["loader"], res["prepare_source"]
    load0, load1 = res["loadavg"]["start"], res["loadavg"]["end"]
    build = "cached" if res["corpus_build_s"] is None else f"{res['corpus_build_s']:.2f}s"
    lines = [f"machine: {res['cpus']} CPUs, torch threads {res['torch_threads']}, load average "
             f"{load0[0]:.1f} -> {load1[0]:.1f}; medians of {args.repeats} interleaved repeats",
             f"built-in corpus: {res['corpus']['documents']} documents, {res['corpus']['MB']:.2f} MB "
             f"(vocab {vocab_size}); build {build}, tokenizer training "
             f"{res['tokenizer_train_s']:.2f}s"]
    if "cold_prepare" in res:
        c = res["cold_prepare"]
        lines.append(f"cold `llama-data prepare` (fresh process, empty cache): {c['wall_s']:.1f}s wall "
                     f"(tokenizer {c['tokenizer_s']:.1f}s, tokenize+write {c['tokenize_write_s']:.1f}s)")
    lines.append(f"tokenize {src['file']} ({src['MB']:.1f} MB, {src['tokens']:,} tokens):")
    lines.append(f"{'':34s} {'wall s':>8s} {'MB/s':>7s} {'tokens/s':>11s} {'CPU s':>7s}")
    for k, label in (("sentencepiece", "plain sentencepiece, 1 process"),
                     ("prepare_np1", "prepare_data num_proc=1"), ("prepare_np2", "prepare_data num_proc=2")):
        lines.append(f"{label:34s} {p[k]['median_s']:8.3f} {p[k]['MB_per_s']:7.2f} "
                     f"{p[k]['tokens_per_s']:11,.0f} {p[k]['cpu_s']:7.2f}")
    B, L = args.micro_batch, args.seq_len
    lines.append(f"TrainLoader {B}x{L}: {lo['loader_w0']['median_ms']:.2f} ms/batch (0 workers), "
                 f"{lo['loader_w1']['median_ms']:.2f} ms/batch (1 worker, prefetched)")
    lines.append(f"train step: {lo['model_step']['median_ms']:.1f} ms ({lo['model_step']['what']}); "
                 f"loading is {100 * lo['loader_w0']['median_ms'] / lo['model_step']['median_ms']:.2f}% "
                 "of it without workers")
    lines.append(f"reproduce: {res['command']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    cmd = "llama-bench data " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    import torch

    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="llama-bench-data-"))
    os.environ["LLAMA_TRAIN_CACHE"] = str(work / "cache")
    res: dict = {"command": cmd, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        docs, tok_path, tok = _one_off_costs(args, work, res)
        _prepare_throughput(args, work, docs, tok, tok_path, res)
        _loader_vs_step(args, work, tok, tok_path, res)
        res["loadavg"] = {"start": load0, "end": os.getloadavg()}
        print(format_report(res, args, tok.vocab_size))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
