"""The GPU checks (``bash launch/gpu_check.sh``, ``make gpu-check``): every GPU path of the project
run for real, in stages under one deadline (``--budget-s``), each figure printed with the command
that produced it.

Each stage has its own time limit (its cap, or what is left of the budget if less); a command
past it is killed with everything it started, and the stage records what it had. After each
stage the report (``OUT/gpu_check.json``) is written again, so a stage cut short, or the lease
ending, never loses the stages before it. The stages, in the order they run:

1. ``data``: the prepared data the checks read (found in ``$LLAMA_TRAIN_CACHE``, e.g. the bundle's
   ``.whl/cache``, else prepared here), and the 128256-piece tokenizer of the large-vocabulary
   stages (the 8192-piece one padded with pieces that never occur: ``data.tokenizer.pad_vocabulary``);
2. ``tiny``: the tiny model through the ``deepspeed`` launcher on 1 GPU in bf16: ZeRO-3 for 12 steps,
   the same stopped at step 6 and relaunched (every step's loss must equal the uninterrupted run's),
   and ZeRO-2 against ZeRO-3;
3. ``sdpa``: which attention kernels run (flash / memory-efficient / math), found by the profiler;
4. ``sim8b``: a simulated rank 0 of 64 (``comm.simulate_ranks``) of ``llama3_8b``, ZeRO-3 bf16, seq
   4096, activation checkpointing, on the GPU, per phase beside ``llama-plan``'s figure;
5. ``bench_*``: ``llama-bench train`` ours vs Hugging Face ``LlamaForCausalLM`` at ~1B, bf16, seq 2048:
   the 8192-vocabulary shape of 2026-11-28 (dim 2048, 21 layers, GQA 16/4) and ``llama3_2_1b``'s
   (128256 vocabulary, tied), eager, then compiled;
6. ``comm`` (2+ GPUs): NCCL bus bandwidth and 2 ranks ZeRO-2 == 1 rank;
7. issue 55's levers (not in ``--quick``; after the rest, so a default 480 s run reaches them only
   with ``--only``): ``bench_vocab_8192_fp8_eager`` (the ~1B with FP8 linears vs HF bf16, beside
   ``bench_vocab_8192_eager``'s bf16), ``bench_8b_layers_eager`` / ``_fp8_eager`` / ``_compiled``
   / ``_fp8_compiled`` (ours only, 4 layers of ``llama3_8b``: FP8 and compile against bf16,
   tokens/s), and ``fp8_loss_8b_layers`` (``llama-train`` 200 steps bf16 then FP8, both compiled
   as ``trainer.compile=auto`` does on CUDA: the loss, target within 1%). The stages before these
   pin ``trainer.compile=false`` where they launch ``llama-train``: their timings are eager's.

``--print-commands`` lists the commands without running anything (also on a CPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional

from llama_train.records import METRICS_FILE, RUN_INFO_FILE, read_metrics, step_records

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# the data every stage of the same vocabulary shares: prepared once (by the bundle, or here)
TINY_DATA = ["data.max_documents=600", "data.num_proc=1"]
# trainer.compile=false: the default (auto) compiles on CUDA, which would add a cold compile to
# each of these launches; compile has its own stages
TINY = ["model=tiny", *TINY_DATA, "trainer.seq_len=64", "trainer.micro_batch=4",
        "trainer.log_every=1", "trainer.eval_every=6", "trainer.save_every=6", "sample.tokens=8",
        "tracking.wandb.mode=disabled", "tracking.console=false", "deepspeed.precision=bf16",
        "trainer.max_steps=12", "trainer.compile=false"]
ONE_B_8K = {"dim": 2048, "n_layers": 21, "n_heads": 16, "n_kv_heads": 4, "vocab_size": 8192,
            "max_seq_len": 2048}  # ~1B: the shape measured on 2026-11-28
BIG_VOCAB = 128256  # Llama 3's
BENCH_DATA = ["data.num_proc=4"]  # the built-in corpus, whole


class Stage(NamedTuple):
    name: str
    cap_s: int  # its time limit when the budget has that much left
    run: Callable[["Check"], dict]
    quick: bool = True  # part of --quick
    min_s: int = 20  # with less of the budget left it is skipped, not started


class Check:
    """One run of the checks: the work dir, the deadline, the report written after each stage."""

    def __init__(self, work: Path, budget_s: float, dry: bool):
        self.work, self.dry = work, dry
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.budget_s = budget_s
        self.stage_end = self.deadline
        self.report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "budget_s": budget_s, "stages": {}}

    def left(self) -> float:
        return self.stage_end - time.monotonic()

    def run(self, cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None,
            limit: Optional[float] = None) -> int:
        """``cmd`` with its output in ``log``, killed (with every process it started, launched
        ranks in their own sessions included) at ``limit`` or at the stage's end; 124 then."""
        if self.dry:
            print(shlex.join(cmd))
            return 0
        timeout = min(limit or 1e9, self.left())
        if timeout < 5:
            print(f"  not started (stage time left {timeout:.0f} s): {shlex.join(cmd)}")
            return 124
        print(f"$ {shlex.join(cmd)}", flush=True)
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                rc = 124
        if rc != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
            why = f"killed at its {timeout:.0f} s limit" if rc == 124 else f"exit {rc}"
            print(f"  {why}; log {log}:\n{tail}", flush=True)
        return rc

    def write(self) -> None:
        if not self.dry:
            (self.work / "gpu_check.json").write_text(json.dumps(self.report, indent=1))


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every descendant (the launcher's ranks and a bench's runs start their
    own sessions, so a process group would miss them), then reap it."""
    import psutil

    try:
        parent = psutil.Process(proc.pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def losses(out: Path) -> Dict[int, float]:
    """Each logged training step's loss (a non-finite one, written as a string, left out)."""
    return {r.step: r["loss"] for r in step_records(read_metrics(out / METRICS_FILE), "loss")}


