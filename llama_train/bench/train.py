"""``llama-bench train``: tokens/s of our training path side by side with a plain Hugging Face loop.

    llama-bench train                                   # CPU target: small, fp32, 8 x 256, 1 process
    llama-bench train --rounds 5 --steps 12 --json out.json
    llama-bench train --profile                         # top ops of one training step, then exit

A/B over ``--rounds`` pairs of runs. By default (``--interleave step``) the two runs of a round
live at once and their steps alternate under the bench's control (ours step 1, hf step 1, ours
step 2, ...), so that a burst of load from other jobs hits both sides alike; ``--interleave run``
runs one whole run after the other instead (A B A B ...).

* **ours**: the real entry point, ``llama_train.train.main()`` (Hydra config, DeepSpeed engine, the
  loop of ``llama-train``), in its own process. Per-step times come from its ``metrics.jsonl``.
  The process runs through this module's ``--ours-worker`` mode, which only wraps
  ``TrainLoader.__iter__`` to time each ``next(data_iter)`` (the loop does not expose it) and,
  in lock step, to wait for its turn there (that wait is subtracted from the step time);
* **hf**: ``transformers.LlamaForCausalLM`` of the same shape (``llama_train.hf.to_hf_config``) and
  the same initial weights, SDPA attention, in a plain PyTorch loop with AdamW (``fused=True`` where
  torch supports it), the same gradient clipping and lr schedule, fed by the same ``TrainLoader``
  (same batches: the step-1 losses of both must agree), same dtype and thread count.

Both report the median of per-step times after ``--warmup`` discarded steps. MFU uses one FLOPs
formula (``llama_train.model.flops_per_token``) and one matmul peak measured here before each
round, the way ``llama-train`` measures it (best of a square 1024^3 matmul; the max over rounds is
used, a low reading under load would inflate MFU); the achieved throughput of the
model's own matmul shapes (forward and both backward products) is reported beside it, because
skinny shapes such as 2048 x 384 x 1024 run below the square peak.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import select
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence
from llama_train.bench import report_or_exit
from llama_train.proc import kill_session

WAIT_FILE = "data_wait.json"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-bench train",
        description="Training tokens/s and MFU of llama-train's DeepSpeed path against a plain "
                    "Hugging Face transformers loop, interleaved A/B.")
    p.add_argument("--preset", default="small", help="model preset (configs/model/<name>.yaml)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="discarded steps at the start of each run")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (each: one run of both)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for both (default: all cores, os.cpu_count())")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--compile", action="store_true",
                   help="trainer.compile=true for ours and torch.compile of each HF decoder layer")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra llama-train override (repeatable), e.g. data.max_documents=600; "
                        "model.* overrides change both models")
    p.add_argument("--interleave", choices=("step", "run"), default="step",
                   help="step: both runs live at once, their steps alternate (ours, hf, ours, "
                        "...) so both meet the same load; run: one whole run after the other")
    p.add_argument("--only", choices=("ours", "hf"), default=None, help="run one side only")
    p.add_argument("--work-dir", default=None, help="run directories (default: a temp dir, removed)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH (or to stdout, without the table)")
    p.add_argument("--profile", type=int, nargs="?", const=25, default=None, metavar="N",
                   help="instead of the A/B: torch.profiler over 3 steps of each side, top N ops")
    # internal modes: the two sides' own processes
    p.add_argument("--ours-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("micro_batch", "seq_len", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"llama-bench train: --{name.replace('_', '-')}={getattr(args, name)} "
                             "must be >= 1")
    if args.warmup < 0:
        raise SystemExit(f"llama-bench train: --warmup={args.warmup} must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"llama-bench train: --threads={args.threads} must be >= 1")
    for ov in args.override:
        if "=" not in ov or ov.startswith("="):
            raise SystemExit(f"llama-bench train: --override {ov!r} must look like KEY=VALUE, "
                             "e.g. --override data.max_documents=600")
    args.threads = args.threads or os.cpu_count() or 1
    return args


def canonical_args(args: argparse.Namespace) -> List[str]:
    """The options that reproduce this run (printed with the report)."""
    out = ["--preset", args.preset, "--micro-batch", str(args.micro_batch), "--seq-len",
           str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--rounds", str(args.rounds), "--threads", str(args.threads), "--device", args.device,
           "--precision", args.precision, "--zero-stage", str(args.zero_stage)]
    if args.compile:
        out.append("--compile")
    out += ["--interleave", args.interleave]
    if args.only:
        out += ["--only", args.only]
    for ov in args.override:
        out += ["--override", ov]
    return out


def _device(args: argparse.Namespace) -> str:
    if args.device != "auto":
        return args.device
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _precision(args: argparse.Namespace, device: str) -> str:
    if args.precision != "auto":
        return args.precision
    return "bf16" if device == "cuda" else "fp32"


def train_overrides(args: argparse.Namespace, device: str, precision: str) -> List[str]:
    """Hydra overrides of the `ours` run (without trainer.output_dir)."""
    return [
        f"model={args.preset}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.micro_batch={args.micro_batch}",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.log_every=1",
        "trainer.eval_every=1000000000",
        "trainer.save_every=1000000000",
        "trainer.eval_batches=1",
        "trainer.sample_tokens=0",
        "trainer.resume=never",
        f"trainer.device={device}",
        f"trainer.compile={'true' if args.compile else 'false'}",
        f"deepspeed=zero{args.zero_stage}",
        f"deepspeed.precision={precision}",
        "tracking.wandb.mode=disabled",
        "tracking.console=false",
        *args.override,
    ]


def compose_config(overrides: List[str]):
    """The ``Config`` llama-train builds from these overrides (same Hydra composition).
    Raises SystemExit naming the bad option (--preset or an --override)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from llama_train.model import list_presets
    from llama_train.paths import CONFIG_DIR
    from llama_train.train import load_config  # registers the structured schema

    preset = next(o.split("=", 1)[1] for o in overrides if o.startswith("model="))
    if preset not in list_presets():
        raise SystemExit(f"llama-bench train: --preset {preset!r} is not a model preset: choose one "
                         f"of {', '.join(list_presets())}")
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            dcfg = compose("config", overrides=overrides)
        return load_config(dcfg)
    except (HydraException, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"llama-bench train: the llama-train config does not compose: {first} "
                         f"(check --override values; overrides: {' '.join(overrides)})") from None


