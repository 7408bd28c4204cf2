"""``llama-plan``: the command line of :mod:`llama_train.scaling` (compute-optimal,
inference-optimal, model-info, shape, fit): its parser, the ranges of its options, and the
small subcommands; ``model-info`` is :mod:`.cli_model_info`, ``fit`` :mod:`.cli_fit`, the
tables and SI formatting :mod:`.cli_format`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Dict, Optional, Sequence

from llama_train.scaling.approach2 import DEFAULT_WINDOW as WINDOW
from llama_train.scaling.cli_fit import _cmd_fit
from llama_train.scaling.cli_format import _si, _table
from llama_train.scaling.cli_model_info import _cmd_model_info
from llama_train.scaling.laws import FITS, ScalingError
from llama_train.scaling.memory import _args_dict
from llama_train.scaling.planners import compute_optimal, inference_optimal, shape_for_params
from llama_train.scaling.runs import REPEAT_HALF_LIFE
from llama_train.util import jsonable
from llama_train.bounds import SEED_MAX, Range, check_options


def _float(text: str) -> float:
    """argparse type: accepts 1e21, 1.5e12, 7B, 2T, 300M."""
    t = text.strip().replace("_", "")
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:].upper())
    try:
        return float(t[:-1]) * mult if mult else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (examples: 1e21, 7e9, 7B, 2T)") from None


def _print_fit_header(fit: Dict[str, Any]) -> None:
    print(f"fit: {fit['name']}  E={fit['E']:.4g} A={fit['A']:.5g} B={fit['B']:.5g} "
          f"alpha={fit['alpha']:.4g} beta={fit['beta']:.4g}")
    if fit.get("source"):
        print(f"     ({fit['source']})")


def _cmd_compute_optimal(ns: argparse.Namespace) -> Dict[str, Any]:
    res = compute_optimal(ns.flops, ns.fit)
    if not ns.json:
        print(f"Compute-optimal allocation for C = {ns.flops:.3g} training FLOPs (C = 6 N D)")
        _print_fit_header(res["fit"])
        e = res["exponents"]
        rows = [["Approach 3 (fit, closed form)", _si(res["n_params"]), _si(res["n_tokens"]),
                 f"{res['tokens_per_param']:.1f}", f"{res['loss']:.4f}", f"a={e['a']:.3f}"]]
        for key, label in (("approach1", "Approach 1 (Hoffmann Tab. 3)"), ("approach2", "Approach 2 (Hoffmann Tab. A3)")):
            ap = res["approaches"][key]
            rows.append([label, _si(ap["n_params"]), _si(ap["n_tokens"]), f"{ap['tokens_per_param']:.1f}", "-",
                         f"a={ap['a']:.2f}"])
        print(_table(rows, ["", "params N", "tokens D", "tokens/param", "pred. loss", "N ∝ C^a"]))
        print(f"N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b with a={e['a']:.4f}, b={e['b']:.4f}, G={e['G']:.4g}")
    _other_default(ns, res, "inference-optimal", ns.flops)
    return res


# Each subcommand's default loss law (--fit). They differ, so the compute-optimal model of one
# budget differs between them (1.82B vs 2.28B params at 3e20 FLOPs was seen); each output names
# the other's default and what it gives, so two tables are never compared unawares.
DEFAULT_FIT = {"compute-optimal": "chinchilla", "inference-optimal": "sardana"}


def _other_default(ns: argparse.Namespace, res: Dict[str, Any], other: str,
                   flops: Optional[float]) -> None:
    fit = DEFAULT_FIT[other]
    if flops is None or ns.fit == fit:
        return
    alt = compute_optimal(flops, fit)
    res["other_default_fit"] = {"command": f"llama-plan {other}", "fit": fit,
                                "n_params": alt["n_params"], "n_tokens": alt["n_tokens"],
                                "loss": alt["loss"]}
    if not ns.json:
        print(f"note: `llama-plan {other}` defaults to --fit {fit}; with it the compute-optimal "
              f"model of {flops:.3g} FLOPs is {_si(alt['n_params'])} params x "
              f"{_si(alt['n_tokens'])} tokens (pred. loss {alt['loss']:.4f}). Pass the same --fit "
              f"to both to compare them.")


def _cmd_inference_optimal(ns: argparse.Namespace) -> Dict[str, Any]:
    if ns.flops is None and ns.reference_params is None and ns.loss is None and ns.reference_tokens is None:
        raise ScalingError("inference-optimal: pass --flops C, or --reference-params N [--reference-tokens D], or --loss L")
    res = inference_optimal(ns.flops, ns.inference_tokens, ns.fit, reference_params=ns.reference_params,
                            reference_tokens=ns.reference_tokens, target_loss=ns.loss)
    if not ns.json:
        print(f"Inference-optimal model (Sardana et al. 2024) for the quality of the {res['target']}")
        _print_fit_header(res["fit"])
        print(f"target loss {res['loss']:.4f}, lifetime inference {_si(res['inference_tokens'])} tokens "
              f"(cost = 6 N D_train + 2 N D_inf)")
        cols = [("baseline", res["baseline"], "compute-optimal, same loss")]
        if "reference" in res:
            cols.append(("reference", res["reference"], "given model"))
        cols.append(("optimal", res, "inference-optimal"))
        rows = []
        for label, key in (("params N", "n_params"), ("train tokens D", "n_tokens"), ("tokens/param", "tokens_per_param"),
                           ("training FLOPs", "training_flops"), ("inference FLOPs", "inference_flops"),
                           ("total FLOPs", "total_flops")):
            rows.append([label] + [f"{c[key]:.1f}" if key == "tokens_per_param" else
                                   (_si(c[key]) if key in ("n_params", "n_tokens") else f"{c[key]:.4g}") for _, c, _ in cols])
        print(_table(rows, [""] + [f"{name} ({desc})" for name, _, desc in cols]))
        sv = res["savings"]
        print(f"saves {sv['flops']:.4g} FLOPs ({sv['percent']:.1f}%) vs the compute-optimal model of the same loss; "
              f"{res['param_ratio']:.1%} of its params, {res['token_ratio']:.2f}x its tokens")
        if "savings_vs_reference" in res:
            sr = res["savings_vs_reference"]
            print(f"saves {sr['flops']:.4g} FLOPs ({sr['percent']:.1f}%) vs the given reference model")
    _other_default(ns, res, "compute-optimal", ns.flops)
    return res


def _cmd_shape(ns: argparse.Namespace) -> Dict[str, Any]:
    from llama_train.model import count_params

    args = shape_for_params(ns.params, ns.vocab, ns.max_seq_len, count=ns.count, tie_embeddings=ns.tie_embeddings,
                            tolerance=ns.tolerance)
    counts = count_params(args)
    res = {"model_args": _args_dict(args), "params": counts, "target": ns.params, "count": ns.count,
           "relative_error": counts[ns.count] / ns.params - 1.0, "aspect_ratio": args.dim / args.n_layers}
    if not ns.json:
        print(f"LLaMA shape for {_si(ns.params)} {ns.count} params (vocab {ns.vocab}):")
        a = res["model_args"]
        print(_table([[k, a[k]] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim",
                                           "multiple_of", "vocab_size", "max_seq_len", "tie_embeddings")]))
        print(f"params: total {counts['total']:,}, non-embedding {counts['non_embedding']:,} "
              f"({res['relative_error']:+.2%} vs target); dim/n_layers = {res['aspect_ratio']:.0f}")
        print("yaml (configs/model/<name>.yaml):")
        for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len", "tie_embeddings"):
            v = a[k]
            print(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}")
    return res


def _common(p: argparse.ArgumentParser, fit: Optional[str] = "chinchilla") -> None:
    """--json, and --fit (the loss law) for the subcommands that use one."""
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    if fit:
        fits = ", ".join(f"{k} ({v.source.split(',')[0]})" for k, v in FITS.items())
        p.add_argument("--fit", default=fit,
                       help=f"loss-law constants (default {fit}): {fits}; or a YAML file with "
                            f"E, A, B, alpha, beta")


def _add_compute_optimal(sub) -> None:
    p = sub.add_parser("compute-optimal", help="loss-optimal N, D for a training budget (Hoffmann et al. 2022)")
    p.add_argument("--flops", type=_float, required=True, help="training budget C in FLOPs (C = 6 N D)")
    _common(p, fit=DEFAULT_FIT["compute-optimal"])
    p.set_defaults(func=_cmd_compute_optimal)


def _add_inference_optimal(sub) -> None:
    p = sub.add_parser("inference-optimal", help="lifetime-cost-optimal N, D at a fixed loss (Sardana et al. 2024)")
    p.add_argument("--flops", type=_float, help="target quality = the compute-optimal model of this budget")
    p.add_argument("--reference-params", type=_float, help="target quality = this model size ...")
    p.add_argument("--reference-tokens", type=_float, help="... trained on this many tokens (default: compute-optimal)")
    p.add_argument("--loss", type=float, help="target quality as a predicted loss")
    p.add_argument("--inference-tokens", type=_float, required=True, help="lifetime inference tokens D_inf")
    # Sardana et al.'s own constants, so their worked figures come out without a flag
    _common(p, fit=DEFAULT_FIT["inference-optimal"])
    p.set_defaults(func=_cmd_inference_optimal)


def _add_model_info(sub) -> None:
    p = sub.add_parser("model-info", help="params, FLOPs/token, ZeRO model-state and activation memory of a model")
    p.add_argument("--model", required=True, help="preset name (configs/model) or a model yaml path")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks of the job (ZeRO partitions over all of them)")
    p.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                   help="ranks sharing each sequence (parallel.sequence): activations per rank")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per forward")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer state in host memory")
    p.add_argument("--activation-checkpointing", action="store_true", help="force per-block recomputation on")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--loss-chunk-tokens", type=int, default=None, metavar="N",
                   help="the loss over N tokens at a time (0: whole logits); default: the "
                        "model's model.loss_chunk_tokens (null: on from a 32000-token vocabulary)")
    p.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload (with --offload-optimizer)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="for the per-rank peak")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: count what a CPU rank's resident set shows (llama-bench memory)")
    p.add_argument("--gpu-mem", type=float, default=None, metavar="GIB",
                   help="memory per rank: say whether the config fits and, if not, the cheapest change that does")
    p.add_argument("--ds-zero", action="append", default=[], metavar="KEY=N",
                   help="a DeepSpeed zero_optimization knob, e.g. stage3_max_reuse_distance=0 (repeatable)")
    t = p.add_argument_group("traffic and step time (ZeRO 1-3; docs/scale-out.md)")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    t.add_argument("--intra-node-gbps", type=float, default=900.0, metavar="GBYTES",
                   help="GPU-to-GPU bandwidth within a node in GB/s, gigaBYTES per second per GPU "
                        "(default 900: H100/H200 NVLink 4, both directions)")
    t.add_argument("--inter-node-gbps", type=float, default=400.0, metavar="GBITS",
                   help="network bandwidth between nodes in Gb/s, gigaBITS per second per GPU, as "
                        "NICs are sold (default 400: one 400G NIC per GPU = 50 GB/s)")
    t.add_argument("--gpu", default="H100", choices=["H100", "H200", "A100", "L40S", "A10", "4090",
                                                     "V100"],
                   help="the datasheet dense bf16 peak of this GPU (default H100: 989 TFLOP/s)")
    t.add_argument("--peak-tflops", type=float, default=None, help="a peak instead of --gpu's, TFLOP/s")
    t.add_argument("--efficiency", default="eager", choices=["eager", "compiled"],
                   help="the MFU our GPU check measured (eager 40.7%%, compiled 51.9%%, 1 x H200)")
    t.add_argument("--mfu", type=float, default=None, help="a compute efficiency (0-1) instead")
    t.add_argument("--hpz-partition-size", type=int, default=0, metavar="H",
                   help="ZeRO++ hpZ: a secondary weight partition over H ranks (one node)")
    t.add_argument("--mics-shard-size", type=int, default=0, metavar="M",
                   help="MiCS: shard within groups of M ranks")
    t.add_argument("--quantized-weights", action="store_true", help="ZeRO++ qwZ: int8 all-gathers")
    t.add_argument("--quantized-gradients", action="store_true",
                   help="ZeRO++ qgZ: int4 gradient all-to-alls instead of the reduce-scatter")
    t.add_argument("--recommend", action="store_true",
                   help="which of ZeRO-2, ZeRO-3, hpZ, hpZ+qwZ+qgZ, MiCS, with or without "
                        "activation checkpointing, fits --gpu-mem (default 80 GiB) and is fastest")
    _common(p, fit=False)
    p.set_defaults(func=_cmd_model_info)


def _add_shape(sub) -> None:
    p = sub.add_parser("shape", help="a LLaMA-shaped ModelArgs for a target parameter count")
    p.add_argument("--params", type=_float, required=True, help="target parameter count (e.g. 1.3e9 or 1.3B)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--count", default="total", choices=["total", "non_embedding"],
                   help="which count must hit the target (Chinchilla: total)")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.02, help="relative tolerance on the count")
    _common(p, fit=False)
    p.set_defaults(func=_cmd_shape)


def _add_fit(sub) -> None:
    p = sub.add_parser("fit", help="fit a sweep's final validation losses: IsoFLOP parabolas (Approach 2) and "
                                   "L(N,D) (Approach 3) with bootstrap intervals; IsoFLOP plot")
    p.add_argument("sweep_dir", metavar="PATH",
                   help="a sweep folder (run dirs, each: metrics.jsonl + run_info.json) or a runs CSV with columns "
                        "flops,params,non_embedding_params,tokens,val_loss,command (flops: the nominal budget)")
    p.add_argument("--out", help="write the IsoFLOP/frontier plot to this PNG")
    p.add_argument("--csv", metavar="OUT", help="write the runs read from PATH to this CSV (PATH for a later fit)")
    p.add_argument("--params", default="auto", choices=["auto", "total", "non_embedding", "both"],
                   help="which N to fit on: auto (default) the count the runs' budgets were planned on "
                        "(scaling.count, recorded by each run), else total; both: fit each and compare the exponents")
    p.add_argument("--save-fit", help="write the Approach 3 constants to this YAML (usable as --fit)")
    p.add_argument("--top-k", type=int, default=64,
                   help="run L-BFGS from the k best of the paper's 4500 initialisations (0 = all)")
    p.add_argument("--bootstrap", type=int, default=200, metavar="N",
                   help="Approach 2 bootstrap resamples (runs resampled within each budget; 0 = none)")
    p.add_argument("--bootstrap-a3", type=int, default=100, metavar="N",
                   help="Approach 3 bootstrap resamples, each an L-BFGS refit (0 = none)")
    p.add_argument("--bootstrap-top-k", type=int, default=10, metavar="K",
                   help="L-BFGS starts per Approach 3 bootstrap refit (plus the full-data optimum)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (same seed, same intervals)")
    p.add_argument("--repeat-half-life", type=float, default=REPEAT_HALF_LIFE, metavar="R",
                   help=f"Approach 3: R* of the discount of repeated tokens, D' = U + U R* (1 - exp(-R/R*)) "
                        f"(Muennighoff et al. 2023; default their {REPEAT_HALF_LIFE:g}; smaller: repeats worth less)")
    p.add_argument("--min-flops", type=float, default=None, metavar="C",
                   help="fit only the budgets of at least C FLOPs (both approaches): leave out the smallest "
                        "budgets when the law is to be used above them and its form misses their tiny models")
    p.add_argument("--window", type=int, default=WINDOW, metavar="K",
                   help=f"Approach 2: fit each budget's parabola to the runs within K sizes either side of "
                        f"its best run (default {WINDOW}; 0: all runs). Far from its minimum an IsoFLOP curve is "
                        f"not a parabola in ln N, and a sweep's over-trained points lie there")
    _common(p, fit=False)
    p.set_defaults(func=_cmd_fit)


_FLOPS = Range(0, 1e30, lo_open=True, optional=True, fix="FLOPs, C = 6 N D")
_TOKENS = Range(0, 1e30, lo_open=True, optional=True, fix="tokens")
# Each subcommand's numeric options and their ranges (llama_train.bounds), checked before any
# planning; --repeat-half-life and --zero-stage are checked where they are read and by argparse.
OPTIONS: Dict[str, Dict[str, Range]] = {
    "compute-optimal": {"flops": _FLOPS},
    "inference-optimal": {
        "flops": _FLOPS, "reference_params": Range(0, 1e15, lo_open=True, optional=True),
        "reference_tokens": _TOKENS,
        "loss": Range(0, lo_open=True, optional=True, fix="a predicted loss in nats"),
        "inference_tokens": Range(0, 1e30, fix="lifetime inference tokens")},
    "model-info": {
        "world_size": Range(1, 2**24, integer=True, fix="ranks of the job"),
        "sequence_parallel": Range(1, 2**24, integer=True, fix="ranks sharing each sequence"),
        "micro_batch": Range(1, 2**20, integer=True, fix="sequences per rank per forward"),
        "seq_len": Range(1, 2**24, integer=True, optional=True,
                         fix="leave it out for the model's max_seq_len"),
        "loss_chunk_tokens": Range(0, 2**24, integer=True, optional=True,
                                   fix="tokens per chunk of the loss, 0 for whole logits"),
        "gpu_mem": Range(0, 2**20, lo_open=True, optional=True, fix="GiB per rank"),
        "grad_accum": Range(1, 2**20, integer=True, fix="micro-batches per optimizer step"),
        "gpus_per_node": Range(1, 1024, integer=True, fix="GPUs in one node"),
        "intra_node_gbps": Range(0, 1e6, lo_open=True, fix="GB/s (gigabytes) per GPU"),
        "inter_node_gbps": Range(0, 1e7, lo_open=True, fix="Gb/s (gigabits) per GPU"),
        "peak_tflops": Range(0, 1e6, lo_open=True, optional=True, fix="TFLOP/s per GPU"),
        "mfu": Range(0, 1, lo_open=True, optional=True, fix="a fraction, e.g. 0.4"),
        "hpz_partition_size": Range(0, 2**24, integer=True, fix="ranks of hpZ's group, 0: off"),
        "mics_shard_size": Range(0, 2**24, integer=True, fix="ranks of a MiCS shard group, 0: off")},
    "shape": {
        "params": Range(1, 1e15, fix="a parameter count, e.g. 1.3e9 or 1.3B"),
        "vocab": Range(1, 2**32, integer=True, fix="the vocabulary size"),
        "max_seq_len": Range(1, 2**24, integer=True, fix="positions the RoPE tables cover"),
        "tolerance": Range(0, 1, lo_open=True, hi_open=True,
                           fix="relative error allowed on the count, e.g. 0.02")},
    "fit": {
        "top_k": Range(0, 4500, integer=True, fix="0 starts L-BFGS from all 4500"),
        "bootstrap": Range(0, 10**6, integer=True, fix="resamples, 0 for none"),
        "bootstrap_a3": Range(0, 10**5, integer=True, fix="refits, 0 for none"),
        "bootstrap_top_k": Range(1, 4500, integer=True, fix="L-BFGS starts per refit"),
        "seed": Range(0, SEED_MAX, integer=True),
        "min_flops": Range(0, 1e30, optional=True, fix="FLOPs of the smallest budget fitted"),
        "window": Range(0, integer=True, fix="sizes either side of the best run; 0: all runs")},
}


def build_parser() -> argparse.ArgumentParser:
    """llama-plan's parser: one subcommand each, its flags beside it (_add_<subcommand>)."""
    parser = argparse.ArgumentParser(
        prog="llama-plan",
        description="Scaling-law planner: compute-optimal and inference-optimal model sizes, model memory, shapes, fits.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_compute_optimal, _add_inference_optimal, _add_model_info, _add_shape, _add_fit):
        add(sub)
    parser.set_defaults(subcommands=sub.choices)  # name -> its parser, for its own usage
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # a wrong flag gets the usage of the subcommand it was given to (exit 2)
        ns.subcommands[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        msg = check_options(ns, OPTIONS.get(ns.command, {}))
        if msg is not None:
            raise ScalingError(msg)
        if getattr(ns, "top_k", None) == 0:
            ns.top_k = None
        # --json: stdout holds the JSON alone; whatever else is printed meanwhile goes to
        # stderr (DeepSpeed, imported by model-info, logs "Setting accelerator to CPU" through
        # a handler on stdout unless DS_ACCELERATOR is set)
        with contextlib.redirect_stdout(sys.stderr) if ns.json else contextlib.nullcontext():
            res = ns.func(ns)
        if ns.json:
            print(json.dumps(jsonable(res), indent=2))
    except ScalingError as exc:
        print(f"llama-plan {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `llama-plan ... | head`
        sys.stderr.close()
        return 0
    return 0