# --------------------------------------------------------------------------------------------
# 1. data
# --------------------------------------------------------------------------------------------

def big_vocab_tokenizer() -> Path:
    """Where the data stage keeps the padded 128256-piece tokenizer (the cache, so the bundle's
    copy is found on the GPU host)."""
    from llama_train.paths import cache_dir

    return cache_dir() / "gpu_check" / f"tokenizer_{BIG_VOCAB}.model"


def prepare_all() -> dict:
    """``--prepare-data``: every prepared dataset the checks read, found or prepared, and the
    padded tokenizer; what each one is. Run by the data stage, and by gpu_bundle.sh."""
    from llama_train.bench.settings import compose_config
    from llama_train.data import prepare_data
    from llama_train.data.tokenizer import pad_vocabulary

    out, t0 = {}, time.time()
    tiny = compose_config(["model=tiny", *TINY_DATA])
    out["tiny"] = prepare_data(tiny.data, vocab_size=tiny.model.vocab_size)
    eight = compose_config(["model=small", f"model.vocab_size={ONE_B_8K['vocab_size']}",
                            *BENCH_DATA])
    out["vocab_8192"] = prepare_data(eight.data, vocab_size=ONE_B_8K["vocab_size"])
    big = big_vocab_tokenizer()
    big.parent.mkdir(parents=True, exist_ok=True)
    pad_vocabulary(out["vocab_8192"].tokenizer_path, big, BIG_VOCAB)
    wide = compose_config(["model=llama3_2_1b", f"data.tokenizer={big}", *BENCH_DATA])
    out["vocab_128256"] = prepare_data(wide.data, vocab_size=BIG_VOCAB)
    res = {k: {"dir": v.dir, "created": v.created, "tokenizer": v.tokenizer_path}
           for k, v in out.items()}
    res["big_vocab_tokenizer"] = str(big)
    res["seconds"] = round(time.time() - t0, 1)
    return res


def stage_data(c: Check) -> dict:
    out = c.work / "data.json"
    cmd = [sys.executable, "-m", "llama_train.bench.gpu_check", "--prepare-data", str(out)]
    rc = c.run(cmd, c.work / "data.log")
    if c.dry:
        return {}
    if rc != 0:
        return {"error": f"exit {rc}", "log": str(c.work / "data.log")}
    res = json.loads(out.read_text())
    print(f"  data: {json.dumps(res)}", flush=True)
    return res


# --------------------------------------------------------------------------------------------
# 2. the tiny model through the launcher
# --------------------------------------------------------------------------------------------