# --------------------------------------------------------------------------------------------
# Peaks: the square matmul llama-train uses for MFU, and the model's own matmul mix
# --------------------------------------------------------------------------------------------


def linear_shapes(model_args) -> List[tuple]:
    """(in_features, out_features, count) of every matmul weight used per training step."""
    a = model_args
    d, qd, kvd, f = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim, a.ffn_hidden_dim
    L = a.n_layers
    return [(d, qd, L), (d, kvd, 2 * L), (qd, d, L), (d, f, 2 * L), (f, d, L), (d, a.vocab_size, 1)]


def model_matmul_flops(model_args, tokens: int, device, dtype, repeats: int = 3) -> float:
    """FLOP/s of the model's matmul mix for ``tokens`` rows: each linear's forward ``x W^T``
    and both backward products (``dy W`` and ``dy^T x``), best-of-``repeats`` per product,
    weighted by how often the step runs it. Excludes attention's QK^T/AV (done by SDPA)."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    total_flops, total_time = 0.0, 0.0
    for fin, fout, count in linear_shapes(model_args):
        x = torch.randn(tokens, fin, device=device, dtype=dtype)
        w = torch.randn(fout, fin, device=device, dtype=dtype)
        dy = torch.randn(tokens, fout, device=device, dtype=dtype)
        for fn in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x):
            best = float("inf")
            for _ in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t0)
            total_time += count * best
            total_flops += count * 2.0 * tokens * fin * fout
    return total_flops / total_time


def measure_peaks(model_args, tokens: int, device_name: str, precision: str, threads: int) -> dict:
    import torch

    from llama_train.engine import measure_matmul_flops

    torch.set_num_threads(threads)
    device = torch.device(device_name)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return {"square_1024": measure_matmul_flops(device, dtype, repeats=20),
            "model_shapes": model_matmul_flops(model_args, tokens, device, dtype, repeats=5)}


# --------------------------------------------------------------------------------------------
# Subprocesses
# --------------------------------------------------------------------------------------------


def _env(threads: int, device: str) -> Dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("WANDB_SILENT", "true")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


class Turns:
    """Lock-step turns between the bench and one worker, over two inherited pipes.

    The worker calls ``begin()`` before each training step (it blocks until the bench says go)
    and ``end()`` after it; the bench alternates go's between the two sides, so step k of `ours`
    and step k of `hf` run back to back and meet the same machine load. A no-op when the
    worker was not started in lock step (``LLAMA_BENCH_TURNS`` unset).
    """

    ENV = "LLAMA_BENCH_TURNS"

    def __init__(self) -> None:
        fds = os.environ.get(self.ENV)
        self.go, self.done = (int(f) for f in fds.split(",")) if fds else (None, None)
        self.started = False

    def begin(self) -> float:
        """Wait for our turn; seconds waited. The first call first reports start-up done."""
        if self.go is None:
            return 0.0
        if not self.started:
            self.started = True
            os.write(self.done, b"r")
        t0 = time.perf_counter()
        if not os.read(self.go, 1):
            raise SystemExit("llama-bench train: the bench went away")
        return time.perf_counter() - t0

    def end(self) -> None:
        if self.done is not None:
            os.write(self.done, b"d")


class Side:
    """One worker process started by the bench (its own session, killed with its children)."""

    def __init__(self, name: str, cmd: List[str], log: Path, env: Dict[str, str], lockstep: bool):
        self.name, self.cmd, self.log, self.alive = name, cmd, log, True
        self.t0 = time.perf_counter()
        self.go_w = self.done_r = None
        fds: tuple = ()
        if lockstep:
            go_r, self.go_w = os.pipe()
            self.done_r, done_w = os.pipe()
            env = {**env, Turns.ENV: f"{go_r},{done_w}"}
            fds = (go_r, done_w)
        self.fh = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.fh, stderr=subprocess.STDOUT,
                                     start_new_session=True, pass_fds=fds)
        for fd in fds:  # the child's ends: closed here so its exit reads as EOF
            os.close(fd)

    def turn(self, timeout: float, go: bool = True) -> None:
        """Let the worker run one step; returns when it says done or has exited. With
        ``go=False``: only wait for its start-up to finish (its first ``Turns.begin``)."""
        if not self.alive:
            return
        try:
            if go:
                os.write(self.go_w, b"g")
        except BrokenPipeError:
            self.alive = False
            return
        deadline = time.perf_counter() + timeout
        while True:
            ready, _, _ = select.select([self.done_r], [], [], 1.0)
            if ready:
                self.alive = os.read(self.done_r, 1) != b""  # EOF: finished (or died)
                return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name}: no step finished within {timeout:.0f}s "
                                   f"(--timeout): {shlex.join(self.cmd)}")

    def wait(self, timeout: float) -> float:
        """Wait for exit, raise with the log's tail unless it succeeded; wall seconds."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        self.kill()
        if rc != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
            why = f"timed out after {timeout:.0f}s (--timeout)" if rc is None else f"exit {rc}"
            raise RuntimeError(f"{self.name}: {why}: {shlex.join(self.cmd)}\n"
                               f"--- {self.log} (tail) ---\n{tail}")
        return time.perf_counter() - self.t0

    def kill(self) -> None:
        """Once: the process group goes (its pgid is never signalled again afterwards)."""
        if self.fh.closed:
            return
        kill_session(self.proc)
        for fd in (self.go_w, self.done_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.go_w = self.done_r = None
        self.fh.close()


def remove_ds_shm(addr: str, port: int, ranks: int) -> None:
    """Remove the /dev/shm files DeepSpeed's CPU all-reduce op leaves behind (~66 MB per rank,
    named ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``; it never unlinks them)."""
    for rank in range(ranks):
        try:
            os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}")
        except OSError:
            pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_cmd(overrides: List[str], out: Path) -> List[str]:
    return [sys.executable, "-m", "llama_train.bench.train", "--ours-worker", "--",
            *overrides, f"trainer.output_dir={out}"]


