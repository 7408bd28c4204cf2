"""``trainer.dry_run=true``: the one resolved plan a command would train, printed, then exit.
No process group and no data preparation. The plan is the run's own (plan.plan_job,
``scope="preview"``): a simulated rank's switches, a resume's kept global batch and
trainer.init_from's tokenizer are what it shows, said in the words the run logs; only the FP8
device is left to the launch (said so), as a dry run may be asked on another machine.

What it shows, each from the module that decides it at run time: the experiment's plan
(scaling), the model's shape and counts, the batch arithmetic (config.validate), ZeRO, precision
and offload (engine) and the DeepSpeed config it builds (deepspeed.extra merged), one rank's
peak memory from the planner (scaling.memory) against this machine's device, the data
(sources, weights, epochs when prepared) and attention masking, FLOPs (and why they differ from
an experiment's budget), steps and an estimated time.
"""

from __future__ import annotations

import json
from typing import Any, List, Optional

from llama_train.config import BatchPlan, Config
from llama_train.job.plan import plan_job
from llama_train.job.preflight import check_tokenizer_fits, setup_logging

GIB = 2 ** 30


def dry_run(cfg: Config) -> None:
    """trainer.dry_run=true: the plan this command would train, then exit. No process group and
    no data preparation (epochs only when the data is already prepared)."""
    from llama_train.data import DataError, find_prepared
    from llama_train.engine import (build_ds_config, compiled_ds_config, detect_runtime,
                                    resolve_precision)
    from llama_train.model import count_params, flops_per_token

    rt = detect_runtime(cfg.trainer.device, cfg.comm.simulate)
    setup_logging(rt.rank, rt.is_main)
    job = plan_job(cfg, rt, scope="preview")  # the run's plan; the FP8 device left to the launch
    cfg, experiment, plan, layout = job.cfg, job.experiment, job.batch, job.layout
    check_tokenizer_fits(cfg)  # a tokenizer that cannot feed the model: refused, not planned
    if not rt.is_main:
        return
    t, m, ds = cfg.trainer, cfg.model, cfg.deepspeed
    sp = layout.sequence_parallel
    n, fpt = count_params(m), flops_per_token(m, t.seq_len)
    tokens = t.max_steps * plan.tokens_per_step
    try:
        found, why = find_prepared(cfg.data, vocab_size=m.vocab_size), None
    except DataError as e:
        found, why = None, str(e)
    precision = resolve_precision(ds, rt.device_type)
    ds_config = build_ds_config(ds, cfg.optim, plan, rt.device_type, model_dim=m.dim)
    if t.compiles(rt.device_type)[0]:
        compiled_ds_config(ds_config)  # as the run gives DeepSpeed
    seconds, how = _estimate_step_seconds(m, plan, rt, precision)
    offload = [w for w, on in (("optimizer", ds.offload_optimizer), ("parameters", ds.offload_params))
               if on]
    lines = [
        "dry run (trainer.dry_run=true): the plan, nothing started",
        *([f"  experiment: {experiment.describe()}"] if experiment else []),
        *[f"  {note}" for note in job.notes],  # what the plan changed, as the run logs it
        *[f"  warning: {w}" for w in job.warnings],
        *[f"  {d}" for d in job.deferred],
        f"  model: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} kv), vocab "
        f"{m.vocab_size}, ffn {m.ffn_hidden_dim}, max_seq_len {m.max_seq_len}"
        f"{', activation checkpointing' if m.activation_checkpointing else ''}"
        f"{f', loss in chunks of {m.loss_chunk} tokens' if m.loss_chunk else ''}",
        f"  parameters: {n['total']:,} total, {n['non_embedding']:,} non-embedding",
        f"  batch: {plan.world_size} {'data-parallel ' if sp > 1 else ''}"
        f"rank(s) x micro {plan.micro_batch} x accum "
        f"{plan.grad_accum} = {plan.global_batch} sequences x {t.seq_len} tokens = "
        f"{plan.tokens_per_step:,} tokens/step",
        *([f"  sequence parallelism: {sp} ranks share each sequence "
           f"({t.seq_len // sp} tokens and {m.n_heads // sp}"
           f" of {m.n_heads} heads each in attention; DeepSpeed-Ulysses all-to-all), "
           f"{layout.world} ranks in all"] if sp > 1 else []),
        f"  engine: DeepSpeed ZeRO-{ds.zero_stage}, {precision} on {rt.device_type}, "
        f"{'offload of the ' + ' and '.join(offload) + ' to CPU' if offload else 'no offload'}",
        f"  DeepSpeed config{' (deepspeed.extra merged last)' if ds.extra else ''}: "
        f"{json.dumps(ds_config, sort_keys=True)}",
        *_memory_lines(cfg, m, plan, layout, rt, precision),
        *_data_lines(cfg, found, why, tokens),
        f"  attention: causal"
        f"{', stopped at document boundaries (trainer.document_mask=true)' if t.document_mask else ' over the whole packed window (trainer.document_mask=false)'}",
        f"  steps: {t.max_steps:,} (warmup {cfg.optim.warmup_steps}) = {tokens:,} tokens",
        *_flops_lines(fpt, tokens, experiment, m, t.seq_len),
        f"  estimated time: {seconds * t.max_steps / 60:.1f} min ({seconds:.3g} s/step; {how})",
        f"  output: {t.output_dir}",
    ]
    print("\n".join(lines), flush=True)


