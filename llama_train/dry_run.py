"""``trainer.dry_run=true``: the plan a command would train, printed, then exit. No process
group and no data preparation."""

from __future__ import annotations

from llama_train.config import BatchPlan, Config, validate
from llama_train.preflight import setup_logging, plan_experiment

def dry_run(cfg: Config) -> None:
    """trainer.dry_run=true: the plan this command would train, then exit. No process group and
    no data preparation (epochs only when the data is already prepared)."""
    from llama_train.data import DataError, find_prepared
    from llama_train.engine import detect_runtime
    from llama_train.model import count_params, flops_per_token

    rt = detect_runtime(cfg.trainer.device, cfg.comm.simulate)
    setup_logging(rt.rank, rt.is_main)
    cfg, experiment = plan_experiment(cfg, rt.world_size)
    plan = validate(cfg, rt.world_size, rt.device_type)
    if not rt.is_main:
        return
    t, m = cfg.trainer, cfg.model
    n, fpt = count_params(m), flops_per_token(m, t.seq_len)
    tokens = t.max_steps * plan.tokens_per_step
    try:
        found = find_prepared(cfg.data, vocab_size=m.vocab_size)
    except DataError as e:
        found, why = None, str(e)
    else:
        why = "not prepared yet: it would be prepared first"
    if found is not None:
        train_tokens = found.meta["splits"]["train"]["tokens"]
        epochs = (f"{tokens / max(1, train_tokens):.2f} epochs of the train split "
                  f"({train_tokens:,} tokens, {found.dir})")
    else:
        epochs = f"unknown ({why})"
    seconds, how = _estimate_step_seconds(m, plan, rt, cfg.deepspeed)
    lines = [
        "dry run (trainer.dry_run=true): the plan, nothing started",
        *([f"  experiment: {experiment.describe()}"] if experiment else []),
        f"  model: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} kv), vocab "
        f"{m.vocab_size}, ffn {m.ffn_hidden_dim}",
        f"  parameters: {n['total']:,} total, {n['non_embedding']:,} non-embedding",
        f"  batch: {rt.world_size} rank(s) x micro {plan.micro_batch} x accum {plan.grad_accum} = "
        f"{plan.global_batch} sequences x {t.seq_len} tokens = {plan.tokens_per_step:,} "
        f"tokens/step",
        f"  steps: {t.max_steps:,} (warmup {cfg.optim.warmup_steps}) = {tokens:,} tokens; "
        f"{epochs}",
        f"  FLOPs: {fpt:.3g}/token x {tokens:.3g} tokens = {fpt * tokens:.3g}",
        f"  estimated time: {seconds * t.max_steps / 60:.1f} min ({seconds:.3g} s/step; {how})",
        f"  output: {t.output_dir}",
    ]
    print("\n".join(lines), flush=True)

def _estimate_step_seconds(m, plan: BatchPlan, rt, ds) -> tuple:
    """Seconds per optimizer step on this machine: timed forward+backward passes of the model
    (small models), else its FLOPs over a matmul peak at an assumed 40% MFU."""
    import time

    import torch

    from llama_train.engine import resolve_precision
    from llama_train.flops import peak_flops
    from llama_train.model import Transformer, count_params, flops_per_token

    precision = resolve_precision(ds, rt.device_type)
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
