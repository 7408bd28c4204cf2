"""The GPU checks (``bash launch/gpu_check.sh``, ``make gpu-check``): every GPU path of the project
run for real, each figure printed with the command that produced it.

1. the tiny model through the ``deepspeed`` launcher on 1 GPU in bf16 at ZeRO-0/1/2/3: the loss
   falls, a stop at step 10 and a relaunch continue the uninterrupted run, and step 1 matches a
   CPU fp32 run within bf16 tolerance;
2. which SDPA backend runs (flash / memory-efficient / math), found by the profiler;
3. a ~1B LLaMA (``llama-plan shape --params 1e9``, seq 2048, bf16): tokens/s and MFU of ours vs
   Hugging Face ``LlamaForCausalLM`` (``llama-bench train``), activation checkpointing and
   ``trainer.compile`` off and on, at the largest micro-batch that fits;
4. peak ``max_memory_allocated`` of those runs beside ``llama-plan model-info``;
5. NCCL all-reduce bus bandwidth on all GPUs (``llama-bench allreduce``) and, with 2+ GPUs, a
   2-rank ZeRO-2 run against the 1-rank run with the same global batch.

``--print-commands`` lists the commands without running anything (also on a CPU machine).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from llama_train.records import METRICS_FILE, read_metrics, step_records

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ["model=tiny", "data.max_documents=600", "data.num_proc=1", "trainer.seq_len=64",
        "trainer.micro_batch=4", "trainer.log_every=1", "trainer.eval_every=1000",
        "trainer.save_every=10", "sample.tokens=8", "tracking.wandb.mode=disabled",
        "tracking.console=false"]
BF16_TOL = 5e-2  # step-1 loss, bf16 on GPU vs fp32 on CPU (bf16 keeps 8 mantissa bits)


def tiny_cmd(out: Path, *extra: str, gpus: int = 1) -> List[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(gpus), "--module", "llama_train.train",
            *TINY, f"trainer.output_dir={out}", *extra]


def run(cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None,
        timeout: float = 1800) -> int:
    import os

    print(f"$ {shlex.join(cmd)}", flush=True)
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})}, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        print(f"  exit {proc.returncode}; log {log}:\n{tail}", flush=True)
    return proc.returncode


def losses(out: Path) -> Dict[int, float]:
    """Each logged training step's loss (a non-finite one, written as a string, left out)."""
    return {r.step: r["loss"] for r in step_records(read_metrics(out / METRICS_FILE), "loss")}


def check_tiny(work: Path, dry: bool) -> dict:
    """Step 1: ZeRO-0..3 in bf16 on one GPU; resume; step 1 against CPU fp32."""
    res: dict = {}
    cpu = work / "tiny_cpu"
    cpu_cmd = [sys.executable, "-m", "llama_train.train", *TINY, f"trainer.output_dir={cpu}",
               "trainer.max_steps=1", "trainer.device=cpu", "deepspeed.precision=fp32"]
    if dry:
        print(shlex.join(cpu_cmd))
    elif run(cpu_cmd, work / "tiny_cpu.log", {"DS_ACCELERATOR": "cpu"}) == 0:
        res["cpu_fp32_step1"] = losses(cpu)[1]
    for stage in (0, 1, 2, 3):
        full, part = work / f"tiny_z{stage}", work / f"tiny_z{stage}_resumed"
        common = [f"deepspeed.zero_stage={stage}", "deepspeed.precision=bf16",
                  "trainer.max_steps=20"]
        cmds = [tiny_cmd(full, *common), tiny_cmd(part, *common, "trainer.steps_this_run=10"),
                tiny_cmd(part, *common)]
        if dry:
            print("\n".join(shlex.join(c) for c in cmds))
            continue
        rcs = [run(c, work / f"tiny_z{stage}_{i}.log") for i, c in enumerate(cmds)]
        if any(rcs):
            res[f"zero{stage}"] = {"error": f"exit codes {rcs}"}
            continue
        a, b = losses(full), losses(part)
        r = {"step1": a[1], "step20": a[20], "loss_falls": a[20] < a[1],
             "resume_max_abs_diff": max(abs(a[k] - b[k]) for k in a)}
        if "cpu_fp32_step1" in res:
            r["step1_vs_cpu_fp32"] = abs(a[1] - res["cpu_fp32_step1"])
            r["step1_within_bf16_tol"] = r["step1_vs_cpu_fp32"] < BF16_TOL
        res[f"zero{stage}"] = r
        print(f"  ZeRO-{stage}: {json.dumps(r)}", flush=True)
    return res


def sdpa_backend(dry: bool) -> dict:
    """Step 2: the attention kernels the profiler sees in one bf16 forward+backward."""
    if dry:
        print("(in-process) torch.profiler over Attention forward/backward, bf16, 2 x 2048")
        return {}
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
    res = {"backend": used[0], "kernels": {k: sorted(v)[:4] for k, v in kinds.items() if v}}
    print(f"  SDPA: {json.dumps(res)}", flush=True)
    return res


def one_b_shape() -> List[str]:
    """model.* overrides of a ~1B LLaMA (vocab 8192: the built-in corpus' tokenizer)."""
    from llama_train.scaling import shape_for_params

    a = shape_for_params(1e9, vocab_size=8192, max_seq_len=2048)
    return [f"model.{k}={getattr(a, k)}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
                                                    "vocab_size", "max_seq_len")]


