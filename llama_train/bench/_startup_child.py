"""Bench-only: the processes ``llama-bench startup`` times, each noting when it passes its
start-up phases. ``$LLAMA_BENCH_STARTUP_MODE`` picks what runs:

* ``probe``: ``llama_train.train.main`` unchanged, with functions along its start-up path wrapped
  from outside to note when they are entered and left (Hydra overrides on the command line).
* ``floor``: the least a torch job does before its first step: import torch, (with several ranks
  under a launcher) ``init_process_group("gloo")`` and ``DistributedDataParallel``, build the same
  model (``llama_train.model``, plain torch.nn; shape from ``$LLAMA_BENCH_STARTUP_SPEC``, JSON),
  torch's AdamW, one forward/backward/optimizer step on random tokens.

Once step 1 is done each rank writes ``{"rank", "process_start", "marks": [[label, unix time],
...]}`` to ``$LLAMA_BENCH_STARTUP_OUT.<rank>.json``. A mark's label names what ran since the mark
before it, so consecutive differences are the phases and add up to process start -> step 1.

``llama-bench startup`` copies this file beside the runs and puts it first on PYTHONPATH as a
top-level module, so the same probe also times another checkout (``--baseline``) whose
``llama_train`` does not have it. A function the probed code lacks is skipped (no mark).

One ordering differs from a plain run in probe mode: llama_train.train and llama_train.job.trainer
(torch, hydra, omegaconf, ...) are imported first, so that the imports are one phase; llama-train
imports the trainer inside the Hydra job, which only moves the same import earlier. Nothing in the
product code is changed for this.
"""

from __future__ import annotations

import time

_T0 = time.time()

import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

MODE_ENV, OUT_ENV, SPEC_ENV = ("LLAMA_BENCH_STARTUP_MODE", "LLAMA_BENCH_STARTUP_OUT",
                               "LLAMA_BENCH_STARTUP_SPEC")
MARKS: list = [["python start-up (interpreter, site)", _T0]]


def mark(label: str) -> None:
    MARKS.append([label, time.time()])


def process_start(pid: str = "self") -> float:
    """Unix time at which the kernel started this process, to a clock tick (10 ms): its age
    from /proc (start tick vs. uptime) taken from now. (psutil's create_time adds the boot time,
    which /proc/stat rounds to a whole second.)"""
    with open(f"/proc/{pid}/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def dump(rank: int) -> None:
    path = os.environ.get(OUT_ENV)
    if path:
        with open(f"{path}.{rank}.json", "w") as f:
            json.dump({"rank": rank, "process_start": process_start(), "marks": MARKS}, f)


def _wrap(owner, name: str, entered: str | None, left: str | None) -> None:
    """Mark ``entered`` when ``owner.name`` is first called and ``left`` when that call returns.
    The wrapper also replaces every other reference to the same function that a module of
    llama_train holds (a package that re-exports it, a module that imported it by name), so the
    marks do not depend on the path the caller takes to it."""
    fn = getattr(owner, name, None)
    if fn is None:
        return
    calls = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = not calls
        calls.append(1)
        if first and entered:
            mark(entered)
        out = fn(*args, **kwargs)
        if first and left:
            mark(left)
        return out

    setattr(owner, name, wrapper)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.split(".")[0] == "llama_train":
            for attr, value in list(getattr(mod, "__dict__", {}).items()):
                if value is fn:
                    setattr(mod, attr, wrapper)


# -- probe: llama-train ------------------------------------------------------------------------

def install_probe() -> None:
    """Import what llama-train imports and wrap its start-up functions."""
    import importlib

    import llama_train.train as train_mod
    try:  # an older checkout (--baseline) has the trainer at the top level
        trainer_mod = importlib.import_module("llama_train.job.trainer")
    except ImportError:
        trainer_mod = importlib.import_module("llama_train.job.trainer")
    mark("imports: llama_train.train, .trainer (torch, hydra, omegaconf, ...)")

    from llama_train import data, engine

    Trainer = trainer_mod.Trainer

    _wrap(train_mod, "load_config", "hydra: compose the config", "config: load_config checks")
    _wrap(train_mod, "preflight", "sweep/job set-up", "preflight: lock, tokenizer/epoch checks")
    _wrap(data, "prepare_data", "preflight: runtime, validate, output dir checks",
          "data: find and check the prepared data")
    # The process group's start, through the functions of llama_train/engine/distributed.py that
    # import DeepSpeed and start its comm backend. A checkout from before that module (engine.py)
    # gives its whole init_distributed as one phase after the entry mark.
    dist_mod = sys.modules.get("llama_train.engine.distributed")
    _wrap(engine, "init_distributed", "trainer: fault plan, hooks",
          "start-up barriers, shm buffer unlink, watchdog" if dist_mod is not None else
          "init_distributed, whole: DeepSpeed import, process group, watchdog")
    if dist_mod is not None:
        _wrap(dist_mod, "load_deepspeed", None, "import deepspeed")
        _wrap(dist_mod, "_start_process_group", "comm env",
              "process group: init_process_group (gloo), DeepSpeed comm backend")
    # the first torch.optim object imports torch._dynamo (1-2 s); here that is the fused-AdamW
    # check in build_ds_config, else it would be the model's meta-device init or the optimizer
    _wrap(engine, "build_ds_config", "resume point, run config",
          "build_ds_config (first torch.optim object: imports torch._dynamo)")
    _wrap(engine, "build_model", None, "build the model")
    _wrap(engine, "initialize", "param groups", "deepspeed.initialize")
    _wrap(engine, "PeakFlops", "data loader, tracker, recovery", "peak FLOPs (matmul timing)")
    _wrap(Trainer, "fit", "start-up log, config.yaml, run_info.json", None)
    _wrap(Trainer, "train_step", "resume, data iterator", "step 1 (train_step)")
    real_log = Trainer.log_step

    @functools.wraps(real_log)
    def log_step(self, *args, **kwargs):
        out = real_log(self, *args, **kwargs)
        if not getattr(log_step, "done", False):
            log_step.done = True
            mark("step 1 logged (metrics.jsonl)")
            dump(self.rt.rank)
        return out

    Trainer.log_step = log_step


def run_probe() -> None:
    install_probe()
    from llama_train.train import main as train_main

    sys.argv[0] = "llama-train"
    train_main()


# -- floor: a plain torch script ---------------------------------------------------------------

def run_floor() -> None:
    import torch

    mark("import torch")
    spec = json.loads(os.environ[SPEC_ENV])
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// from the launcher
        mark("init_process_group (gloo rendezvous)")
    from llama_train.model import ModelArgs, Transformer

    mark("import llama_train.model")
    model = Transformer(ModelArgs(**spec["model"]), seed=0)
    # its meta-device init (torch._refs) imports torch._dynamo, as AdamW would otherwise
    mark("build the model (meta-device init: imports torch._dynamo)")
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
        mark("DistributedDataParallel (parameter broadcast)")
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=True)
    except (RuntimeError, ValueError, TypeError):  # a torch without the fused CPU kernel
        opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    mark("torch.optim.AdamW")
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, spec["model"]["vocab_size"], (spec["micro_batch"], spec["seq_len"] + 1),
                      generator=g)
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    float(loss)
    mark("step 1 (forward, backward, AdamW step)")
    dump(rank)
    if world > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    mode = os.environ.get(MODE_ENV, "probe")
    if mode == "floor":
        run_floor()
    elif mode == "probe":
        run_probe()
    else:
        raise SystemExit(f"{MODE_ENV}={mode!r}: expected probe or floor")


if __name__ == "__main__":
    main()
