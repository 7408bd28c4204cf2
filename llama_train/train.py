"""``llama-train``: the Hydra app and the training loop, top to bottom.

build (config -> data -> process group -> model -> engine) -> resume -> loop {batch,
forward/backward, step, log, eval, checkpoint} -> final checkpoint and a text sample.

Works unchanged under the ``deepspeed`` launcher (its ``--local_rank=N`` is taken off argv before
Hydra parses it) and as a plain single process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from llama_train.config import Config, ConfigError, register_configs, to_container, validate
from llama_train.paths import CONFIG_DIR

log = logging.getLogger("llama_train")


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def apply_scaling(cfg: Config) -> None:
    """experiment=compute_optimal|inference_optimal: pick the model shape and the token budget."""
    s = cfg.scaling
    if s.mode == "none":
        return
    if s.flops is None or s.flops <= 0:
        raise ConfigError(f"scaling.mode={s.mode} needs scaling.flops > 0 (the training budget C).")
    from llama_train import scaling

    vocab = s.vocab_size or cfg.model.vocab_size
    if s.mode == "compute_optimal":
        plan = scaling.compute_optimal(s.flops, fit=s.fit)
    elif s.mode == "inference_optimal":
        if not s.inference_tokens or s.inference_tokens <= 0:
            raise ConfigError("scaling.mode=inference_optimal needs scaling.inference_tokens > 0.")
        plan = scaling.inference_optimal(s.flops, s.inference_tokens, fit=s.fit)
    else:  # fixed: a point of an IsoFLOP sweep
        if not s.params or s.params <= 0:
            raise ConfigError("scaling.mode=fixed needs scaling.params > 0.")
        plan = {"n_params": s.params, "n_tokens": s.flops / (6 * s.params)}
    args = scaling.shape_for_params(plan["n_params"], vocab_size=vocab,
                                    max_seq_len=max(cfg.trainer.seq_len, cfg.model.max_seq_len))
    for k, v in asdict(args).items():
        setattr(cfg.model, k, v)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_step = _global_batch(cfg, world) * cfg.trainer.seq_len
    cfg.trainer.max_steps = max(1, math.ceil(plan["n_tokens"] / tokens_per_step))
    cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, max(1, cfg.trainer.max_steps // 10))
    log.info("scaling %s: C=%.3g FLOPs -> N=%.3g params (%s), D=%.3g tokens, %d steps",
             s.mode, s.flops, plan["n_params"], args, plan["n_tokens"], cfg.trainer.max_steps)


def _global_batch(cfg: Config, world: int) -> int:
    t = cfg.trainer
    if t.global_batch_tokens:
        return t.global_batch_tokens // t.seq_len
    return t.global_batch or t.micro_batch * world


@dataclass
class Preflight:
    """Everything decided before a process group exists."""

    rt: Any
    model_args: Any
    plan: Any
    prepared: Any


def preflight(cfg: Config) -> Preflight:
    """Validate the config and prepare the data. Any error here is raised before the process
    group starts, naming the key and the fix."""
    from llama_train.data import check_compatible, prepare_data
    from llama_train.engine import detect_runtime
    from llama_train.model import ModelArgs

    rt = detect_runtime(cfg.trainer.device)
    _setup_logging(rt.rank)
    apply_scaling(cfg)
    model_args = cfg.model if isinstance(cfg.model, ModelArgs) else ModelArgs(**cfg.model)
    plan = validate(cfg, rt.world_size, rt.device_type)
    prepared = prepare_data(cfg.data, vocab_size=model_args.vocab_size)
    check_compatible(prepared.meta, model_args.vocab_size, cfg.trainer.seq_len)
    return Preflight(rt, model_args, plan, prepared)


def train(cfg: Config) -> Dict[str, Any]:
    """The whole job. Returns a summary (final step, losses) for callers such as tests."""
    pre = preflight(cfg)
    rt, model_args, plan, prepared = pre.rt, pre.model_args, pre.plan, pre.prepared
    t = cfg.trainer
    from llama_train.data import TrainLoader, val_batches
    from llama_train.model import Transformer, count_params, flops_per_token

    # ---- process group, model, engine ----------------------------------------------------------
    from llama_train import engine as eng
    from llama_train.checkpoint import CheckpointManager, prepare_universal, rng_state, set_rng_state
    from llama_train.optim import lr_at, param_groups
    from llama_train.tracking import Tracker

    eng.init_distributed(rt, cfg.comm)
    import torch.distributed as dist

    torch.manual_seed(t.seed)
    ckpts = CheckpointManager(t.output_dir, t.keep_last, t.verify_checksums, rt.rank,
                              rt.world_size)
    resume_from = ckpts.resolve_resume(t.resume)
    universal = False
    if resume_from is not None:
        from llama_train.checkpoint import read_state

        saved = read_state(resume_from)
        if saved["global_batch"] != plan.global_batch:
            raise ConfigError(
                f"checkpoint {resume_from} was trained with a global batch of "
                f"{saved['global_batch']} sequences, this run has {plan.global_batch}: keep the "
                f"global batch (trainer.global_batch) when resuming so the data order continues."
            )
        if saved["world_size"] != rt.world_size and saved["zero_stage"] > 0:
            prepare_universal(resume_from, rt.rank)
            universal = True

    model = Transformer(model_args)
    model.init_weights()
    if t.init_from and resume_from is None:
        load_initial_weights(model, model_args, t.init_from)
    if t.compile:
        for block in model.layers:
            block.compile()  # in place: parameter names stay those of the plain model
    ds_config = eng.build_ds_config(cfg.deepspeed, cfg.optim, plan, rt.device_type)
    if universal:
        ds_config["checkpoint"] = {"load_universal": True}
    engine = eng.initialize(model, param_groups(model, cfg.optim), ds_config, None)
    precision = eng.resolve_precision(cfg.deepspeed, rt.device_type)

    loader = TrainLoader(prepared.dir, seq_len=t.seq_len, global_batch=plan.global_batch,
                         micro_batch=plan.micro_batch, dp_rank=rt.rank, dp_world=rt.world_size,
                         seed=cfg.data.seed, num_workers=cfg.data.num_workers,
                         pin_memory=rt.device_type == "cuda")
    run_config = to_container(OmegaConf.structured(cfg))
    tracker = Tracker(cfg.tracking, t.output_dir, rt.rank, run_config)

    # ---- resume --------------------------------------------------------------------------------
    step, tokens, skipped_total, rollbacks = 0, 0, 0, 0
    skip_windows: List[List[int]] = []
    if resume_from is not None:
        state, rank_state = ckpts.load(engine, resume_from, universal)
        step, tokens = state["step"], state["tokens"]
        skipped_total, rollbacks = state.get("skipped_steps", 0), state.get("rollbacks", 0)
        skip_windows = state.get("skip_windows", [])
        loader.load_state_dict(state["data"])
        tracker.load_state_dict(state["tracker"])
        if rank_state and not universal:
            set_rng_state(rank_state["rng"])
        log.info("resumed from %s at step %d (%d tokens)", resume_from, step, tokens)
    tracker.start(resume_step=step if resume_from is not None else None)
    if resume_from is not None:
        tracker.event(step, "resume", checkpoint=str(resume_from))

    n_params = count_params(model_args)
    fpt = flops_per_token(model_args, t.seq_len)
    peak = eng.peak_flops(rt.device, precision) * rt.world_size
    if rt.is_main:
        Path(t.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(t.output_dir) / "config.yaml").write_text(OmegaConf.to_yaml(run_config))
        _write_run_info(t.output_dir, n_params, model_args, plan, t.max_steps, fpt,
                        flop_budget=cfg.scaling.flops if cfg.scaling.mode != "none" else None)
        log.info("model: %s params (%s non-embedding); %d ranks x micro %d x accum %d = global "
                 "batch %d x %d tokens; ZeRO-%d %s on %s; peak %.3g FLOP/s",
                 f"{n_params['total']:,}", f"{n_params['non_embedding']:,}", rt.world_size,
                 plan.micro_batch, plan.grad_accum, plan.global_batch, plan.seq_len,
                 cfg.deepspeed.zero_stage, precision, rt.device_type, peak)

    def save(at_step: int) -> None:
        t0 = time.perf_counter()
        path = ckpts.save(
            engine, at_step,
            trainer_state={
                "step": at_step, "tokens": tokens, "data": loader.state_dict(),
                "tracker": tracker.state_dict(), "world_size": rt.world_size,
                "zero_stage": cfg.deepspeed.zero_stage, "global_batch": plan.global_batch,
                "seq_len": t.seq_len, "skipped_steps": skipped_total, "rollbacks": rollbacks,
                "skip_windows": skip_windows,
                "scheduler": {"type": "warmup_cosine", "step": at_step, "lr": cfg.optim.lr,
                              "warmup_steps": cfg.optim.warmup_steps, "max_steps": t.max_steps,
                              "min_lr_ratio": cfg.optim.min_lr_ratio},
            },
            rank_state={"rng": rng_state(), "data": loader.state_dict()},
            describe={"config": run_config, "model_args": asdict(model_args),
                      "tokenizer": prepared.tokenizer_path},
        )
        tracker.event(at_step, "checkpoint", path=str(path),
                      seconds=round(time.perf_counter() - t0, 3))

    # SIGTERM/SIGINT: finish the current step, save, exit. All ranks agree through the per-step
    # all-reduce below, so a signal that reaches one rank stops them all at the same step.
    stop_signal: List[int] = []

    def _on_signal(signum, _frame):
        stop_signal.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)

    # ---- the loop ------------------------------------------------------------------------------
    data_iter = iter(loader)
    stage0 = cfg.deepspeed.zero_stage == 0
    bad_streak, loss_ema = 0, None
    last_saved = step if resume_from is not None else -1
    losses: Dict[int, float] = {}
    val_loss = None
    engine.train()
    first_step, run_done = step, False
    t_last = time.perf_counter()
    while step < t.max_steps:
        for window in skip_windows:  # data windows that caused a rollback are never re-read
            if loader.state_dict()["consumed_samples"] == window[0]:
                loader.load_state_dict({**loader.state_dict(), "consumed_samples": window[1]})
                data_iter = iter(loader)
        window_start = loader.state_dict()["consumed_samples"]
        if t.fail_at_step is not None and step + 1 == t.fail_at_step and rt.rank == 0:
            os._exit(17)  # fault injection for tests: a rank dies without warning
        t0 = time.perf_counter()
        lr = lr_at(step + 1, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps,
                   max_steps=t.max_steps, min_lr_ratio=cfg.optim.min_lr_ratio)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), dtype=torch.float64)
        for micro in range(plan.grad_accum):
            x, y = next(data_iter)
            x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
            _, loss = engine(x, y)
            if step + 1 in t.nan_at_steps:
                loss = loss * float("nan")  # fault injection: a non-finite loss
            engine.backward(loss)
            loss_sum += loss.detach().double().cpu()
            if micro < plan.grad_accum - 1:
                engine.step()
        # One small all-reduce per step: the loss, whether any rank saw a non-finite value, and
        # whether any rank was asked to stop.
        stats = torch.tensor([loss_sum.item(), 0.0 if torch.isfinite(loss_sum) else 1.0,
                              1.0 if stop_signal else 0.0], dtype=torch.float64)
        if not torch.isfinite(stats[0]):
            stats[0] = 0.0
        stats = stats.to(rt.device)
        dist.all_reduce(stats)
        stats = stats.cpu()
        nonfinite = stats[1].item() > 0
        step_loss = stats[0].item() / (plan.grad_accum * rt.world_size)
        grad_norm = None
        if stage0:  # ZeRO-0 has neither an overflow check nor a reported norm: do both here
            norms = [p.grad.detach().float().norm() for p in engine.module.parameters()
                     if p.grad is not None]
            grad_norm = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0
            nonfinite = nonfinite or not math.isfinite(grad_norm)
            if nonfinite:
                for p in engine.module.parameters():  # AdamW leaves grad-less params untouched
                    p.grad = None
        skipped_before = engine.skipped_steps
        engine.step()
        applied = not nonfinite and engine.skipped_steps == skipped_before
        step += 1
        tokens += plan.tokens_per_step
        if rt.device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0

        # ---- faults: skip non-finite steps, roll back after a streak or a spike ----------------
        spike = (applied and t.spike_factor > 0 and loss_ema is not None
                 and step > t.spike_warmup_steps and step_loss > t.spike_factor * loss_ema)
        if not applied or spike:
            skipped_total += 0 if spike else 1
            bad_streak += 1
            tracker.event(step, "spike" if spike else "skipped_step", loss=step_loss,
                          bad_streak=bad_streak)
            if spike or bad_streak >= t.max_bad_steps:
                if rollbacks >= t.max_rollbacks:
                    raise RuntimeError(
                        f"step {step}: {bad_streak} bad steps in a row after {rollbacks} "
                        f"rollbacks (trainer.max_rollbacks); stopping so nothing worse is saved."
                    )
                good = ckpts.resolve_resume("auto")
                if good is None:
                    raise RuntimeError(f"step {step}: rollback needed but no checkpoint exists.")
                skip_windows.append([_window_start_of_streak(window_start, bad_streak, plan),
                                     loader.state_dict()["consumed_samples"]])
                state, _ = ckpts.load(engine, good, universal=False)
                rollbacks += 1
                step, tokens = state["step"], state["tokens"]
                loader.load_state_dict(state["data"])
                data_iter = iter(loader)
                tracker.event(step, "rollback", checkpoint=str(good), rollbacks=rollbacks,
                              skip_window=skip_windows[-1])
                if rt.is_main:
                    tracker._truncate_after(step)
                bad_streak, last_saved = 0, step
                continue
        else:
            bad_streak = 0
            loss_ema = step_loss if loss_ema is None else 0.9 * loss_ema + 0.1 * step_loss
        losses[step] = step_loss

        # ---- log -------------------------------------------------------------------------------
        if step % t.log_every == 0 or step == t.max_steps or step == 1:
            if grad_norm is None:
                grad_norm = engine.get_global_grad_norm()
            tps = plan.tokens_per_step / dt
            metrics = {
                "loss": step_loss, "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": tokens, "tokens_per_s": tps, "mfu": fpt * tps / peak,
                "step_time_s": dt, "skipped_steps": skipped_total,
                **eng.memory_stats(rt.device),
            }
            tracker.log(step, metrics)
            if rt.is_main and cfg.tracking.console:
                elapsed = time.perf_counter() - t_last
                log.info("step %5d/%d | loss %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | "
                         "mfu %.1f%% | %.1fs", step, t.max_steps, step_loss, lr,
                         metrics["grad_norm"] or float("nan"), tps, 100 * metrics["mfu"], elapsed)
                t_last = time.perf_counter()

        # ---- eval ------------------------------------------------------------------------------
        if step % t.eval_every == 0 or step == t.max_steps:
            val_loss = evaluate(engine, prepared.dir, t, rt, val_batches)
            tracker.log(step, {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))})
            log.info("step %5d | val_loss %.4f | val_ppl %.2f", step, val_loss,
                     math.exp(min(val_loss, 50.0)))

        # ---- checkpoint ------------------------------------------------------------------------
        stopping = stats[2].item() > 0
        run_done = t.steps_this_run is not None and step - first_step >= t.steps_this_run
        if step % t.save_every == 0 or step == t.max_steps or stopping or run_done:
            save(step)
            last_saved = step
        if run_done and not stopping:
            log.info("trainer.steps_this_run=%d reached at step %d: checkpoint saved, exiting",
                     t.steps_this_run, step)
            break
        if stopping:
            log.warning("signal %s: saved step %d, exiting", stop_signal or "(other rank)", step)
            tracker.finish()
            _shutdown(loader)
            raise SystemExit(128 + (stop_signal[0] if stop_signal else signal.SIGTERM))

    if last_saved != step and not run_done:
        save(step)

    # ---- the end: a text sample ------------------------------------------------------------------
    sample = generate_sample(engine, cfg, prepared.tokenizer_path, rt)
    if rt.is_main:
        log.info("sample: %r", sample)
        (Path(t.output_dir) / "sample.txt").write_text(sample + "\n")
        _write_run_info(t.output_dir, n_params, model_args, plan, t.max_steps, fpt,
                        flop_budget=cfg.scaling.flops if cfg.scaling.mode != "none" else None,
                        final_val_loss=val_loss, final_step=step)
    tracker.finish()
    _shutdown(loader)
    return {"step": step, "losses": losses, "val_loss": val_loss, "sample": sample,
            "skipped_steps": skipped_total, "rollbacks": rollbacks}


def load_initial_weights(model, model_args, path: str) -> None:
    """trainer.init_from: weights from a Hugging Face Llama directory or a llama-import file."""
    from llama_train.hf import import_hf

    p = Path(path)
    if p.is_dir():
        args, sd = import_hf(p)
    else:
        blob = torch.load(p, map_location="cpu", weights_only=True)
        from llama_train.model import ModelArgs

        args, sd = ModelArgs(**blob["model_args"]), blob["model"]
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim"):
        if getattr(args, field) != getattr(model_args, field):
            raise ConfigError(
                f"trainer.init_from={path} has {field}={getattr(args, field)} but the model "
                f"config has {getattr(model_args, field)}: pick the matching model preset."
            )
    model.load_state_dict(sd, strict=True)
    log.info("initialised weights from %s", path)


def _window_start_of_streak(window_start: int, bad_streak: int, plan) -> int:
    """First global sample of the streak of bad steps that ends at the current step."""
    return window_start - (bad_streak - 1) * plan.global_batch


def evaluate(engine, prepared_dir, t, rt, val_batches) -> float:
    import torch.distributed as dist

    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in val_batches(prepared_dir, t.seq_len, t.micro_batch, t.eval_batches,
                                rt.rank, rt.world_size):
            _, loss = engine(x.to(rt.device), y.to(rt.device))
            total += torch.tensor([loss.double().item(), 1.0], dtype=torch.float64)
    total = total.to(rt.device)
    dist.all_reduce(total)
    engine.train()
    return (total[0] / total[1].clamp(min=1)).item()


def generate_sample(engine, cfg: Config, tokenizer_path: str, rt) -> str:
    from llama_train.data import Tokenizer
    from llama_train.engine import gathered_params, unwrap

    tok = Tokenizer(tokenizer_path)
    model = unwrap(engine)
    model.eval()
    prompt = tok.encode(cfg.trainer.sample_prompt, bos=False, eos=False)
    gen = torch.Generator(device=rt.device).manual_seed(cfg.trainer.seed)
    text = ""
    with gathered_params(engine, cfg.deepspeed.zero_stage):
        if rt.is_main or cfg.deepspeed.zero_stage == 3:
            out = model.generate(torch.tensor([prompt], device=rt.device),
                                 max_new_tokens=cfg.trainer.sample_tokens,
                                 temperature=cfg.trainer.sample_temperature,
                                 top_k=cfg.trainer.sample_top_k, eos_id=tok.eos_id, generator=gen)
            text = tok.decode(out[0].tolist())
    model.train()
    return text


def _write_run_info(output_dir, n_params, model_args, plan, max_steps, fpt, flop_budget=None,
                    **extra) -> None:
    info = {"params": n_params, "model_args": asdict(model_args), "flop_budget": flop_budget,
            "tokens": max_steps * plan.tokens_per_step, "global_batch": plan.global_batch,
            "seq_len": plan.seq_len, "max_steps": max_steps, "flops_per_token": fpt,
            "flops": fpt * max_steps * plan.tokens_per_step, **extra}
    path = Path(output_dir) / "run_info.json"
    path.write_text(json.dumps(info, indent=1))


def _shutdown(loader) -> None:
    import torch.distributed as dist

    close = getattr(loader, "close", None)
    if close:
        close()
    if dist.is_initialized():
        dist.barrier()  # the group itself is destroyed in main(), after every multirun job


# ------------------------------------------------------------------------------------------------
# Entry points


def _strip_launcher_args(argv: List[str]) -> List[str]:
    """The deepspeed launcher appends ``--local_rank=N``; Hydra would reject it."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
            continue
        if a in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip = True
            continue
        out.append(a)
    return out


