"""``llama-bench docmask``: what document masking costs a training step.

    llama-bench docmask                                  # CPU (or the GPU if there is one)
    llama-bench docmask --shapes 256:1024 --docs 1,16 --rounds 9
    llama-bench docmask --device cuda --shapes 2048:4096,4096:8192 --dtype bf16

Times forward + backward of ``llama_train.model.Transformer`` (loss over every target, gradients
of every parameter) on packed windows of random tokens, micro-batch ``--micro-batch``, for:

* ``causal``: plain causal attention, ``model(x, y)`` (SDPA ``is_causal=True``, today's path);
* ``mask/N``: the same window with N documents (N-1 EOS at random cut points, at least one token
  each) and document masking, ``model(x, y, doc_ids=document_ids(x, eos))``: the ids and the dense
  (B, 1, T, T) mask are built inside the timed step, as a trainer would.

``mask/1`` has one document, so it computes exactly what ``causal`` does: the pure cost of the
dense-mask path. Every round runs every variant once, in an order rotated by one each round;
the table gives medians over the rounds and the paired ratio mask/causal (per round, so both saw
the same machine). ``attended`` is the share of the causal (query, key) pairs the mask keeps:
what a block-sparse kernel (flex_attention) could skip and dense SDPA cannot. On CUDA the step
is synchronised before and after timing and the peak allocated memory per variant is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from llama_train.bench import COUNT, COUNT0, THREADS, check_options, report_or_exit
from llama_train.bounds import SEED_MAX, Range

EOS = 2
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ints(text: str, flag: str) -> List[int]:
    try:
        vals = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"llama-bench docmask: {flag}={text!r} must be a comma list of "
                         f"integers") from None
    if not vals or any(v < 1 for v in vals):
        raise SystemExit(f"llama-bench docmask: {flag}={text!r} must list integers >= 1")
    return vals


def _shapes(text: str) -> List[Tuple[int, int]]:
    out = []
    for item in str(text).split(","):
        parts = item.strip().split(":")
        try:
            dim, seq = (int(p) for p in parts)
        except ValueError:
            raise SystemExit(f"llama-bench docmask: --shapes item {item!r} must be DIM:SEQ_LEN, "
                             f"e.g. 256:1024") from None
        if dim < 1 or seq < 2:
            raise SystemExit(f"llama-bench docmask: --shapes item {item!r}: dim >= 1, seq_len >= 2")
        out.append((dim, seq))
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llama-bench docmask", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="256:256,256:1024,512:512",
                   help="comma list of DIM:SEQ_LEN (default 256:256,256:1024,512:512)")
    p.add_argument("--docs", default="1,4,16", help="documents per window, comma list (default 1,4,16)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64, help="n_heads = dim / head_dim (default 64)")
    p.add_argument("--kv-ratio", type=int, default=2,
                   help="n_heads / n_kv_heads (default 2: grouped-query attention; 1: multi-head)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median; default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", *_DTYPES), default="auto",
                   help="model dtype (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads on CPU (default: torch's, i.e. OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the report to this file ('-': JSON on stdout only)")
    args = p.parse_args(argv)
    check_options("docmask", args, {
        "micro_batch": COUNT, "n_layers": COUNT, "head_dim": COUNT, "kv_ratio": COUNT,
        "vocab": Range(EOS + 2, 2**32, integer=True), "rounds": COUNT, "warmup": COUNT0,
        "threads": THREADS, "seed": Range(0, SEED_MAX, integer=True)})
    args.shape_list = _shapes(args.shapes)
    args.docs_list = _ints(args.docs, "--docs")
    for dim, seq in args.shape_list:
        if dim % args.head_dim or (dim // args.head_dim) % args.kv_ratio:
            raise SystemExit(f"llama-bench docmask: dim {dim} must be a multiple of --head-dim "
                             f"{args.head_dim} with n_heads a multiple of --kv-ratio {args.kv_ratio}")
        if max(args.docs_list) > seq:
            raise SystemExit(f"llama-bench docmask: {max(args.docs_list)} documents do not fit "
                             f"in seq_len {seq}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("llama-bench docmask: --device cuda but torch sees no GPU")
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    return args


def packed_batch(batch: int, seq_len: int, n_docs: int, vocab: int,
                 gen: torch.Generator) -> torch.Tensor:
    """(batch, seq_len) random tokens (never EOS) cut into ``n_docs`` documents per row at
    random points: EOS ends each document but the last, which runs past the window."""
    x = torch.randint(EOS + 1, vocab, (batch, seq_len), generator=gen)
    for row in x:
        # n_docs - 1 distinct cut points in 0..seq_len-2 (every document keeps >= 1 token)
        cuts = torch.randperm(seq_len - 1, generator=gen)[: n_docs - 1]
        row[cuts] = EOS
    return x


def attended_share(doc_ids: torch.Tensor) -> float:
    """Allowed (query, key) pairs under document masking / under plain causal attention."""
    T = doc_ids.size(1)
    kept = 0.0
    for row in doc_ids.unbind(0):
        n = torch.bincount(row).double()  # tokens per document
        kept += float((n * (n + 1) / 2).sum())
    return kept / (doc_ids.size(0) * T * (T + 1) / 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_report(args: argparse.Namespace) -> Dict[str, Any]:
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed)
    load_start = list(os.getloadavg())
    loads: List[float] = []
    results = [_one_shape(args, dim, seq, device, dtype, gen, loads) for dim, seq in args.shape_list]
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
               "python": platform.python_version(), "torch": torch.__version__,
               "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                          else platform.processor() or "cpu"),
               "threads": torch.get_num_threads(),
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
               "loadavg_1min_median": statistics.median(loads) if loads else None}
    return {"bench": "docmask",
            "command": (f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} "
                        if os.environ.get("OMP_NUM_THREADS") else "")
                       + "llama-bench docmask " + shlex.join(_forwarded(args)),
            "machine": machine,
            "settings": {"shapes": args.shape_list, "docs": args.docs_list,
                         "micro_batch": args.micro_batch, "n_layers": args.n_layers,
                         "head_dim": args.head_dim, "kv_ratio": args.kv_ratio,
                         "vocab": args.vocab, "rounds": args.rounds, "warmup": args.warmup,
                         "device": args.device, "dtype": args.dtype, "seed": args.seed},
            "results": results}


def _rounds(args: argparse.Namespace, variants: List[str], step, loads: List[float]) -> Dict[str, List[float]]:
    """``args.warmup`` untimed rounds, then ``args.rounds`` timed ones, every variant once per
    round in an order rotated by one each timed round; the 1-min load average noted per round."""
    for _ in range(args.warmup):
        for v in variants:
            step(v)
    times: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        k = r % len(variants)
        loads.append(os.getloadavg()[0])
        for v in variants[k:] + variants[:k]:
            times[v].append(step(v))
    return times


def _one_shape(args: argparse.Namespace, dim: int, seq: int, device: torch.device, dtype: torch.dtype,
               gen: torch.Generator, loads: List[float]) -> Dict[str, Any]:
    """Every variant at one (dim, seq_len): the whole step, one attention layer, the mask alone."""
    from llama_train.model import ModelArgs, Transformer, document_ids

    n_heads = dim // args.head_dim
    margs = ModelArgs(dim=dim, n_layers=args.n_layers, n_heads=n_heads,
                      n_kv_heads=n_heads // args.kv_ratio, vocab_size=args.vocab, max_seq_len=seq)
    model = Transformer(margs, device=device, seed=args.seed).to(dtype).train()
    variants = ["causal"] + [f"mask/{d}" for d in args.docs_list]
    batches = {"causal": packed_batch(args.micro_batch, seq, 1, args.vocab, gen)}
    for d in args.docs_list:
        batches[f"mask/{d}"] = packed_batch(args.micro_batch, seq, d, args.vocab, gen)
    batches = {k: v.to(device) for k, v in batches.items()}
    peaks: Dict[str, int] = {}

    def step(v: str) -> float:
        x = batches[v]
        y = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        if v == "causal":
            _, loss = model(x, y)
        else:
            _, loss = model(x, y, doc_ids=document_ids(x, EOS))
        loss.backward()
        _sync(device)
        dt = time.perf_counter() - t0
        if device.type == "cuda":
            peaks[v] = max(peaks.get(v, 0), torch.cuda.max_memory_allocated(device))
        return dt

    times = _rounds(args, variants, step, loads)
    attn_times = _attention_times(args, model, batches, variants, device, dtype, gen)
    build_ms = _mask_build_ms(args, batches, variants, device, dtype)
    tokens = args.micro_batch * seq
    rows = []
    for v in variants:
        med = statistics.median(times[v])
        row: Dict[str, Any] = {
            "variant": v, "median_ms": 1e3 * med, "min_ms": 1e3 * min(times[v]),
            "max_ms": 1e3 * max(times[v]), "tokens_per_s": tokens / med,
            "runs_ms": [1e3 * t for t in times[v]],
            "attn_median_ms": 1e3 * statistics.median(attn_times[v]),
            "attn_runs_ms": [1e3 * t for t in attn_times[v]]}
        if v != "causal":
            ratios = [a / c for a, c in zip(times[v], times["causal"])]
            attn_ratios = [a / c for a, c in zip(attn_times[v], attn_times["causal"])]
            row.update(attn_ratio_paired=statistics.median(attn_ratios))
            ids = document_ids(batches[v].cpu(), EOS)
            row.update(ratio_paired=statistics.median(ratios), ratios=ratios,
                       attended=attended_share(ids),
                       docs_mean=float((ids.max(1).values + 1).double().mean()),
                       mask_build_ms=build_ms[v],
                       mask_mib=args.micro_batch * seq * seq * dtype.itemsize / 2**20)
        if v in peaks:
            row["peak_mib"] = peaks[v] / 2**20
        rows.append(row)
    return {"dim": dim, "seq_len": seq, "n_heads": n_heads, "n_kv_heads": margs.kv_heads, "rows": rows}


def _attention_times(args: argparse.Namespace, model, batches: Dict[str, torch.Tensor], variants: List[str],
                     device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Dict[str, List[float]]:
    """One attention layer alone (projections, RoPE, SDPA; the mask prebuilt), same rounds: the
    part of the step the mask changes, with less of the rest's noise."""
    from llama_train.model import document_ids, document_mask

    attn = model.layers[0].attention
    seq = batches["causal"].size(1)
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    xa = torch.randn(args.micro_batch, seq, model.args.dim, generator=gen).to(device, dtype)
    ga = torch.randn_like(xa)
    masks = {v: document_mask(document_ids(batches[v], EOS), dtype=dtype) for v in variants[1:]}

    def attn_step(v: str) -> float:
        x = xa.detach().requires_grad_()
        attn.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        out = attn(x, cos, sin) if v == "causal" else attn(x, cos, sin, None, 0, masks[v])
        out.backward(ga)
        _sync(device)
        return time.perf_counter() - t0

    times: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(args.warmup + args.rounds):  # the warm-up rounds rotate too (unlike _rounds)
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            dt = attn_step(v)
            if r >= args.warmup:
                times[v].append(dt)
    return times