def hf_cmd(spec: dict, out: Path) -> List[str]:
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return [sys.executable, "-m", "llama_train.bench.train", "--hf-worker", str(spec_path)]


def read_ours(args, out: Path, wall: float) -> dict:
    """Per-step times of a `llama-train` run from its metrics.jsonl, warm-up steps dropped, the
    time spent waiting for the bench's go (lock step) taken out."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    by_step = {r["step"]: r for r in rows if "step_time_s" in r}
    total = args.warmup + args.steps
    missing = [s for s in range(1, total + 1) if s not in by_step]
    if missing:
        raise RuntimeError(f"{out}/metrics.jsonl lacks steps {missing}: was trainer.log_every "
                           "overridden? The bench needs every step logged.")
    waits_path = out / WAIT_FILE
    waits = json.loads(waits_path.read_text()) if waits_path.exists() else []
    if len(waits) < total:
        raise RuntimeError(f"{waits_path}: {len(waits)} timed batches for {total} steps "
                           "(llama_train.train no longer reads llama_train.data.TrainLoader?)")
    measured = range(args.warmup + 1, total + 1)
    return {
        "step_times": [by_step[s]["step_time_s"] - waits[s - 1]["turn"] for s in measured],
        "warmup_step_times": [by_step[s]["step_time_s"] - waits[s - 1]["turn"]
                              for s in range(1, args.warmup + 1)],
        "data_wait": [waits[s - 1]["data"] for s in measured],
        "losses": [by_step[s]["loss"] for s in range(1, total + 1)],
        "mem_gb": max(by_step[s].get("mem_gb", 0.0) for s in measured),
        "wall_s": wall,
    }


def read_hf(args, out: Path, wall: float) -> dict:
    res = json.loads((out / "result.json").read_text())
    w = args.warmup
    return {"step_times": res["step_times"][w:], "warmup_step_times": res["step_times"][:w],
            "data_wait": res["data_wait"][w:],
            "losses": res["losses"], "mem_gb": res["mem_gb"], "optimizer": res["optimizer"],
            "wall_s": wall}


def run_round(args, overrides: List[str], spec: dict, work: Path, r: int,
              env: Dict[str, str]) -> Dict[str, dict]:
    """One round: `ours` then `hf` (each a whole run), or both at once in lock step."""
    lockstep = args.interleave == "step" and args.only is None
    names = [n for n in ("ours", "hf") if args.only in (None, n)]
    outs = {n: work / f"{n}-{r}" for n in names}
    cmds = {"ours": lambda: ours_cmd(overrides, outs["ours"]), "hf": lambda: hf_cmd(spec, outs["hf"])}
    results: Dict[str, dict] = {}
    readers = {"ours": read_ours, "hf": read_hf}
    port = _free_port()  # ours' process group; known here so its shm file can be removed
    envs = {"ours": {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, "hf": env}
    if not lockstep:
        for n in names:
            side = Side(n, cmds[n](), work / f"{n}-{r}.log", envs[n], lockstep=False)
            try:
                results[n] = readers[n](args, outs[n], side.wait(args.timeout))
            finally:
                side.kill()
                remove_ds_shm("127.0.0.1", port, 1)
        return results
    sides: List[Side] = []
    try:
        for n in names:
            sides.append(Side(n, cmds[n](), work / f"{n}-{r}.log", envs[n], lockstep=True))
        for side in sides:  # both started up: nothing else of theirs runs during the steps
            side.turn(args.timeout, go=False)
        for _ in range(args.warmup + args.steps):
            for side in sides:
                side.turn(args.timeout)
        for side in sides:
            results[side.name] = readers[side.name](args, outs[side.name], side.wait(args.timeout))
    finally:
        for side in sides:
            side.kill()
        remove_ds_shm("127.0.0.1", port, 1)
    return results


# --------------------------------------------------------------------------------------------
# Worker: ours (llama-train itself, with the data wait timed)
# --------------------------------------------------------------------------------------------


def _ours_worker(overrides: List[str]) -> None:
    """``llama_train.train.main()`` with ``TrainLoader.__iter__`` wrapped: it takes its turn
    (lock step) and times each next(). train.py's step time includes both; the bench subtracts
    the turn wait."""
    import llama_train.data as data_pkg
    from llama_train.data.loader import TrainLoader

    waits: List[Dict[str, float]] = []
    turns = Turns()

    class TimedTrainLoader(TrainLoader):
        def __iter__(self):
            it = super().__iter__()
            while True:
                if waits:
                    turns.end()  # the previous step (and its logging) is over
                turn = turns.begin()
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                waits.append({"turn": turn, "data": time.perf_counter() - t0})
                yield batch

    data_pkg.TrainLoader = TimedTrainLoader  # what train.py imports from llama_train.data
    out_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir=")),
                   None)
    if out_dir:
        def dump() -> None:
            if int(os.environ.get("RANK", "0")) == 0 and Path(out_dir).is_dir():
                (Path(out_dir) / WAIT_FILE).write_text(json.dumps(waits))
        atexit.register(dump)
    from llama_train import train

    sys.argv = [sys.argv[0], *overrides]
    train.main()


# --------------------------------------------------------------------------------------------
# Worker: Hugging Face transformers in a plain loop
# --------------------------------------------------------------------------------------------


def build_hf_model(model_args, seed: int):
    """LlamaForCausalLM (SDPA) with the initial weights llama-train starts from for ``seed``."""
    import torch
    import transformers

    from llama_train.hf import to_hf_config, to_hf_state_dict
    from llama_train.model import Transformer

    torch.manual_seed(seed)  # what llama_train.train does before building the model
    ours = Transformer(model_args)
    ours.init_weights()
    cfg = transformers.LlamaConfig(**to_hf_config(model_args))
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                                       dtype=torch.float32)
    model.load_state_dict(to_hf_state_dict(ours.state_dict(), model_args),
                          strict=not model_args.tie_embeddings)
    return model


def make_adamw(model, lr: float, betas, eps: float, weight_decay: float):
    """AdamW, fused where this torch supports it for the parameters' device, else foreach.
    Same decay rule as llama_train.optim: matrices decay, embeddings/norms do not."""
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    try:
        opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=True)
        return opt, "AdamW(fused=True)"
    except (RuntimeError, ValueError) as e:  # fused not built for this device
        return (torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, foreach=True),
                f"AdamW(foreach=True) [fused unavailable: {str(e)[:80]}]")


def _hf_worker(spec_path: str) -> None:
    import contextlib

    import torch
    import torch.nn.functional as F

    from llama_train.data import TrainLoader
    from llama_train.model import ModelArgs
    from llama_train.optim import lr_at

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    margs = ModelArgs(**spec["model_args"])
    model = build_hf_model(margs, spec["seed"]).to(device).train()
    if spec["compile"]:
        for layer in model.model.layers:
            layer.compile()
    o = spec["optim"]
    opt, opt_kind = make_adamw(model, o["lr"], (o["beta1"], o["beta2"]), o["eps"],
                               o["weight_decay"])
    params = [p for p in model.parameters() if p.requires_grad]
    loader = TrainLoader(spec["prepared_dir"], seq_len=spec["seq_len"],
                         global_batch=spec["micro_batch"], micro_batch=spec["micro_batch"],
                         seed=spec["data_seed"], num_workers=spec["num_workers"],
                         pin_memory=device.type == "cuda")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if spec["precision"] == "bf16" else contextlib.nullcontext())
    total = spec["warmup"] + spec["steps"]
    step_times, waits, losses = [], [], []
    it = iter(loader)
    turns = Turns()
    for step in range(1, total + 1):
        turns.begin()
        t0 = time.perf_counter()
        lr = lr_at(step, lr=o["lr"], warmup_steps=o["warmup_steps"], max_steps=total,
                   min_lr_ratio=o["min_lr_ratio"])
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(it)
        waits.append(time.perf_counter() - t0)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if o["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, o["grad_clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a host sync per step, as in llama-train's loop
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        turns.end()
    close = getattr(loader, "close", None)
    if close:
        close()
    if device.type == "cuda":
        mem = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        import psutil

        mem = psutil.Process().memory_info().rss / 2**30
    result = {"step_times": step_times, "data_wait": waits, "losses": losses, "mem_gb": mem,
              "optimizer": opt_kind}
    (Path(spec_path).parent / "result.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------
# Loader on its own
# --------------------------------------------------------------------------------------------


def measure_loader(prepared_dir: str, seq_len: int, micro_batch: int, seed: int,
                   num_workers: int, batches: int = 20) -> Dict[str, float]:
    """Median seconds per micro-batch of back-to-back next() (no compute in between): the
    loader's cost when nothing hides it, for 0 workers and for the configured workers."""
    from llama_train.data import TrainLoader

    out = {}
    for workers in sorted({0, num_workers}):
        loader = TrainLoader(prepared_dir, seq_len=seq_len, global_batch=micro_batch,
                             micro_batch=micro_batch, seed=seed, num_workers=workers)
        it = iter(loader)
        next(it)  # start-up (worker spawn) is not a per-batch cost
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            next(it)
            times.append(time.perf_counter() - t0)
        close = getattr(loader, "close", None)
        if close:
            close()
        out[f"workers={workers}"] = statistics.median(times)
    return out