def tiny_cmd(out: Path, *extra: str, gpus: int = 1) -> List[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(gpus), "--module", "llama_train.train",
            *TINY, f"trainer.output_dir={out}", *extra]


def stage_tiny(c: Check) -> dict:
    """ZeRO-3 12 steps; ZeRO-3 stopped at 6 and relaunched; ZeRO-2."""
    runs = [("z3", ["deepspeed.zero_stage=3"]),
            ("z3_resumed", ["deepspeed.zero_stage=3", "trainer.steps_this_run=6"]),
            ("z3_resumed", ["deepspeed.zero_stage=3"]),
            ("z2", ["deepspeed.zero_stage=2"])]
    res: dict = {"launches": []}
    for i, (name, extra) in enumerate(runs):
        t = time.time()
        cmd = tiny_cmd(c.work / name, *extra)
        rc = c.run(cmd, c.work / f"tiny_{i}_{name}.log", limit=150)
        res["launches"].append({"command": shlex.join(cmd), "exit": rc,
                                "seconds": round(time.time() - t, 1)})
        if rc != 0 and not c.dry:
            break
    if c.dry:
        return {}
    try:
        a, b, z2 = (losses(c.work / n) for n in ("z3", "z3_resumed", "z2"))
        res.update(z3_losses={k: round(v, 4) for k, v in sorted(a.items())},
                   loss_falls=a[12] < a[1],
                   resume_max_abs_diff=max(abs(a[k] - b[k]) for k in a),
                   resumed_steps=sorted(b),
                   zero2_vs_zero3_max_abs_diff=max(abs(a[k] - z2[k]) for k in a))
    except (OSError, KeyError, ValueError) as e:
        res["compare_error"] = repr(e)
    print(f"  tiny: {json.dumps({k: v for k, v in res.items() if k != 'launches'})}", flush=True)
    return res


# --------------------------------------------------------------------------------------------
# 3. SDPA backend
# --------------------------------------------------------------------------------------------