def _mask_build_ms(args: argparse.Namespace, batches: Dict[str, torch.Tensor], variants: List[str],
                   device: torch.device, dtype: torch.dtype) -> Dict[str, float]:
    """The mask alone: ids + dense mask, as the forward builds it (median ms per variant)."""
    from llama_train.model import document_ids, document_mask

    build_ms: Dict[str, float] = {}
    for v in variants[1:]:
        x, samples = batches[v], []
        for _ in range(max(3, args.rounds)):
            _sync(device)
            t0 = time.perf_counter()
            document_mask(document_ids(x, EOS), dtype=dtype)
            _sync(device)
            samples.append(time.perf_counter() - t0)
        build_ms[v] = 1e3 * statistics.median(samples)
    return build_ms


def _forwarded(args: argparse.Namespace) -> List[str]:
    out = ["--shapes", args.shapes, "--docs", args.docs, "--micro-batch", str(args.micro_batch),
           "--n-layers", str(args.n_layers), "--head-dim", str(args.head_dim),
           "--kv-ratio", str(args.kv_ratio), "--vocab", str(args.vocab),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup),
           "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def format_table(r: Dict[str, Any]) -> str:
    m, s = r["machine"], r["settings"]
    lines = [f"llama-bench docmask: forward+backward, micro-batch {s['micro_batch']}, "
             f"{s['n_layers']} layers, head_dim {s['head_dim']}, vocab {s['vocab']}, "
             f"{s['dtype']} on {s['device']} ({m['device']}); median of {s['rounds']} interleaved "
             f"rounds after {s['warmup']} warm-up",
             f"torch {m['torch']}, {m['threads']} thread(s) (OMP_NUM_THREADS="
             f"{m['omp_num_threads']}), {m['cpu_count']} CPUs; load average "
             f"{m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end, median "
             f"{m['loadavg_1min_median']:.2f}", ""]
    gpu = any("peak_mib" in row for res in r["results"] for row in res["rows"])
    head = (f"{'dim':>5} {'seq':>5} {'heads':>6}  {'variant':<8} {'docs':>5} {'attended':>8} "
            f"{'median ms':>9} {'min':>8} {'max':>8} {'tok/s':>8} {'mask/causal':>11} "
            f"{'mask build ms':>13} {'mask MiB':>8}" + (f" {'peak MiB':>8}" if gpu else "")
            + f" | {'attn ms':>8} {'mask/causal':>11}")
    lines.append(head)
    for res in r["results"]:
        for row in res["rows"]:
            masked = row["variant"] != "causal"
            lines.append(
                f"{res['dim']:>5} {res['seq_len']:>5} {res['n_heads']:>3}/{res['n_kv_heads']:<2}  "
                f"{row['variant']:<8} "
                f"{(format(row['docs_mean'], '.0f') if masked else '-'):>5} "
                f"{(format(row['attended'], '.3f') if masked else '1'):>8} "
                f"{row['median_ms']:9.1f} {row['min_ms']:8.1f} {row['max_ms']:8.1f} "
                f"{row['tokens_per_s']:8.0f} "
                f"{(format(row['ratio_paired'], '.3f') if masked else '-'):>11} "
                f"{(format(row['mask_build_ms'], '.2f') if masked else '-'):>13} "
                f"{(format(row['mask_mib'], '.1f') if masked else '-'):>8}"
                + (f" {row.get('peak_mib', 0):8.0f}" if gpu else "")
                + f" | {row['attn_median_ms']:8.1f} "
                f"{(format(row['attn_ratio_paired'], '.3f') if masked else '-'):>11}")
    lines += ["", "left of |: the whole model, forward+backward (the mask built inside); right of |: "
              "one attention layer alone, forward+backward, mask prebuilt",
              "mask/causal: median over rounds of (masked step / causal step of the same round); "
              "attended: share of the causal (query, key) pairs the mask keeps",
              f"reproduce: {r['command']}"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    report_or_exit("docmask", make_report, args, format_table)


if __name__ == "__main__":
    main()