# --------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------


def profile(args: argparse.Namespace, top: int) -> str:
    """torch.profiler over 3 steps (after 3 warm-up steps) of our engine step and of the HF
    step on random tokens; returns the tables (top ops by self CPU time)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile as tprofile

    from llama_train import engine as eng
    from llama_train.config import resolve_batch
    from llama_train.model import Transformer
    from llama_train.optim import param_groups

    device_name = _device(args)
    precision = _precision(args, device_name)
    cfg = compose_config(train_overrides(args, device_name, precision) + ["trainer.output_dir=."])
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    rt = eng.detect_runtime(device_name)
    eng.init_distributed(rt, cfg.comm)
    margs = cfg.model
    torch.manual_seed(cfg.trainer.seed)
    model = Transformer(margs)
    plan = resolve_batch(cfg.trainer, 1)
    ds_config = eng.build_ds_config(cfg.deepspeed, cfg.optim, plan, rt.device_type)
    engine = eng.initialize(model, param_groups(model, cfg.optim), ds_config, None)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(rt.device)
    y = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(rt.device)

    def ours_step():
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss.item()

    hf = build_hf_model(margs, cfg.trainer.seed).to(rt.device).train()
    o = cfg.optim
    opt, _ = make_adamw(hf, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)

    def hf_step():
        logits = hf(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), o.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    text = []
    for name, fn in (("ours (DeepSpeed engine step)", ours_step), ("hf (plain loop)", hf_step)):
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
        wall = (time.perf_counter() - t0) / 3
        text.append(f"== {name}: {wall:.3f} s/step under the profiler, {args.micro_batch}x"
                    f"{args.seq_len}, {args.threads} threads, {precision}\n")
        text.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                              max_name_column_width=48))
    return "\n".join(text)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize_side(runs: List[dict], tokens_per_step: int, fpt: float, peaks: dict) -> dict:
    steps = [t for r in runs for t in r["step_times"]]
    med = statistics.median(steps)
    tps = tokens_per_step / med
    waits = [w for r in runs for w in (r.get("data_wait") or [])]
    side = {
        "step_time_s": {"median": med, "min": min(steps), "max": max(steps),
                        "per_round_median": [statistics.median(r["step_times"]) for r in runs]},
        "tokens_per_s": tps,
        "mfu": fpt * tps / peaks["square_1024"],
        "mfu_vs_model_shapes": fpt * tps / peaks["model_shapes"],
        "data_wait_s": _median(waits),
        "data_wait_share": (_median(waits) / med) if waits else None,
        "loss_step1": runs[0]["losses"][0],
        # step 1 pays one-off costs (allocations; with --compile the compilation itself)
        "step1_s_median": _median([r["warmup_step_times"][0] for r in runs
                                   if r["warmup_step_times"]]),
        "mem_gb": max(r["mem_gb"] for r in runs),
        "wall_s_per_run": _median([r["wall_s"] for r in runs]),
    }
    if "optimizer" in runs[0]:
        side["optimizer"] = runs[0]["optimizer"]
    return side


def build_report(args, device: str, precision: str, model_args, fpt: float, peaks_runs: List[dict],
                 ours: List[dict], hf: List[dict], loader: Dict[str, float], num_workers: int,
                 load: List[Sequence[float]]) -> dict:
    import torch

    tokens_per_step = args.micro_batch * args.seq_len
    peaks = {k: max(p[k] for p in peaks_runs) for k in peaks_runs[0]}
    report: Dict[str, Any] = {
        "bench": "train",
        "command": "llama-bench train " + shlex.join(canonical_args(args)),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "threads": args.threads, "device": device, "torch": torch.__version__,
                    "loadavg_start": list(load[0]), "loadavg_end": list(load[-1])},
        "settings": {"preset": args.preset, "micro_batch": args.micro_batch,
                     "seq_len": args.seq_len, "tokens_per_step": tokens_per_step,
                     "precision": precision, "zero_stage": args.zero_stage,
                     "compile": args.compile, "steps": args.steps, "warmup": args.warmup,
                     "rounds": args.rounds, "interleave": args.interleave,
                     "data_num_workers": num_workers,
                     "overrides": list(args.override)},
        "model_args": asdict(model_args),
        "flops_per_token": fpt,
        "peak_flops": {"square_1024_per_round": [p["square_1024"] for p in peaks_runs],
                       "model_shapes_per_round": [p["model_shapes"] for p in peaks_runs],
                       "square_1024": peaks["square_1024"], "model_shapes": peaks["model_shapes"],
                       "used_for_mfu": "square_1024 (max over rounds), as llama-train"},
        "loader_alone_s_per_batch": loader,
    }
    if ours:
        report["ours"] = summarize_side(ours, tokens_per_step, fpt, peaks)
    if hf:
        report["hf"] = summarize_side(hf, tokens_per_step, fpt, peaks)
    if ours and hf:
        paired = [statistics.median(h["step_times"]) / statistics.median(o["step_times"])
                  for o, h in zip(ours, hf)]
        report["ratio_ours_over_hf"] = {
            "tokens_per_s": report["ours"]["tokens_per_s"] / report["hf"]["tokens_per_s"],
            "paired_per_round": paired,
            "paired_median": statistics.median(paired),
        }
        report["loss_step1_abs_diff"] = abs(ours[0]["losses"][0] - hf[0]["losses"][0])
    return report


def format_table(r: dict) -> str:
    s = r["settings"]
    lines = [f"llama-bench train: {s['preset']}, {s['micro_batch']} x {s['seq_len']} tokens/step, "
             f"{s['precision']}, ZeRO-{s['zero_stage']}, {r['machine']['threads']} threads on "
             f"{r['machine']['device']}, {s['rounds']} rounds x {s['steps']} steps "
             f"(+{s['warmup']} warm-up), interleaved by {s['interleave']}, "
             f"compile={s['compile']}",
             f"FLOPs/token {r['flops_per_token']:.4g}; matmul peak: square 1024^3 "
             f"{r['peak_flops']['square_1024'] / 1e9:.1f} GFLOP/s, model shapes "
             f"{r['peak_flops']['model_shapes'] / 1e9:.1f} GFLOP/s",
             "",
             f"{'':6} {'step s (median)':>15} {'min':>7} {'tokens/s':>9} {'MFU':>6} "
             f"{'MFU/shapes':>10} {'data wait':>10} {'step1 s':>8} {'loss@1':>8} {'mem GB':>7}"
             "  optimizer"]
    for name in ("ours", "hf"):
        if name not in r:
            continue
        x = r[name]
        wait = (f"{100 * x['data_wait_share']:.2f}%" if x["data_wait_share"] is not None
                else "n/a")
        opt = x.get("optimizer", "DeepSpeed engine")
        lines.append(f"{name:6} {x['step_time_s']['median']:15.4f} {x['step_time_s']['min']:7.4f} "
                     f"{x['tokens_per_s']:9.0f} {100 * x['mfu']:5.1f}% "
                     f"{100 * x['mfu_vs_model_shapes']:9.1f}% {wait:>10} "
                     f"{x['step1_s_median'] or float('nan'):8.3f} {x['loss_step1']:8.4f} "
                     f"{x['mem_gb']:7.2f}  {opt}")
    if "ratio_ours_over_hf" in r:
        q = r["ratio_ours_over_hf"]
        lines += ["", f"ours / hf tokens/s: {q['tokens_per_s']:.3f} (pooled medians); paired per "
                      f"round {', '.join(f'{v:.3f}' for v in q['paired_per_round'])}; "
                      f"|loss@1 ours - hf| = {r['loss_step1_abs_diff']:.2e}"]
    lines.append("loader alone (back-to-back next(), s/batch): " + ", ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in r["loader_alone_s_per_batch"].items()))
    la = r["machine"]
    lines.append(f"load average start {la['loadavg_start'][0]:.2f}, end {la['loadavg_end'][0]:.2f}")
    lines.append(f"reproduce: {r['command']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace) -> dict:
    import torch

    from llama_train.config import validate
    from llama_train.data import check_compatible, prepare_data
    from llama_train.model import flops_per_token

    device = _device(args)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("llama-bench train: --device cuda but torch sees no CUDA device")
    precision = _precision(args, device)
    overrides = train_overrides(args, device, precision)
    cfg = compose_config(overrides + ["trainer.output_dir=."])
    margs = cfg.model
    try:  # llama-train's own checks, before any process starts
        validate(cfg, 1, device)
    except ValueError as e:
        raise SystemExit(f"llama-bench train: {e}") from None
    fpt = flops_per_token(margs, args.seq_len)
    prepared = prepare_data(cfg.data, vocab_size=margs.vocab_size)
    check_compatible(prepared.meta, margs.vocab_size, args.seq_len)
    spec = {"model_args": asdict(margs), "seed": cfg.trainer.seed, "device": device,
            "precision": precision, "threads": args.threads, "compile": args.compile,
            "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps,
            "warmup": args.warmup, "prepared_dir": prepared.dir, "data_seed": cfg.data.seed,
            "num_workers": cfg.data.num_workers,
            "optim": {k: getattr(cfg.optim, k) for k in ("lr", "beta1", "beta2", "eps",
                                                          "weight_decay", "grad_clip",
                                                          "warmup_steps", "min_lr_ratio")}}
    env = _env(args.threads, device)
    tmp = None
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="llama-bench-train-")
        work = Path(tmp.name)
    load = [os.getloadavg()]
    peaks, ours, hf = [], [], []
    try:
        for r in range(args.rounds):
            peaks.append(measure_peaks(margs, args.micro_batch * args.seq_len, device, precision,
                                       args.threads))
            res = run_round(args, overrides, spec, work, r, env)
            for name, runs in (("ours", ours), ("hf", hf)):
                if name in res:
                    runs.append(res[name])
            _progress(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {statistics.median(x['step_times']):.4f} s/step" for n, x in res.items()))
        torch.set_num_threads(args.threads)
        loader = measure_loader(prepared.dir, args.seq_len, args.micro_batch, cfg.data.seed,
                                cfg.data.num_workers)
    finally:
        if tmp is not None:
            tmp.cleanup()
    load.append(os.getloadavg())
    return build_report(args, device, precision, margs, fpt, peaks, ours, hf, loader,
                        cfg.data.num_workers, load)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)



def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--ours-worker":  # hydra overrides follow, untouched by argparse
        rest = argv[1:]
        _ours_worker(rest[1:] if rest[:1] == ["--"] else rest)
        return
    args = parse_args(argv)
    if args.hf_worker:
        _hf_worker(args.hf_worker)
        return
    if args.profile is not None:
        print(profile(args, args.profile))
        return
    report_or_exit("train", run_bench, args, format_table)


if __name__ == "__main__":
    main()
