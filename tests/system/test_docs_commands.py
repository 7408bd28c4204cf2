"""Every command in README.md and docs/*.md runs as written (issue 28, item 3).

A command is a line of a code block (fenced, or indented by four spaces) that starts with one of
the commands a user types here (``llama-*``, ``deepspeed``, ``make``, ``launch/*.sh``, ``python``,
``tensorboard``...), after any ``VAR=value`` prefixes; a trailing ``\\`` joins lines. Each one is
in the table below, in the order the commands run, either

* ``Run``: run by ``bash`` in a scratch copy of the checkout (its code, configs and venv linked,
  everything it writes kept inside), as written, with tiny arguments appended (a 2-step tiny
  model, one benchmark round) and any input it names (a corpus, a tokenizer, a prompt file)
  made first; it must exit 0 (and print ``expect`` where given); or
* ``Needs``: what it needs that a CPU test cannot have, and why (a GPU, the network, a cluster,
  hours, or a template to fill in).

Rows run in table order, in one scratch directory: later rows read what earlier ones wrote (the
README's ``make train`` makes the ``outputs/llama-train`` that export, generate and plot read), so
a row selected alone with ``-k`` may miss its input.

A command added to the docs and not to the table, or a table entry no longer in the docs, fails
``test_every_command_is_in_the_table``: the table and the docs cannot drift apart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from helpers import BIN, REPO, TINY

pytestmark = pytest.mark.slow

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FIRST_WORDS = {"llama-train", "llama-plan", "llama-export", "llama-import", "llama-generate",
               "llama-eval", "llama-plot", "llama-bench", "llama-data", "deepspeed", "make",
               "bash", "python", "python3", ".venv/bin/python", ".venv/bin/pytest", "pytest",
               "tensorboard", "wandb", "sbatch", "export", "launch/multinode.sh",
               "launch/local_two_nodes.sh"}
NOT_COMMANDS = {"python", "yaml", "json", "text"}  # fenced blocks of these languages


# -- reading the docs ------------------------------------------------------------------------------

def _code_blocks(text: str) -> List[Tuple[str, List[str]]]:
    """(language, lines) of each fenced block and each indented block (four spaces after a blank
    line, outside fences)."""
    blocks: List[Tuple[str, List[str]]] = []
    fence: Optional[str] = None
    body: List[str] = []
    indented: List[str] = []
    prev_blank = True
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if fence is None:
                if indented:
                    blocks.append(("indented", indented))
                    indented = []
                fence, body = line.strip()[3:].strip() or "plain", []
            else:
                blocks.append((fence, body))
                fence = None
        elif fence is not None:
            body.append(line)
        elif line.startswith("    ") and (prev_blank or indented):
            indented.append(line[4:])
        elif not line.strip() and indented:
            indented.append("")
        elif indented:
            blocks.append(("indented", indented))
            indented = []
        prev_blank = not line.strip()
    if indented:
        blocks.append(("indented", indented))
    return blocks


def _normalise(line: str) -> str:
    line = re.sub(r"\s+#(?!!).*$", "", line.strip().removeprefix("$ "))
    return " ".join(line.split())


def doc_commands() -> List[Tuple[str, str]]:
    """(file, command) for every command of README.md and docs/*.md, comments stripped."""
    found = []
    for path in DOCS:
        for lang, lines in _code_blocks(path.read_text()):
            if lang in NOT_COMMANDS:
                continue
            for line in re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines():
                words = _normalise(line).split()
                i = 0
                while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
                    i += 1
                if i < len(words) and words[i] in FIRST_WORDS:
                    found.append((str(path.relative_to(REPO)), _normalise(line)))
    return found


# -- the table -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    append: str = ""  # tiny arguments after the command as written
    expect: str = ""  # printed somewhere in its output
    stdin: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    before: str = ""  # a command that makes an input it names (itself a documented one)
    timeout: float = 300
    check: Optional[Callable[[Path, str], None]] = None  # (scratch dir, output): more asserts


@dataclass(frozen=True)
class Needs:
    what: str  # a GPU | the network | a cluster | hours | a template
    why: str


# the tiny run of the tests (tests/helpers.py) for 2 steps, W&B off
T = " ".join([*TINY, "trainer.max_steps=2", "trainer.save_every=2"])
# a 2-step tiny run without fixing the model (the experiments and presets choose it)
STEPS = ("trainer.max_steps=2 trainer.save_every=2 trainer.seq_len=16 trainer.micro_batch=1 "
         "trainer.eval_every=1000 trainer.eval_sequences=2 data.max_documents=600 data.num_proc=1 "
         "sample.tokens=0 tracking.wandb.mode=disabled")
FIT = "--bootstrap 10 --bootstrap-a3 0 --top-k 4"  # llama-plan fit: fewer resamples and starts
def _two_nodes_ring(w: Path, out: str) -> None:
    """launch/local_two_nodes.sh: two no-ssh launchers (node ranks 0, 1), one rank each."""
    assert "COMM_WORKER OK world=2" in out
    assert "RANK 0/2 node=0/2" in out and "RANK 1/2 node=1/2" in out
    assert out.count("--no_ssh --node_rank") == 2


def _checkpoint_bench(w: Path, out: str) -> None:
    """One launch of 2 ranks: each save's blocked and durable seconds, the medians, the command,
    from real records."""
    r = json.loads((w / "bckpt2.json").read_text())
    run = r["runs"][0]
    assert run["mode"] == "async" and len(run["blocked_s"]) == 2  # steps 1 and 2; 3 is the end
    assert all(0 < b <= d for b, d in zip(run["blocked_s"], run["durable_s"]))
    assert r["summary"]["async"]["blocked_s_per_save"] == pytest.approx(sum(run["blocked_s"]) / 2)
    assert r["command"] in out and r["command"].startswith("llama-bench checkpoint --rounds 3")


def _startup_bench(w: Path, out: str) -> None:
    """Each variant's times, and the phases of ours adding up to its command -> step 1."""
    r = json.loads((w / "startup.json").read_text())
    assert "reproduce: llama-bench startup --nprocs 1" in out and r["command"] in out
    assert "llama-train model=tiny" in r["commands"]["1"]["ours"]
    res = r["results"]["1"]
    assert set(res) == {"floor", "ours"} and res["floor"]["over_floor_s"] == 0
    for x in res.values():
        assert 0 < x["to_step1_s"]["median"] <= x["to_exit_s"]["median"] and x["first_run_s"] > 0
        assert x["cpu_s"]["median"] > 0
    ours = r["phases"]["1"]["ours"]
    labels = [p["phase"] for p in ours]
    assert labels[0].startswith("launcher") and labels[-1] == "step 1 logged (metrics.jsonl)"
    assert {"import deepspeed", "deepspeed.initialize", "peak FLOPs (matmul timing)"} <= set(labels)
    assert not any("shm comm op" in lab for lab in labels)  # not loaded on CPU any more
    total = r["phases"]["1"]["ours (probe run total)"]["median"]
    assert sum(p["median_s"] for p in ours) == pytest.approx(total, abs=0.05)
    assert r["phases"]["1"]["floor"][-1]["phase"] == "step 1 (forward, backward, AdamW step)"


def _memory_bench_zero3(w: Path, out: str) -> None:
    """ZeRO-3 on 2 ranks, fp32: the counted optimizer state within 10% of the planner's."""
    from llama_train.scaling import model_memory

    r = json.loads((w / "mem.json").read_text())
    assert "reproduce: llama-bench memory" in out and "--precision fp32" in r["command"]
    (row,) = r["rows"]
    assert (row["config"], row["nprocs"], row["status"]) == ("3", 2, "ok")
    plan = model_memory("tiny", zero_stage=3, world_size=2, dtype="fp32")["optimizer_states"]
    assert row["counted_optimizer"] == pytest.approx(plan, rel=0.10), row
    assert row["counted"]["adam_moments"] == pytest.approx(8 * r["n_params"] / 2, rel=0.10)
    assert row["hwm_reset"] and row["peak_above_idle"] > 0 and row["idle_rss"] > 0
    assert set(row["phases"]) == {"build", "initialize", "step1", "step2"}


def _train_bench(w: Path, out: str) -> None:
    """The A/B report is consistent: ours and Hugging Face's from the same weights and batch."""
    import math

    from llama_train.records import read_metrics

    r = json.loads((w / "train_bench.json").read_text())
    assert "reproduce: llama-bench train --preset tiny" in out and r["command"] in out
    s = r["settings"]
    assert (s["rounds"], s["steps"], s["tokens_per_step"], s["precision"]) == (2, 3, 128, "fp32")
    fpt = r["flops_per_token"]
    assert fpt > 0 and len(r["peak_flops"]["model_shapes_per_round"]) == 2
    peak = r["peak_flops"]["value"]  # llama-train's own: the run logged MFU against it too
    assert r["peak_flops"]["kind"] == "measured" and r["ours"]["logged_peak_flops"] == [peak]
    for side in ("ours", "hf"):
        x = r[side]
        st = x["step_time_s"]
        assert len(st["per_round_median"]) == 2
        assert 0 < st["min"] <= st["median"] <= st["max"]
        assert x["tokens_per_s"] == pytest.approx(128 / st["median"])
        assert x["mfu"] == pytest.approx(fpt * x["tokens_per_s"] / peak)
        assert x["mfu"] > 0 and x["mfu_vs_model_shapes"] > 0
        assert 0 <= x["data_wait_share"] < 1  # the wait is part of the step
        assert math.isfinite(x["loss_step1"]) and x["mem_gb"] > 0
    q = r["ratio_ours_over_hf"]
    assert q["tokens_per_s"] == pytest.approx(r["ours"]["tokens_per_s"] / r["hf"]["tokens_per_s"])
    assert len(q["paired_per_round"]) == 2 and all(v > 0 for v in q["paired_per_round"])
    # same initial weights, same first batch: the two models start from the same loss
    assert r["loss_step1_abs_diff"] < 1e-3, (r["ours"]["loss_step1"], r["hf"]["loss_step1"])
    assert "AdamW" in r["hf"]["optimizer"]
    assert set(r["loader_alone_s_per_batch"]) == {"workers=0"}
    # the runs really ran the configured steps (per-round files kept in --work-dir)
    rows = read_metrics(w / "train_bench" / "ours-0" / "metrics.jsonl")
    assert [row.step for row in rows if "step_time_s" in row] == [1, 2, 3, 4]


def _sequence_parallel_bench(w: Path, out: str) -> None:
    """The all-to-alls a step ran are the ones the planner counts (calls and bytes), and the
    peak is near the plan."""
    m = re.search(r"all-to-all in the last step: (\d+) calls, ([\d.]+) MiB \(planned (\d+), "
                  r"([\d.]+) MiB\)", out)
    assert m, out
    assert m.group(1) == m.group(3) and m.group(2) == m.group(4), m.group(0)
    ratio = float(re.search(r"ZeRO-1\s+2 \|.* ([\d.]+)\s*$", out, re.M).group(1))
    assert 0.9 < ratio < 1.3, ratio


def _trained_the_saved_run(w: Path, out: str) -> None:
    """The README's rerun trained what ``make train`` saved (issue 53): its config.yaml is that
    run's but for trainer.output_dir, its run_info.json the same model and batch, its command
    the saved config's. It trained the package's config.yaml (dim 384, 150 steps), which
    shadowed the run's, and still printed "run complete"."""
    import yaml

    first, rerun = (w / "outputs" / d for d in ("llama-train", "rerun"))
    saved, used = (yaml.safe_load((d / "config.yaml").read_text()) for d in (first, rerun))
    assert used["trainer"].pop("output_dir") == "outputs/rerun"
    assert saved["trainer"].pop("output_dir") == "outputs/llama-train"
    assert used == saved
    a, b = (json.loads((d / "run_info.json").read_text()) for d in (first, rerun))
    same = ("params", "model_args", "tokens", "global_batch", "seq_len", "max_steps", "flops")
    assert {k: b[k] for k in same} == {k: a[k] for k in same}
    assert b["command"].startswith("llama-train --config-dir outputs/llama-train "
                                   "--config-name config "), b["command"]


GPU8 = Needs("a GPU", "8 GPUs (--num_gpus 8 with NCCL)")

USAGE = Needs("a template", "the usage line; the commands below fill it in")
SELF = Needs("hours", "runs tests of this suite (make test runs them all)")
SWEEP = Needs("hours", "a sweep directory: make scaling-demo's runs (~5.5 h on 2 cores); the "
              "same fits from a CSV run below")

TABLE: List[Tuple[str, object]] = [
    # ---- README.md
    ("make train", Run(f'ARGS="{T} trainer.output_dir=outputs/llama-train"',
                       expect="run complete")),
    ("make test", Needs("hours", "the suite itself (this test is part of it)")),
    ("deepspeed --num_gpus 8 --module llama_train.train model=llama3_8b deepspeed=zero3 "
     "data.source=/data/corpus/*.jsonl trainer.global_batch_tokens=4194304 trainer.seq_len=8192",
     Needs("a GPU", "8 GPUs and your corpus under /data/corpus")),
    ("llama-train --config-dir outputs/llama-train --config-name config "
     "trainer.output_dir=outputs/rerun", Run("trainer.max_steps=2", expect="run complete",
                                             check=_trained_the_saved_run)),
    ("llama-train data=mixture trainer.document_mask=true",
     Run(f"{T} data.mixture.1.source=corpus/*.jsonl trainer.output_dir=outputs/mixture",
         expect="run complete")),
    ("llama-plan compute-optimal --flops 1e21", Run(expect="Compute-optimal")),
    ("llama-plan inference-optimal --flops 1e21 --inference-tokens 2e12",
     Run(expect="Inference-optimal")),
    ("llama-train model=llama2_70b deepspeed.zero_stage=3 deepspeed.precision=bf16 "
     "comm.simulate_ranks=512 trainer.max_steps=2",
     Needs("hours", "building one rank of 70B draws all 6.9e10 initial values: 603 s on 2 CPU "
                    "cores (docs/benchmarks-scale.md); tests/job/test_simulate.py simulates 64 and "
                    "512 ranks of smaller models")),
    ("llama-train experiment=compute_optimal scaling.flops=3e12 trainer.dry_run=true",
     Run(expect="dry run")),
    ("llama-train experiment=compute_optimal scaling.flops=3e12 --cfg job",
     Run(expect="max_steps")),
    ("llama-train experiment=compute_optimal scaling.flops=3e12",
     Run(f"{STEPS} trainer.steps_this_run=2 trainer.output_dir=outputs/compute_optimal")),
    ("make scaling-demo", Needs("hours", "~5.5 h of training on 2 cores; each stage runs in "
                                         "tests/scaling/test_scaling_study.py")),
    ("llama-export outputs/llama-train/checkpoints out/hf_model", Run()),
    ('llama-generate outputs/llama-train --prompt "The" --max-new-tokens 64',
     Run("--max-new-tokens 4", expect="new tokens")),
    ("llama-eval outputs/llama-train --tasks hellaswag,arc_easy",
     Needs("the network", "lm-eval fetches hellaswag and arc_easy from the Hugging Face hub")),
    ("llama-plot outputs/llama-train", Run()),
    # ---- docs/architecture.md: only a diagram
    # ---- docs/benchmarks-allreduce.md
    ("llama-bench allreduce --nprocs 2", Run("--warmup 1 --iters 2 --max-bytes 4K",
                                             expect="busbw")),
    ("python -m llama_train.bench.allreduce --nprocs 2", Run("--warmup 1 --iters 2 --max-bytes 4K",
                                                             expect="busbw")),
    ("deepspeed --num_gpus 8 --module llama_train.bench.allreduce --max-bytes 1G --json bench.json",
     GPU8),
    ("deepspeed --num_gpus 8 --module llama_train.bench.allreduce --nccl-algo Ring", GPU8),
    ("deepspeed --hostfile hosts --module llama_train.bench.allreduce",
     Needs("a cluster", "the nodes of a hostfile reachable by ssh")),
    ("DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module llama_train.bench.allreduce --device cpu "
     "--backend auto --dtype float32 --warmup 10 --iters 40 --min-bytes 1K --factor 4",
     Run("--warmup 1 --iters 2 --max-bytes 4K", expect="busbw")),
    # ---- docs/benchmarks-checkpoint.md
    ("llama-bench checkpoint --rounds 3 --steps 10 --save-every 2 --workdir /tmp/bckpt2 "
     "--json /tmp/bckpt2.json",
     Run("--dim 64 --n-layers 2 --n-heads 4 --rounds 1 --steps 3 --save-every 1 --modes async "
         "--no-warmup --no-resume --override model.vocab_size=2048 --workdir bckpt2 "
         "--json bckpt2.json", check=_checkpoint_bench)),
    ("OMP_NUM_THREADS=1 llama-bench checkpoint --nprocs 1 --rounds 2 --steps 6 --save-every 2 "
     "--no-resume --workdir /tmp/bckpt3 --json /tmp/bckpt3.json",
     Run("--dim 64 --n-layers 2 --n-heads 2 --seq-len 64 --micro-batch 2 --rounds 1 --steps 2 "
         "--modes async --no-warmup --workdir bckpt3 --json bckpt3.json")),
    # ---- docs/benchmarks-data.md
    (".venv/bin/python -m llama_train.bench.data --json bench-data.json",
     Run("--vocab-size 512 --repeats 1 --scale 1 --loader-batches 4 --model-steps 1 --no-cold "
         "--cached-corpus")),
    # ---- docs/benchmarks-document-mask.md
    ("OMP_NUM_THREADS=1 llama-bench docmask", Run("--shapes 128:64 --docs 1,4 --rounds 1")),
    ("OMP_NUM_THREADS=1 llama-bench docmask --shapes 256:2048 --docs 1,16 --rounds 3",
     Run("--shapes 128:128 --rounds 1")),
    # ---- docs/benchmarks-memory.md
    # (llama-bench memory --from-json mem.json: after docs/benchmarks-train.md's run writes it)
    ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 8 --module llama_train.train "
     "model=small model.dim=1024 model.n_layers=20 model.n_heads=16 model.n_kv_heads=4 "
     "model.vocab_size=32000 model.multiple_of=256 deepspeed=zero3 deepspeed.zero_stage=3 "
     "deepspeed.precision=bf16 trainer.seq_len=64 trainer.micro_batch=1 trainer.max_steps=2 "
     "trainer.log_every=1 trainer.eval_every=1000 trainer.eval_sequences=8 "
     "trainer.save_every=1000 sample.tokens=8 tracking.wandb.mode=disabled data.num_proc=1 "
     "trainer.output_dir=/tmp/heap/big",
     Needs("hours", "8 CPU ranks of a 300M-parameter model: ~30 GB of host memory and minutes "
                    "per step on 2 cores; tests/bench/test_bench.py measures the same at tiny size")),
    # ---- docs/benchmarks-scale.md
    ("DS_ACCELERATOR=cpu llama-train model=llama3_8b deepspeed.zero_stage=3 "
     "deepspeed.precision=bf16 comm.simulate_ranks=64 trainer.seq_len=16 trainer.micro_batch=1 "
     "trainer.max_steps=2 trainer.save_every=2 trainer.eval_every=1000 data.max_documents=600 "
     "data.num_proc=1 data.tokenizer=tok128256.model trainer.output_dir=out-l3_8b_64_z3",
     Needs("a template", "tok128256.model is the built-in tokenizer padded to 128256 pieces "
                         "by a script the page describes; the same simulation at 512 ranks "
                         "(llama2_70b, README) runs above")),
    # ---- docs/benchmarks-startup.md
    ("llama-bench startup", Run("--nprocs 1 --rounds 1 --phase-rounds 1 --json startup.json",
                                check=_startup_bench)),
    ("llama-bench startup --baseline /tmp/wt_base --json startup.json",
     Needs("a template", "/tmp/wt_base: a second worktree to compare with (git worktree add); "
                         "llama-bench startup itself runs above")),
    ("llama-bench startup --baseline /tmp/wt_base --extensions fresh --rounds 2 --phase-rounds 0",
     Needs("hours", "JIT-builds DeepSpeed's CPU ops afresh for each of 2 checkouts (~2 min of "
                    "compilation each)")),
    ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 llama-train model=tiny data.max_documents=600 "
     "data.num_proc=1 trainer.seq_len=64 trainer.micro_batch=2 trainer.max_steps=6 "
     "trainer.log_every=1 trainer.eval_every=1000 trainer.eval_sequences=8 "
     "trainer.save_every=1000 sample.tokens=8 tracking.wandb.mode=disabled "
     "tracking.console=false deepspeed.precision=fp32 trainer.output_dir=<run dir>/out",
     Needs("a template", "<run dir>: what llama-bench startup runs, shown; it runs above")),
    ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 --master_port <free port> "
     "--module llama_train.train <the same overrides>",
     Needs("a template", "what llama-bench startup runs, shown; it runs above")),
    ("PYTHONPATH=/tmp/wt_after llama-bench startup --baseline /tmp/wt_before --json main.json",
     Needs("a template", "/tmp/wt_after and /tmp/wt_before: two worktrees to compare; the same "
                         "command with --baseline runs above")),
    ("PYTHONPATH=/tmp/wt_after llama-bench startup --baseline /tmp/wt_before --extensions fresh "
     "--rounds 2 --phase-rounds 0", Needs("a template", "two worktrees to compare; and see "
                                                        "--extensions fresh above")),
    # ---- docs/benchmarks-train.md
    ("llama-bench train --preset small --micro-batch 8 --seq-len 256 --steps 12 --warmup 3 "
     "--rounds 5 --threads 2 --device auto --precision auto --zero-stage 0 --interleave step",
     Run("--preset tiny --seq-len 64 --micro-batch 2 --steps 3 --warmup 1 --rounds 2 --threads 1 "
         "--device cpu --override data.max_documents=600 --override data.num_proc=1 "
         "--override data.num_workers=0 --json train_bench.json --work-dir train_bench",
         check=_train_bench)),
    ("llama-bench memory --preset tiny --stages 0,1,2,3 --nprocs 2 --micro-batch 2 --seq-len 64",
     Run("--stages 3 --precision fp32 --json mem.json", check=_memory_bench_zero3)),
    ("llama-bench memory --from-json mem.json", Run(expect="reproduce")),  # benchmarks-memory.md
    ("llama-bench memory --preset small --stages 0,1,2,3 --nprocs 2 --micro-batch 8 --seq-len 256",
     Run("--preset tiny --stages 1 --micro-batch 2 --seq-len 64 --steps 2")),
    # ---- docs/benchmarks.md
    ("bash launch/gpu_check.sh --out /tmp/gpu_check", Run("--out gpu_check", expect="skipped")),
    ("python -m llama_train.bench.gpu_check --print-commands", Run()),
    # docs/benchmarks-gpu.md and docs/performance.md: issue 55's FP8 and compile stages
    ("bash launch/gpu_check.sh --budget-s 1000 --only bench_vocab_8192_fp8_eager,"
     "bench_8b_layers_eager,bench_8b_layers_fp8_eager,bench_8b_layers_compiled,"
     "bench_8b_layers_fp8_compiled,fp8_loss_8b_layers",
     Needs("a GPU", "an H100/H200-class GPU (FP8 matmuls need sm_89+), ~15 minutes; without "
                    "one the check says it skipped (tests/bench/test_gpu_check.py)")),
    ("bash launch/gpu_bundle.sh", Needs("the network", "downloads wheels from the package index "
                                                     "into .whl/ (~17 s)")),
    # ---- docs/data.md
    ("llama-data prepare --vocab-size 8192", Run("--vocab-size 512 --max-documents 300")),
    ("llama-data prepare --source 'corpus/*.jsonl' --vocab-size 32000 --num-proc 8",
     Run("--vocab-size 512 --num-proc 1")),
    ("llama-data prepare --config configs/data/local_files.yaml --source /data/books "
     "--tokenizer tok.model", Run("--source books")),
    ("llama-data train-tokenizer --source builtin --vocab-size 8192 --out tok/llama8k",
     Run("--vocab-size 512 --max-documents 300")),
    ("llama-data info ~/.cache/llama_train/builtin-<hash> --verify",
     Needs("a template", "<hash>: the directory llama-data prepare printed; "
                         "tests/data/test_data_prepare.py runs llama-data info --verify")),
    (".venv/bin/pytest -q tests/data/test_data_prepare.py tests/data/test_data_loader.py "
     "tests/data/test_data_multiproc.py", SELF),
    ("PYTHONPATH=$PWD .venv/bin/python - <<'PY'",
     Needs("a template", "a benchmark's reproduction against an old worktree (writes 100 MB)")),
    # ---- docs/launch.md
    ("deepspeed --num_gpus 8 --module llama_train.train trainer.output_dir=outputs/run1 "
     "deepspeed.zero_stage=2", GPU8),
    ("DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module llama_train.train ...",
     Needs("a template", "...: your overrides; the same launch runs in tests/system/test_launcher_runs.py")),
    ("HOSTFILE=launch/hostfile launch/multinode.sh trainer.output_dir=/shared/runs/run1 "
     "deepspeed.zero_stage=2", Needs("a cluster", "the nodes of launch/hostfile, by ssh")),
    ("sbatch --nodes=4 launch/slurm.sbatch trainer.output_dir=/shared/runs/run1 "
     "deepspeed.zero_stage=2", Needs("a cluster", "SLURM")),
    ("DS_ACCELERATOR=cpu ENTRY=tests/workers/comm_worker.py launch/local_two_nodes.sh "
     "--expect-nodes 2 --expect-world 2", Run(check=_two_nodes_ring)),
    ("DS_ACCELERATOR=cpu launch/local_two_nodes.sh trainer.output_dir=/tmp/two_nodes "
     "deepspeed.zero_stage=2", Run(f"{T} trainer.output_dir=two_nodes")),
    ("deepspeed --hostfile /tmp/hosts --master_port $PORT --no_ssh --node_rank $r "
     "--master_addr 127.0.0.1 --module llama_train.train trainer.output_dir=/tmp/two_nodes "
     "deepspeed.zero_stage=2",
     Needs("a template", "$PORT and $r: what launch/local_two_nodes.sh runs per node, shown; "
                         "it runs above")),
    ("deepspeed --num_gpus 8 --module llama_train.bench.allreduce --nccl-algo Ring --max-bytes 1G",
     GPU8),
    ("llama-train model=llama2_70b deepspeed.zero_stage=3 deepspeed.precision=bf16 "
     "comm.simulate_ranks=512 trainer.max_steps=2 trainer.output_dir=/tmp/sim-70b",
     Needs("a template", "the README's simulation with an output directory; it runs above")),
    ("DS_ACCELERATOR=cpu llama-train model=small deepspeed=zero3 "
     "deepspeed.zeropp.hpz_partition_size=2 comm.simulate_ranks=4 trainer.seq_len=64 "
     "trainer.micro_batch=1 trainer.max_steps=2 trainer.save_every=2 "
     "trainer.output_dir=/tmp/sim-hpz",
     Run("data.max_documents=600 data.num_proc=1 trainer.eval_every=1000 "
         "trainer.eval_sequences=8 sample.tokens=0 tracking.wandb.mode=disabled "
         "trainer.output_dir=sim-hpz", expect="simulated rank 0 of 4")),
    ("DS_ACCELERATOR=cpu NPROC_PER_NODE=2 launch/local_two_nodes.sh trainer.output_dir=/tmp/hpz "
     "deepspeed=zero3 deepspeed.zeropp.hpz_partition_size=2",
     Run(f"{T} trainer.output_dir=hpz")),
    ("HOSTFILE=launch/hostfile launch/multinode.sh trainer.output_dir=/shared/runs/zpp "
     "deepspeed=zero3 deepspeed.zeropp.hpz_partition_size=8 "
     "deepspeed.zeropp.quantized_weights=true deepspeed.zeropp.quantized_gradients=true",
     Needs("a cluster", "GPU nodes of 8 (qwZ and qgZ run DeepSpeed's CUDA quantizer; qgZ acts "
                        "only across nodes); tests/engine/test_zeropp.py refuses them on CPU")),
    # ---- docs/long-context.md (its llama-export line: the README's, above)
    ("llama-plan model-info --model llama3_1_8b --zero-stage 3 --world-size 64 --seq-len 32768 "
     "--activation-checkpointing --sequence-parallel 8",
     Run(expect="8 ranks sharing each sequence")),
    ("llama-bench memory --dim 128 --n-layers 4 --n-heads 4 --n-kv-heads 2 --vocab 2048 "
     "--stages 1 --nprocs 2 --precision fp32 --seq-len 4096 --sequence-parallel 2",
     Run("--seq-len 256", expect="2 ranks sharing each sequence",
         check=_sequence_parallel_bench)),
    ("DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module llama_train.train "
     "trainer.init_from=out/hf_model model.rope_scaling.type=llama3 model.rope_scaling.factor=4 "
     "model.rope_scaling.original_max_position_embeddings=512 model.max_seq_len=2048 "
     "trainer.seq_len=2048 parallel.sequence=2 trainer.output_dir=outputs/long-context",
     # out/hf_model is the tiny model here (the README's make train above): its 256 tokens, x2
     Run(f"{STEPS} model=tiny model.rope_scaling.original_max_position_embeddings=256 "
         "model.max_seq_len=512 trainer.seq_len=512 deepspeed.precision=fp32",
         expect="run complete")),
    ("deepspeed --num_gpus 8 --module llama_train.train model=llama3_1_8b "
     "trainer.init_from=/models/llama3-8b-hf deepspeed=zero3 model.activation_checkpointing=true "
     "trainer.seq_len=32768 parallel.sequence=4", GPU8),
    # ---- docs/model.md (and its first llama-generate line: the README's, above)
    ("llama-generate out/hf_model --prompt-file prompt.txt --temperature 0",
     Run("--max-new-tokens 4", expect="new tokens")),
    ("llama-generate ckpt.pt --tokenizer tok.model --prompt A --prompt B --top-p 0.9",
     Run("--max-new-tokens 4", expect="new tokens",
         before="llama-import out/hf_model ckpt.pt")),
    ("llama-generate outputs/llama-train -i", Run("--max-new-tokens 4", stdin="The\nA\n",
                                                  expect="new tokens")),
    ("llama-eval outputs/llama-train --tasks hellaswag,arc_easy --num-fewshot 0 --output res.json",
     Needs("the network", "lm-eval fetches hellaswag and arc_easy from the Hugging Face hub")),
    ("llama-eval out/hf_model --tasks my_task --include-path ./my_tasks --limit 100 "
     "--batch-size 16", Run("--limit 4", expect="my_task")),
    # ---- docs/reliability.md
    ("python launch/fault_inject.py --trials 20 --nprocs 2 --workdir /tmp/drill -- <overrides>",
     Needs("a template", "<overrides>: your run's; the drill runs in tests/system/test_reliability.py")),
    ("export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1", Run()),
    ("export LLAMA_TRAIN_FAULTS='nan:batch=3;nan:batch=6;nan:batch=7;loss_scale:batch=9,"
     "factor=1000'", Run()),
    ("python launch/fault_inject.py --trials 20 --seed 7 --workdir /tmp/drill-z2 -- $T "
     "trainer.eval_every=1000 deepspeed.zero_stage=2 trainer.max_steps=24 trainer.save_every=2 "
     "trainer.keep_last=3 recovery.max_bad_steps=2 recovery.spike_factor=3 "
     "recovery.spike_warmup_steps=2",
     Needs("hours", "20 kills and resumes (~40 launches); tests/system/test_reliability.py runs the drill "
                    "with 3")),
    ('export LLAMA_TRAIN_FAULTS="$LLAMA_TRAIN_FAULTS;nan:batch=30"', Run()),
    ("python launch/fault_inject.py --trials 20 --seed 11 --workdir /tmp/drill-z0 -- $T "
     "trainer.eval_every=10 deepspeed.zero_stage=0 trainer.max_steps=48 trainer.save_every=3 "
     "trainer.keep_last=2 recovery.max_bad_steps=2 recovery.spike_factor=3 "
     "recovery.spike_warmup_steps=2",
     Needs("hours", "20 kills and resumes (~40 launches); tests/system/test_reliability.py runs the drill "
                    "with 3")),
    (".venv/bin/pytest tests/system/test_reliability.py -q", SELF),
    (".venv/bin/pytest tests/job/test_integrity.py -q", SELF),
    (".venv/bin/pytest tests/job/test_bad_inputs.py tests/checkpoint/test_checkpoint_holes.py "
     "tests/data/test_data_holes.py -q", SELF),
    (".venv/bin/pytest tests/system/test_launcher_runs.py -k killed_launcher -q", SELF),
    # ---- docs/scaling-fits.md
    ("llama-plan fit outputs/sweep --out isoflops.png", SWEEP),
    ("llama-plan fit outputs/sweep --csv runs.csv", SWEEP),
    ("llama-plan fit runs.csv --out isoflops.png --json", Run(FIT)),
    ("llama-plan fit runs.csv --params both", Run(FIT)),
    ("llama-plan fit runs.csv --bootstrap 1000 --bootstrap-a3 200 --seed 1", Run(FIT)),
    ("llama-plan fit outputs/sweep --save-fit configs/scaling/ours.yaml", SWEEP),
    ("llama-plan fit half.csv --out half.png", Run(FIT)),
    # ---- docs/scaling.md
    ("llama-plan compute-optimal --flops C [--fit chinchilla|sardana|epoch|<yaml>]",
     USAGE),
    ("llama-plan inference-optimal --inference-tokens D_inf (--flops C | --reference-params N "
     "[--reference-tokens D] | --loss L) [--fit ...]",
     USAGE),
    ("llama-plan model-info --model <preset|yaml> [--zero-stage S --world-size W --micro-batch B "
     "--seq-len T", USAGE),
    ("llama-plan shape --params N [--vocab V --max-seq-len T --count total|non_embedding "
     "--tie-embeddings]", USAGE),
    ("llama-plan fit <sweep_dir | runs.csv> [--out plot.png --save-fit fit.yaml --params "
     "auto|total|non_embedding|both", Needs("a template", "the usage line; docs/scaling-fits.md's "
                                                     "commands fill it in")),
    ("llama-plan compute-optimal --flops 1e21 --fit epoch", Run(expect="epoch")),
    ("llama-plan compute-optimal --flops 5.76e23 --fit sardana", Run(expect="sardana")),
    ("llama-plan inference-optimal --reference-params 13B --inference-tokens 2T",
     Run(expect="saves")),
    ("llama-plan inference-optimal --flops 1e22 --inference-tokens 1e13 --fit epoch",
     Run(expect="saves")),
    ("llama-plan model-info --model llama2_7b --zero-stage 2 --world-size 8 --micro-batch 4 "
     "--seq-len 4096", Run(expect="6,738,415,616")),
    ("llama-plan model-info --model llama2_7b --zero-stage 0 --world-size 8 --micro-batch 4 "
     "--seq-len 4096 --gpu-mem 80", Run(expect="does not fit")),
    ("llama-plan shape --params 2e7 --vocab 8192 --max-seq-len 512", Run(expect="n_layers")),
    ("llama-plan fit outputs/sweep --out docs/isoflops.png --save-fit configs/scaling/ours.yaml",
     SWEEP),
    ("llama-plan compute-optimal --flops 1e19 --fit configs/scaling/ours.yaml",
     Run(before=f"llama-plan fit runs.csv --save-fit configs/scaling/ours.yaml {FIT}")),
    ("llama-train experiment=compute_optimal trainer.dry_run=true", Run(expect="dry run")),
    # ---- docs/scale-out.md
    ("llama-plan model-info --model llama3_70b --zero-stage 3 --world-size 512 --seq-len 8192 "
     "--recommend", Run(expect="recommend: hpZ+qwZ+qgZ with activation checkpointing")),
    ("llama-plan model-info --model llama3_8b --zero-stage 3 --world-size 64 --seq-len 8192 "
     "--hpz-partition-size 8 --inter-node-gbps 200 --json", Run(expect="step_time_s")),
    ("llama-plan model-info --model llama3_8b --zero-stage 3 --world-size 64 --seq-len 8192 "
     "--recommend", Run(expect="recommend: ")),
    ("llama-plan model-info --model llama3_8b --zero-stage 3 --world-size 512 --seq-len 8192 "
     "--recommend", Run(expect="recommend: ")),
    ("llama-plan model-info --model llama3_8b --zero-stage 3 --world-size 1024 --seq-len 8192 "
     "--recommend", Run(expect="recommend: ")),
    ("llama-plan model-info --model llama3_70b --zero-stage 3 --world-size 64 --seq-len 8192 "
     "--recommend", Run(expect="recommend: ")),
    ("llama-plan model-info --model llama3_70b --zero-stage 3 --world-size 1024 --seq-len 8192 "
     "--recommend", Run(expect="recommend: ")),
    # ---- docs/tracking.md
    ("wandb sync /tmp/wbtest/ckpt_runs0/wandb/wandb/offline-run-20261123_130919-74lhsz4z "
     "/tmp/wbtest/ckpt_runs0/wandb/wandb/offline-run-20261123_130942-74lhsz4z",
     Needs("the network", "uploads offline runs to a W&B server")),
    ("tensorboard --logdir outputs/llama-train/tensorboard",
     Needs("a template", "a server that runs until stopped; the event files it reads are "
                         "checked in tests/metrics/test_tracking.py")),
    ("tensorboard --logdir outputs/", Needs("a template", "a server that runs until stopped")),
    ("tensorboard --logdir outputs/ --load_fast=false",
     Needs("a template", "a server that runs until stopped")),
]


def test_every_command_is_in_the_table():
    documented = {cmd for _, cmd in doc_commands()}
    listed = [cmd for cmd, _ in TABLE]
    missing = sorted(documented - set(listed))
    stale = sorted(set(listed) - documented)
    assert not missing, "commands in the docs without a row in TABLE (add one):\n" + \
        "\n".join(missing)
    assert not stale, "rows of TABLE no longer in the docs:\n" + "\n".join(stale)
    for cmd, how in TABLE:
        assert isinstance(how, (Run, Needs)), cmd
        if isinstance(how, Needs):
            assert how.what in ("a GPU", "the network", "a cluster", "hours", "a template"), how


# -- running them ----------------------------------------------------------------------------------

MY_TASK = ("task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
           "    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
           "doc_to_text: '{{{{q}}}}'\ndoc_to_choice: '{{{{choices}}}}'\n"
           "doc_to_target: '{{{{gold}}}}'\nmetric_list:\n  - metric: acc\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A scratch checkout: the repository's code, launch scripts, tests and venv linked, its
    configs copied (commands write fits into configs/scaling), and the inputs the docs name:
    corpus/*.jsonl, books/, tok.model, prompt.txt, runs.csv, half.csv, my_tasks/."""
    from helpers import tiny_prepared
    from llama_train.data import builtin_corpus

    w = tmp_path_factory.mktemp("docs_site")
    for name in (".venv", "launch", "llama_train", "tests", "Makefile", "pyproject.toml"):
        (w / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "configs", w / "configs")
    (w / "docs").mkdir()
    (w / "docs" / "data").symlink_to(REPO / "docs" / "data")
    texts = builtin_corpus()[:400]
    (w / "corpus").mkdir()
    (w / "corpus" / "part-0.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                      for t in texts))
    (w / "books").mkdir()
    for i, t in enumerate(texts[:200]):
        (w / "books" / f"{i:03d}.txt").write_text(t)
    _, prep = tiny_prepared()
    shutil.copyfile(prep.tokenizer_path, w / "tok.model")
    (w / "prompt.txt").write_text("The\n")
    shutil.copyfile(REPO / "docs" / "data" / "isoflop_runs.csv", w / "runs.csv")
    shutil.copyfile(REPO / "docs" / "data" / "isoflop_runs.csv", w / "half.csv")
    (w / "my_tasks").mkdir()
    rows = [{"q": "A loop over a sequence uses", "choices": [" for", " with"], "gold": 0},
            {"q": "A function is defined with", "choices": [" def", " class"], "gold": 0}] * 3
    data = w / "my_tasks" / "my_task.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (w / "my_tasks" / "my_task.yaml").write_text(MY_TASK.format(data=data))
    return w


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               WANDB_MODE="disabled", T=T)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LLAMA_TRAIN_FAULTS"):
        env.pop(k, None)
    return env


def _bash(cmd: str, cwd: Path, stdin: Optional[str], timeout: float) -> Tuple[int, str]:
    """Run ``cmd`` in its own process group; the group is killed whatever happens."""
    from llama_train.proc import kill_session

    proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        out = f"timed out after {timeout} s"
    finally:
        kill_session(proc)
    return proc.returncode, out


RUNS = [(cmd, how) for cmd, how in TABLE if isinstance(how, Run)]

# Rows of our console scripts that run forked from the warm parent (tests/warm_ranks.py: the
# script's own main() in a separate process that gets exactly the argv, environment and working
# directory bash would give it, without an interpreter's start-up). The first row of each script
# and every row with shell syntax, input on stdin or its own environment runs through bash.
# Leading ``VAR=value`` words are the command's environment, as bash gives it.
SHELL = set("|&;<>()$`*?[]{}~\\")
WARM_SCRIPTS = {"llama-train", "llama-plan", "llama-data", "llama-bench", "llama-export",
                "llama-import", "llama-generate", "llama-plot", "llama-eval"}


def _assignments(words: List[str]) -> Tuple[Dict[str, str], List[str]]:
    """A command's leading ``VAR=value`` words (bash's environment for it) and the rest."""
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        k, v = words[0].split("=", 1)
        env[k], words = v, words[1:]
    return env, words


def _warm_rows() -> set:
    seen, warm = set(), set()
    for cmd, how in RUNS:
        words = _assignments(cmd.split())[1]
        first = words[0] if words else ""
        if first not in WARM_SCRIPTS:
            continue
        if first not in seen:
            seen.add(first)  # the script's first row: through bash
            continue
        full = f"{cmd} {how.append}".strip()
        if not (SHELL & set(full)) and how.stdin is None and not how.env and not how.before:
            warm.add(cmd)
    return warm


WARM_ROWS = _warm_rows()


def _warm(cmd: str, cwd: Path, timeout: float) -> Optional[Tuple[int, str]]:
    """``cmd`` (a console script and its words, no shell syntax) forked from the warm parent in
    ``cwd`` with the environment bash would give it; None where the parent cannot run it."""
    import shlex

    from helpers import warm_server
    from llama_train.proc import kill_session

    server = warm_server()
    if server is None:
        return None
    assigned, argv = _assignments(shlex.split(cmd))
    argv[0] = shutil.which(argv[0], path=_env()["PATH"])
    log = cwd / ".warm-row.log"
    log.write_text("")
    job = server.start(argv, {**_env(), **assigned}, str(cwd), str(log))
    if job is None:
        return None
    try:
        rc = job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_session(job)
    out = log.read_text(errors="replace")
    return (rc if rc is not None else -1), (out if rc is not None else f"timed out after "
                                            f"{timeout} s\n{out}")


@pytest.mark.parametrize("cmd,how", RUNS, ids=[c[:60] for c, _ in RUNS])
def test_documented_command_runs(cmd, how, site):
    if cmd.startswith("export "):  # a shell setting for the lines after it: it must parse
        rc, out = _bash(f"{cmd} && env | grep -c =", site, None, 30)
        assert rc == 0, out
        return
    if how.before:
        rc, out = _bash(how.before, site, None, how.timeout)
        assert rc == 0, f"{how.before}\n{out[-3000:]}"
    full = f"{cmd} {how.append}".strip()
    ran = _warm(full, site, how.timeout) if cmd in WARM_ROWS else None
    rc, out = ran if ran is not None else _bash(full, site, how.stdin, how.timeout)
    assert rc == 0, f"exit {rc}: {full}\n{out[-4000:]}"
    assert how.expect in out, f"{full}\n{out[-4000:]}"
    if how.check:
        how.check(site, out)