def print_job_config(overrides: List[str]) -> None:
    """``llama-train --cfg job``: the config this command trains with, as YAML: the run's plan
    (plan.plan_job, ``scope="preview"``) applied: the experiment's (model shape, steps, warmup,
    lr), a resume's kept global batch, trainer.init_from's tokenizer, a simulated rank's
    switches, each said in a comment as the run logs it; interpolations resolved (the
    output_dir an experiment names), secrets scrubbed. Hydra's own ``--cfg job`` printed the
    composed config before any of that (dim 128 and 150 steps where the run trained dim 64 for
    1027 steps)."""
    import yaml
    from hydra import compose, initialize_config_dir

    from llama_train.config import load_config, to_container
    from llama_train.engine import detect_runtime
    from llama_train.paths import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = load_config(compose("config", overrides=list(overrides)))
    rt = detect_runtime(cfg.trainer.device, cfg.comm.simulate)
    job = plan_job(cfg, rt, scope="preview")  # as the dry run plans it: the run's plan
    cfg, experiment = job.cfg, job.experiment
    head = "\n# ".join(
        ["# llama-train --cfg job: the config this command trains with"
         + (f" (experiment: {experiment.describe()})" if experiment else "")
         + "; interpolations resolved, secrets scrubbed",
         *job.notes, *[f"warning: {w}" for w in job.warnings], *job.deferred])
    print(head + "\n" + yaml.safe_dump(to_container(cfg), sort_keys=False), end="", flush=True)


def _memory_lines(cfg: Config, m, plan: BatchPlan, layout, rt, precision: str) -> List[str]:
    """One rank's peak from the planner, and whether it fits this machine's device (a GPU's
    memory; on CPU the host's, shared by the ranks of this node)."""
    from llama_train.job.simulation import planned

    # a real rank of this world: on CPU gloo's own copies count (None)
    peak = planned(cfg, m, plan, precision, layout, rt.device_type, gloo_copies=None)
    if "error" in peak:  # settings the planner does not model
        return [f"  memory per rank: not planned ({peak['error']})"]
    where = (f"{peak['device'] / GIB:.2f} GiB on the device + {peak['host'] / GIB:.2f} GiB host"
             if peak["host"] else f"{peak['total'] / GIB:.2f} GiB")
    line = f"  memory per rank (planner, peak in {peak['peak_phase']}): {where}"
    have, what, need = _device_memory(rt, peak)
    if have is None:
        return [line]
    verdict = "fits" if need <= have else "does NOT fit"
    return [line, f"    {verdict}: {need / GIB:.2f} GiB against {have / GIB:.2f} GiB ({what}); "
                  f"for another device: llama-plan model-info --gpu-mem GIB"]