def sdpa_backend() -> dict:
    """The attention kernels the profiler sees in one bf16 forward+backward (``--sdpa``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llama_train.model import ModelArgs, Transformer

    args = ModelArgs(dim=2048, n_layers=1, n_heads=16, n_kv_heads=4, vocab_size=8192,
                     max_seq_len=2048)
    model = Transformer(args).cuda().to(torch.bfloat16)
    x = torch.randint(0, 8192, (2, 2048), device="cuda")
    model(x, x)[1].backward()  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(x, x)[1].backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    kinds = {"flash": [n for n in names if "flash" in n.lower()],
             "memory_efficient": [n for n in names if "efficient" in n.lower()
                                  or "fmha" in n.lower() or "cutlass" in n.lower()],
             "math": [n for n in names if "bmm" in n.lower() and "softmax" not in n.lower()]}
    used = [k for k in ("flash", "memory_efficient") if kinds[k]] or ["math"]
    return {"backend": used[0], "kernels": {k: sorted(v)[:4] for k, v in kinds.items() if v}}


def stage_sdpa(c: Check) -> dict:
    out = c.work / "sdpa.json"
    rc = c.run([sys.executable, "-m", "llama_train.bench.gpu_check", "--sdpa", str(out)],
               c.work / "sdpa.log")
    if c.dry:
        return {}
    res = json.loads(out.read_text()) if rc == 0 else {"error": f"exit {rc}"}
    print(f"  SDPA: {json.dumps(res)}", flush=True)
    return res


# --------------------------------------------------------------------------------------------
# 4. a simulated rank of a 64-rank llama3_8b job, on the GPU
# --------------------------------------------------------------------------------------------

def sim_cmd(out: Path, tokenizer: Path) -> List[str]:
    return [sys.executable, "-m", "llama_train.train", "model=llama3_8b",
            "deepspeed.zero_stage=3", "deepspeed.precision=bf16", "comm.simulate_ranks=64",
            "trainer.seq_len=4096", "trainer.micro_batch=1", "trainer.max_steps=2",
            "trainer.save_every=2", "trainer.eval_every=1000", "model.activation_checkpointing=true",
            f"data.tokenizer={tokenizer}", *BENCH_DATA, "tracking.wandb.mode=disabled",
            "trainer.compile=false", f"trainer.output_dir={out}"]


def stage_sim(c: Check) -> dict:
    out = c.work / "sim8b"
    cmd = sim_cmd(out, big_vocab_tokenizer())
    rc = c.run(cmd, c.work / "sim8b.log")
    if c.dry:
        return {}
    res: dict = {"command": shlex.join(cmd), "exit": rc}
    try:
        report = json.loads((out / RUN_INFO_FILE).read_text())["simulation"]
    except (OSError, KeyError, ValueError) as e:
        res["error"] = f"no simulation report: {e!r}"
        return res
    from llama_train.job.simulation import format_table

    res["report"] = report
    res["table"] = format_table(report)
    print(res["table"], flush=True)
    return res


# --------------------------------------------------------------------------------------------
# 5. ~1B, ours vs Hugging Face
# --------------------------------------------------------------------------------------------

def bench_cmd(out: Path, shape: str, compiled: bool, float8: bool = False,
              only: Optional[str] = None) -> List[str]:
    if shape == "vocab_8192":
        model = ["--preset", "small", *[a for k, v in ONE_B_8K.items()
                                        for a in ("--override", f"model.{k}={v}")]]
        micro_batch = 16
    elif shape == "8b_layers":  # llama3_8b's layer shapes, 4 of its 32 layers: one GPU holds it
        model = ["--preset", "llama3_8b", "--override", f"model.n_layers={EIGHT_B_LAYERS}",
                 "--override", f"data.tokenizer={big_vocab_tokenizer()}"]
        micro_batch = 4
    else:  # llama3_2_1b: its 128256 vocabulary's logits are 4x the 8K shape's per token
        model = ["--preset", "llama3_2_1b", "--override",
                 f"data.tokenizer={big_vocab_tokenizer()}"]
        micro_batch = 8
    cmd = [sys.executable, "-m", "llama_train.bench.train", "--device", "cuda",
           "--precision", "bf16", "--seq-len", "2048", "--micro-batch", str(micro_batch),
           "--steps", "8", "--warmup", "3", "--rounds", "1",
           "--interleave", "run",  # one side at a time: each gets the whole GPU
           "--json", str(out), *model, *[a for o in BENCH_DATA for a in ("--override", o)]]
    return (cmd + (["--compile"] if compiled else []) + (["--float8"] if float8 else [])
            + (["--only", only] if only else []))


ROUND = re.compile(r"round \d+/\d+: (.*)")
EIGHT_B_LAYERS = 4  # llama3_8b (dim 4096, ffn 14336, GQA 32/8, vocab 128256) with 4 layers


def bench_name(shape: str, compiled: bool, float8: bool = False) -> str:
    return f"bench_{shape}{'_fp8' if float8 else ''}_{'compiled' if compiled else 'eager'}"


def stage_bench(shape: str, compiled: bool, float8: bool = False,
                only: Optional[str] = None) -> Callable[[Check], dict]:
    def run(c: Check) -> dict:
        name = bench_name(shape, compiled, float8)
        out = c.work / f"{name}.json"
        cmd = bench_cmd(out, shape, compiled, float8, only)
        rc = c.run(cmd, c.work / f"{name}.log")
        if c.dry:
            return {}
        res: dict = {"command": shlex.join(cmd), "exit": rc}
        if rc == 0:
            r = json.loads(out.read_text())
            for side in ("ours", "hf"):
                if side in r:
                    x = r[side]
                    res[side] = {"step_s": x["step_time_s"]["median"],
                                 "tokens_per_s": x["tokens_per_s"], "mfu": x["mfu"],
                                 "mem_gb": x["mem_gb"], "loss_step1": x["loss_step1"]}
            if "ratio_ours_over_hf" in r:
                res["ours_over_hf"] = r["ratio_ours_over_hf"]["tokens_per_s"]
            res["peak_flops"] = {k: r["peak_flops"].get(k) for k in ("value", "kind", "source")}
        else:  # cut short: the rounds it printed
            log = (c.work / f"{name}.log").read_text(errors="replace")
            res["rounds_printed"] = ROUND.findall(log)
        print(f"  {name}: {json.dumps(res)}", flush=True)
        return res
    return run


# --------------------------------------------------------------------------------------------
# 6. 2+ GPUs
# --------------------------------------------------------------------------------------------

def stage_comm(c: Check) -> dict:
    """NCCL bus bandwidth; 2 ranks ZeRO-2 == 1 rank with the same global batch."""
    import torch

    n = torch.cuda.device_count() if not c.dry else 2
    if n < 2:
        return {"skipped": "one GPU: no NCCL traffic to measure"}
    res: dict = {}
    out = c.work / "allreduce.json"
    cmd = [str(BIN / "llama-bench"), "allreduce", "--device", "cuda", "--nprocs", str(n),
           "--json", str(out)]
    if c.run(cmd, c.work / "allreduce.log") == 0 and not c.dry:
        res["allreduce"] = json.loads(out.read_text())
    common = ["deepspeed.zero_stage=2", "trainer.global_batch=8"]
    one, two = c.work / "z2_1rank", c.work / "z2_2ranks"
    rcs = [c.run(tiny_cmd(one, *common, gpus=1), c.work / "z2_1.log"),
           c.run(tiny_cmd(two, *common, gpus=2), c.work / "z2_2.log")]
    if not c.dry and rcs == [0, 0]:
        a, b = losses(one), losses(two)
        res["zero2_2ranks_vs_1rank_max_abs_diff"] = max(abs(a[k] - b[k]) for k in a)
    return res


# --------------------------------------------------------------------------------------------
# 7. FP8 and compile at llama3_8b's layer shapes: tokens/s above, the loss after 200 steps here
# --------------------------------------------------------------------------------------------

FP8_LOSS_STEPS = 200


def fp8_loss_cmd(out: Path, float8: bool) -> List[str]:
    """llama-train itself, 200 steps of 4 llama3_8b layers in bf16, with or without FP8."""
    return [sys.executable, "-m", "llama_train.train", "model=llama3_8b",
            f"model.n_layers={EIGHT_B_LAYERS}", f"data.tokenizer={big_vocab_tokenizer()}",
            *BENCH_DATA, "deepspeed.precision=bf16", "trainer.seq_len=2048",
            "trainer.micro_batch=4", f"trainer.max_steps={FP8_LOSS_STEPS}",
            "trainer.log_every=10", "trainer.eval_every=100000", "trainer.save_every=100000",
            "sample.tokens=0", "tracking.wandb.mode=disabled", "tracking.console=false",
            f"float8.enabled={'true' if float8 else 'false'}", f"trainer.output_dir={out}"]


def stage_fp8_loss(c: Check) -> dict:
    """bf16 then FP8 for 200 steps each: the mean loss of the last 10 logged steps, and FP8's
    relative difference (the target: within 1%)."""
    res: dict = {}
    for kind, on in (("bf16", False), ("fp8", True)):
        out = c.work / f"fp8_loss_{kind}"
        cmd = fp8_loss_cmd(out, on)
        rc = c.run(cmd, c.work / f"fp8_loss_{kind}.log", limit=c.left() / (2 if not on else 1))
        res[kind] = {"command": shlex.join(cmd), "exit": rc}
        if c.dry or rc != 0:
            continue
        got = losses(out)
        last = [got[k] for k in sorted(got)[-10:]]
        res[kind].update(steps=max(got), loss_last10=sum(last) / len(last))
    if not c.dry and all("loss_last10" in res[k] for k in ("bf16", "fp8")):
        a, b = res["bf16"]["loss_last10"], res["fp8"]["loss_last10"]
        res["fp8_vs_bf16_rel_diff"] = (b - a) / a
    if not c.dry:
        print(f"  fp8_loss_8b_layers: {json.dumps(res)}", flush=True)
    return res


STAGES = [
    Stage("data", 150, stage_data),
    Stage("tiny", 150, stage_tiny),
    Stage("sdpa", 45, stage_sdpa),
    Stage("sim8b", 120, stage_sim),
    Stage("bench_vocab_8192_eager", 100, stage_bench("vocab_8192", False), quick=False),
    Stage("bench_vocab_128256_eager", 100, stage_bench("vocab_128256", False), quick=False),
    Stage("bench_vocab_8192_compiled", 130, stage_bench("vocab_8192", True), quick=False),
    Stage("bench_vocab_128256_compiled", 130, stage_bench("vocab_128256", True), quick=False),
    Stage("comm", 120, stage_comm),
    # issue 55's levers, after everything else: run them with --only (and a budget that holds
    # them); in a default 480 s run the budget is spent before they start, and they say so
    Stage("bench_vocab_8192_fp8_eager", 100, stage_bench("vocab_8192", False, float8=True),
          quick=False),
    Stage("bench_8b_layers_eager", 100, stage_bench("8b_layers", False, only="ours"),
          quick=False),
    Stage("bench_8b_layers_fp8_eager", 100,
          stage_bench("8b_layers", False, float8=True, only="ours"), quick=False),
    Stage("bench_8b_layers_compiled", 130, stage_bench("8b_layers", True, only="ours"),
          quick=False),
    # torchao's FP8 casts fuse into the matmuls' neighbours only when compiled: the pair the
    # peers' +28-33% compares
    Stage("bench_8b_layers_fp8_compiled", 130,
          stage_bench("8b_layers", True, float8=True, only="ours"), quick=False),
    Stage("fp8_loss_8b_layers", 300, stage_fp8_loss, quick=False, min_s=120),
]


def run_stages(c: Check, stages: List[Stage]) -> None:
    """Each stage in turn under the budget: its limit is its cap or what is left, whichever is
    less (less left than the stage's ``min_s``: skipped, said so); the report is written after
    each."""
    for stage in stages:
        left = c.deadline - time.monotonic()
        limit = min(stage.cap_s, left)
        if not c.dry and left < stage.min_s:
            c.report["stages"][stage.name] = {"skipped": f"budget: {left:.0f} s left"}
            print(f"== stage {stage.name}: skipped, {left:.0f} s of the budget left", flush=True)
            c.write()
            continue
        print(f"== stage {stage.name} (limit {limit:.0f} s; budget left {left:.0f} of "
              f"{c.budget_s:.0f} s)", flush=True)
        c.stage_end = time.monotonic() + limit
        t = time.monotonic()
        try:
            res = stage.run(c)
        except Exception as e:  # a stage's own failure must not lose the report
            res = {"error": repr(e)}
        used = time.monotonic() - t
        c.report["stages"][stage.name] = {**res, "seconds": round(used, 1),
                                          "limit_s": round(limit)}
        c.write()
        if not c.dry:
            print(f"-- {stage.name}: {used:.0f} s of its {limit:.0f} s; budget used "
                  f"{time.monotonic() - c.t0:.0f} of {c.budget_s:.0f} s", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="work dir and report (default: a temp dir)")
    p.add_argument("--budget-s", type=float, default=480,
                   help="seconds for every stage together (default 480)")
    p.add_argument("--quick", action="store_true", help="no ~1B bench stages")
    p.add_argument("--only", default=None, help="comma-separated stage names to run")
    p.add_argument("--print-commands", action="store_true", help="list the commands, run none")
    p.add_argument("--prepare-data", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--sdpa", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from llama_train.bounds import Range, check_options

    msg = check_options(args, {"budget_s": Range(0, 7 * 24 * 3600, lo_open=True,
                                                 fix="seconds for every stage together")})
    if msg is not None:
        p.error(msg)
    if args.prepare_data:  # the data stage's child, and gpu_bundle.sh
        Path(args.prepare_data).write_text(json.dumps(prepare_all(), indent=1))
        return
    if args.sdpa:
        Path(args.sdpa).write_text(json.dumps(sdpa_backend()))
        return
    dry = args.print_commands
    if not dry:
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: skipped: torch sees no CUDA device.")
            return
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {s.name for s in STAGES}
    if unknown:
        raise SystemExit(f"gpu_check: --only {','.join(sorted(unknown))}: no such stage "
                         f"(stages: {', '.join(s.name for s in STAGES)})")
    work = Path(args.out or ("WORK" if dry else tempfile.mkdtemp(prefix="gpu_check_")))
    if not dry:
        work.mkdir(parents=True, exist_ok=True)
    c = Check(work, args.budget_s, dry)
    if not dry:
        import torch

        c.report["device"] = {"name": torch.cuda.get_device_name(0),
                              "count": torch.cuda.device_count(), "torch": torch.__version__,
                              "cuda": torch.version.cuda}
    run_stages(c, [st for st in STAGES if not (only and st.name not in only)
                   and not (args.quick and not st.quick)])
    c.report["seconds"] = round(time.monotonic() - c.t0, 1)
    c.write()
    if not dry:
        print(f"report: {work / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