def bench_1b(work: Path, dry: bool) -> dict:
    """Steps 3 and 4: ours vs HF at ~1B, and peak memory against the plan."""
    shape, res = one_b_shape(), {}
    for ckpt in (False, True):
        for compiled in (False, True):
            name = f"actckpt={ckpt},compile={compiled}"
            for mb in (16, 8, 4, 2, 1):
                out = work / f"bench_1b_{int(ckpt)}{int(compiled)}_{mb}.json"
                cmd = [sys.executable, "-m", "llama_train.bench.train", "--device", "cuda",
                       "--precision", "bf16", "--seq-len", "2048", "--micro-batch", str(mb),
                       "--steps", "10", "--warmup", "3", "--rounds", "2",
                       "--interleave", "run",  # one side at a time: each gets the whole GPU
                       "--json", str(out), *[a for o in shape for a in ("--override", o)],
                       "--override", f"model.activation_checkpointing={str(ckpt).lower()}"]
                if compiled:
                    cmd.append("--compile")
                if dry:
                    print(shlex.join(cmd))
                    break
                if run(cmd, out.with_suffix(".log"), timeout=3600) == 0:
                    r = json.loads(out.read_text())
                    res[name] = {"micro_batch": mb, "command": shlex.join(cmd),
                                 "ours_tokens_per_s": r["ours"]["tokens_per_s"],
                                 "hf_tokens_per_s": r["hf"]["tokens_per_s"],
                                 "ratio_ours_over_hf": r["ratio_ours_over_hf"]["paired_median"],
                                 "ours_mem_gb": r["ours"]["mem_gb"],
                                 "hf_mem_gb": r["hf"]["mem_gb"],
                                 "planned": planned_memory(shape, mb, ckpt)}
                    print(f"  1B {name}: {json.dumps(res[name])}", flush=True)
                    break
    return res


def planned_memory(shape: List[str], micro_batch: int, ckpt: bool) -> Optional[dict]:
    """llama-plan model-info for the same shape, batch and checkpointing (JSON)."""
    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump({o.split("=")[0][6:]: int(o.split("=")[1]) for o in shape}, f)
    cmd = [str(BIN / "llama-plan"), "model-info", "--model", f.name, "--micro-batch",
           str(micro_batch), "--seq-len", "2048", "--json"]
    if ckpt:
        cmd.append("--activation-checkpointing")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}


def comm(work: Path, dry: bool) -> dict:
    """Step 5: NCCL bus bandwidth; with 2+ GPUs, 2 ranks ZeRO-2 == 1 rank, same global batch."""
    import torch

    n = torch.cuda.device_count() if not dry else 2
    res: dict = {}
    out = work / "allreduce.json"
    cmd = [str(BIN / "llama-bench"), "allreduce", "--device", "cuda", "--nprocs", str(n),
           "--json", str(out)]
    if dry:
        print(shlex.join(cmd))
    elif n >= 2 and run(cmd, work / "allreduce.log") == 0:
        res["allreduce"] = json.loads(out.read_text())
    elif n < 2:
        res["allreduce"] = "skipped: one GPU (no NCCL traffic to measure)"
    if n >= 2:
        common = ["deepspeed.zero_stage=2", "deepspeed.precision=bf16", "trainer.max_steps=10",
                  "trainer.global_batch=8"]
        one, two = work / "z2_1rank", work / "z2_2ranks"
        cmds = [tiny_cmd(one, *common, gpus=1), tiny_cmd(two, *common, gpus=2)]
        if dry:
            print("\n".join(shlex.join(c) for c in cmds))
        elif all(run(c, work / f"z2_{i}.log") == 0 for i, c in enumerate(cmds)):
            a, b = losses(one), losses(two)
            res["zero2_2ranks_vs_1rank_max_abs_diff"] = max(abs(a[k] - b[k]) for k in a)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="work dir and report (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="steps 1, 2 and 5 only (no 1B bench)")
    p.add_argument("--print-commands", action="store_true", help="list the commands, run none")
    args = p.parse_args(argv)
    dry = args.print_commands
    if not dry:
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: skipped: torch sees no CUDA device.")
            return
    if dry:
        work = Path(args.out or "WORK")
    else:
        work = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
        work.mkdir(parents=True, exist_ok=True)
    t0, report = time.time(), {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not dry:
        import torch

        report["device"] = {"name": torch.cuda.get_device_name(0),
                            "count": torch.cuda.device_count(), "torch": torch.__version__,
                            "cuda": torch.version.cuda}
    for key, step in (("tiny", lambda: check_tiny(work, dry)), ("sdpa", lambda: sdpa_backend(dry)),
                      ("one_b", None if args.quick else lambda: bench_1b(work, dry)),
                      ("comm", lambda: comm(work, dry))):
        if step is not None:
            print(f"== {key}", flush=True)
            report[key] = step()
    report["seconds"] = round(time.time() - t0, 1)
    if not dry:
        (work / "gpu_check.json").write_text(json.dumps(report, indent=1))
        print(f"report: {work / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