def _device_memory(rt, peak: dict):
    """(bytes there are, what they are, bytes the plan needs of them)."""
    import torch

    if rt.device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(rt.local_rank)
        return props.total_memory, f"{props.name}, this rank's GPU", peak["device"]
    try:
        import psutil
    except ImportError:  # pragma: no cover - a dependency
        return None, None, None
    ranks = rt.local_world_size if not rt.simulated else 1
    return (psutil.virtual_memory().total, f"this host's memory, {ranks} rank(s) of this node",
            peak["total"] * ranks)


def _data_lines(cfg: Config, found, why: Optional[str], tokens: int) -> List[str]:
    """The sources and their weights; with the data prepared, how often each is read."""
    d = cfg.data
    if d.mixture:
        total = sum(e.weight for e in d.mixture)
        lines = [f"  data: a mixture of {len(d.mixture)} sources (data.mixture)"]
        per = {s["name"]: s for s in found.meta.get("sources", [])} if found is not None else {}
        for e in d.mixture:
            share = e.weight / total if total else 0.0
            read = ""
            if e.name in per:
                read = (f", {per[e.name]['train_tokens']:,} train tokens read "
                        f"{tokens * share / max(1, per[e.name]['train_tokens']):.3g} times")
            lines.append(f"    {e.name}: {e.source} (weight {e.weight:g}, {share:.1%} of the "
                         f"tokens{read})")
    else:
        lines = [f"  data: {d.source}" + (f" (first {d.max_documents:,} documents)"
                                          if d.max_documents else "")]
    if d.tokenizer:  # given, or trainer.init_from's (the plan sets it)
        lines.append(f"    tokenizer: {d.tokenizer} (data.tokenizer)")
    if found is None:
        return lines + [f"    epochs: unknown "
                        f"({why or 'not prepared yet: it would be prepared first'})"]
    if d.mixture:
        return lines
    train_tokens = found.meta["splits"]["train"]["tokens"]
    return lines + [f"    {tokens / max(1, train_tokens):.2f} epochs of the train split "
                    f"({train_tokens:,} tokens, {found.dir})"]


def _flops_lines(fpt: float, tokens: int, experiment: Any, m, seq_len: int) -> List[str]:
    """The run's training FLOPs, and (an experiment) why they are not its budget C = 6 N D."""
    lines = [f"  FLOPs: {fpt:.3g}/token x {tokens:.3g} tokens = {fpt * tokens:.3g}"]
    if experiment is None:
        return lines
    e = experiment
    attention = 12 * m.n_layers * m.dim * seq_len  # per token: scores and values, fwd + bwd
    matmul = (fpt - attention) / 6  # parameters in matmuls: the output layer in, the lookup out
    law_n = e.shape_params if e.shape_params is not None else e.n_params
    lines.append(
        f"    {fpt * tokens / e.flops:.3f}x the budget scaling.flops={e.flops:.3g}, which is "
        f"6 N D with N={law_n:.3g} ({e.count} params) and D={e.n_tokens:.3g}; the run counts "
        f"6 x {matmul:.3g} matmul params + attention's 12 x layers x dim x seq_len = "
        f"{attention:.3g} per token, over {tokens:.3g} tokens (whole steps)")
    return lines


def _estimate_step_seconds(m, plan: BatchPlan, rt, precision: str) -> tuple:
    """Seconds per optimizer step on this machine: timed forward+backward passes of the model
    (small models), else its FLOPs over a matmul peak at an assumed 40% MFU."""
    import time

    import torch

    from llama_train.engine.flops import peak_flops
    from llama_train.model import Transformer, count_params, flops_per_token

    if count_params(m)["total"] > 3e8:
        per_token = flops_per_token(m, plan.seq_len)
        peak = peak_flops(rt.device, precision)
        return (per_token * plan.tokens_per_step / rt.world_size / (0.4 * peak),
                f"FLOPs over this device's {peak:.3g} FLOP/s matmul peak at an assumed 40% MFU")
    model = Transformer(m, device=rt.device, seed=0)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    x = torch.randint(0, m.vocab_size, (plan.micro_batch, plan.seq_len), device=rt.device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        if rt.device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    micro = sorted(times[1:])[0]
    return (micro * plan.grad_accum,
            f"forward+backward of one micro-batch timed here x {plan.grad_accum} per step; the "
            f"optimizer and communication come on top")