register_configs()


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="config")
def _hydra_main(dcfg: DictConfig) -> Optional[float]:
    try:
        cfg = load_config(dcfg)
        result = train(cfg)
    except ValueError as e:  # ConfigError, DataError, ModelArgs checks: a message, not a trace
        log.error("%s: %s", type(e).__name__, e)
        print(f"llama-train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return result["val_loss"]


def _reject_unknown_keys(node: DictConfig, prefix: str) -> None:
    """Hydra's ``+key=value`` can force a key into a typed node; we still refuse it."""
    import dataclasses

    typ = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
    for key in node.keys():
        name = f"{prefix}{key}"
        if fields is not None and key not in fields and not str(key).startswith("_"):
            raise ConfigError(
                f"unknown config key {name!r}; valid keys here: {sorted(fields)}"
            )
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _reject_unknown_keys(child, f"{name}.")


def load_config(dcfg: DictConfig) -> Config:
    """DictConfig -> dataclasses; runs ModelArgs/DataConfig validation."""
    _reject_unknown_keys(dcfg, "")
    try:
        return OmegaConf.to_object(dcfg)
    except Exception as e:  # OmegaConf wraps __post_init__ errors; keep the message
        cause = e.__cause__ or e
        raise ConfigError(str(cause).split("\n    full_key")[0]) from None


def main() -> None:
    sys.argv = [sys.argv[0]] + _strip_launcher_args(sys.argv[1:])
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        _hydra_main()
    finally:
        # One process group serves all jobs of a --multirun sweep: DeepSpeed caches its groups,
        # so it cannot be torn down and rebuilt between jobs in the same process.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
