"""``llama-train``: the Hydra app and the training loop, top to bottom.

build (config -> data -> process group -> model -> engine) -> resume -> loop {batch,
forward/backward, step, log, eval, checkpoint} -> final checkpoint and a text sample.

Works unchanged under the ``deepspeed`` launcher (its ``--local_rank=N`` is taken off argv before
Hydra parses it) and as a plain single process.

Faults (docs/reliability.md): a step with a non-finite loss or gradient is skipped (not applied);
``trainer.max_bad_steps`` of them in a row, a loss spike or a non-finite step that was applied
roll back to the newest checkpoint of this run and skip the data window that caused it. Exit
codes: 2 bad config or data, 3 checkpoint I/O, 4 the fault policy gave up, 5 a rank was lost.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from contextlib import contextmanager
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
    # 5%: below ~1M parameters the shape grid (dim 64, whole layers) is coarse
    args = scaling.shape_for_params(plan["n_params"], vocab_size=vocab,
                                    max_seq_len=max(cfg.trainer.seq_len, cfg.model.max_seq_len),
                                    tolerance=0.05)
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
    from llama_train.faults import FaultPlan

    FaultPlan.from_env()  # a malformed LLAMA_TRAIN_FAULTS fails here, not mid-run
    _check_writable(cfg.trainer.output_dir)
    prepared = prepare_data(cfg.data, vocab_size=model_args.vocab_size)
    check_compatible(prepared.meta, model_args.vocab_size, cfg.trainer.seq_len)
    _check_prepared_tokenizer(prepared)
    return Preflight(rt, model_args, plan, prepared)


def _check_writable(output_dir: str) -> None:
    """Every rank writes checkpoint shards: find a read-only or full output dir now, not at the
    first save hours later. Probes the checkpoint dir, or the nearest existing parent that would
    hold it, and leaves nothing behind."""
    d = Path(output_dir).absolute() / "checkpoints"
    while not d.exists() and d.parent != d:
        d = d.parent
    probe = d / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        if not d.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"trainer.output_dir={output_dir!r} is not writable: {e.strerror or e} "
            f"({e.filename or d}). Point trainer.output_dir at a writable directory with free "
            f"space, or fix its permissions or mount."
        ) from None


def _check_prepared_tokenizer(prepared) -> None:
    """The tokenizer file beside the shards must be the one meta.json says encoded them."""
    from llama_train.data import DataError
    from llama_train.data.tokenizer import file_sha256

    want = prepared.meta["tokenizer"].get("sha256")
    path = Path(prepared.tokenizer_path)
    if not path.is_file():
        raise DataError(f"{path} is missing: the prepared data in {prepared.dir} is incomplete; "
                        f"delete it and prepare again.")
    got = file_sha256(path)
    if want and got != want:
        raise DataError(
            f"{path} (sha256 {got[:12]}) is not the tokenizer that encoded the shards in "
            f"{prepared.dir} (meta.json: sha256 {want[:12]}): the directory mixes two "
            f"tokenizers. Delete it and prepare again, or restore its tokenizer.model."
        )


def train(cfg: Config) -> Dict[str, Any]:
    """The whole job. Returns a summary (final step, losses) for callers such as tests."""
    pre = preflight(cfg)
    rt, model_args, plan, prepared = pre.rt, pre.model_args, pre.plan, pre.prepared
    t = cfg.trainer
    from llama_train.data import TrainLoader, val_batches
    from llama_train.faults import FaultPlan
    from llama_train.model import Transformer, count_params, flops_per_token

    # ---- process group, model, engine ----------------------------------------------------------
    from llama_train import engine as eng
    from llama_train.checkpoint import CheckpointManager, prepare_universal, rng_state, set_rng_state
    from llama_train.optim import lr_at, param_groups
    from llama_train.tracking import Tracker

    faults = FaultPlan.from_env()
    eng.init_distributed(rt, cfg.comm)
    import torch.distributed as dist

    log.info("process group up: %d ranks over %s", rt.world_size, dist.get_backend())

    torch.manual_seed(t.seed)
    ckpts = CheckpointManager(t.output_dir, t.keep_last, t.verify_checksums, rt.rank,
                              rt.world_size)
    resume_from = ckpts.resolve_resume(t.resume)  # verified (sha256) before anything unpickles it
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
        _check_checkpoint_tokenizer(resume_from, prepared)
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
    guard = _FaultGuard()
    if resume_from is not None:
        state, rank_state = ckpts.load(engine, resume_from, universal)
        step, tokens = state["step"], state["tokens"]
        skipped_total, rollbacks = state.get("skipped_steps", 0), state.get("rollbacks", 0)
        skip_windows = state.get("skip_windows", [])
        guard.load_state_dict(state.get("fault", {}))
        loader.load_state_dict(state["data"])
        tracker.load_state_dict(state["tracker"])
        if rank_state and not universal:
            set_rng_state(rank_state["rng"])
        log.info("resumed from %s at step %d (%d tokens)", resume_from, step, tokens)
    tracker.start(resume_step=step if resume_from is not None else None,
                  checkpoint=str(resume_from) if resume_from is not None else None)
    if resume_from is not None:
        tracker.event(step, "resume", checkpoint=str(resume_from))

    n_params = count_params(model_args)
    fpt = flops_per_token(model_args, t.seq_len)
    peak = eng.PeakFlops(rt.device, precision, rt.world_size, t.peak_flops)
    if rt.is_main:
        Path(t.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(t.output_dir) / "config.yaml").write_text(OmegaConf.to_yaml(run_config))
        _write_run_info(t.output_dir, n_params, model_args, plan, t.max_steps, fpt,
                        flop_budget=cfg.scaling.flops if cfg.scaling.mode != "none" else None)
        log.info("model: %s params (%s non-embedding); %d ranks x micro %d x accum %d = global "
                 "batch %d x %d tokens; ZeRO-%d %s on %s; peak %.3g FLOP/s",
                 f"{n_params['total']:,}", f"{n_params['non_embedding']:,}", rt.world_size,
                 plan.micro_batch, plan.grad_accum, plan.global_batch, plan.seq_len,
                 cfg.deepspeed.zero_stage, precision, rt.device_type, peak.value)

    def save(at_step: int) -> Path:
        t0 = time.perf_counter()
        path = ckpts.save(
            engine, at_step,
            trainer_state={
                "step": at_step, "tokens": tokens, "data": loader.state_dict(),
                "tracker": tracker.state_dict(), "world_size": rt.world_size,
                "zero_stage": cfg.deepspeed.zero_stage, "global_batch": plan.global_batch,
                "seq_len": t.seq_len, "skipped_steps": skipped_total, "rollbacks": rollbacks,
                "skip_windows": skip_windows, "fault": guard.state_dict(),
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
        return path

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
    last_good = resume_from  # the checkpoint a rollback returns to: the newest of *this* history
    last_saved = step if resume_from is not None else -1
    losses: Dict[int, float] = {}
    val_loss = None
    engine.train()
    first_step, run_done = step, False
    t_last = time.perf_counter()
    while step < t.max_steps:
        _PROGRESS["step"] = step + 1
        window = _skip_bad_windows(loader, skip_windows)
        if window is not None:  # data that caused a rollback is never read again
            data_iter = iter(loader)
            tracker.event(step + 1, "data_skipped", window=window)
        window_start = loader.state_dict()["consumed_samples"]
        batch_no = window_start // plan.global_batch + 1  # this step's global batch in the stream
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
            _check_token_ids(x, y, model_args.vocab_size, prepared.dir, window_start)
            x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
            _, loss = engine(x, y)
            if batch_no in t.nan_at_steps:
                loss = loss * float("nan")  # fault injection: a batch with a non-finite loss
            if faults.loss_factor(batch_no) != 1.0:
                loss = loss * faults.loss_factor(batch_no)  # fault injection: a loss spike
            engine.backward(loss)
            loss_sum += loss.detach().double().cpu()
            if micro < plan.grad_accum - 1:
                engine.step()
        # One small all-reduce per step: the loss, whether any rank saw a non-finite value, and
        # whether any rank was asked to stop.
        finite = bool(torch.isfinite(loss_sum))
        stats = torch.tensor([loss_sum.item() if finite else 0.0, 0.0 if finite else 1.0,
                              1.0 if stop_signal else 0.0], dtype=torch.float64).to(rt.device)
        dist.all_reduce(stats)
        stats = stats.cpu()
        nonfinite = stats[1].item() > 0
        grad_norm = None
        if stage0:  # ZeRO-0 has neither an overflow check nor a reported norm: do both here
            norms = [p.grad.detach().float().norm() for p in engine.module.parameters()
                     if p.grad is not None]
            grad_norm = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0
            nonfinite = nonfinite or not math.isfinite(grad_norm)
        step_loss = (float("nan") if stats[1].item() > 0
                     else stats[0].item() / (plan.grad_accum * rt.world_size))
        skipped_before = engine.skipped_steps
        with _optimizer_step_skipped(engine, stage0 and nonfinite):
            engine.step()  # still called: it clears the gradients and keeps DeepSpeed's counters
        # ZeRO>=1: DeepSpeed skips a step whose gradient norm is not finite, and counts it.
        applied = (not nonfinite) if stage0 else engine.skipped_steps == skipped_before
        step += 1
        tokens += plan.tokens_per_step
        if rt.device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0

        # ---- faults: skip non-finite steps, roll back after a streak or a spike ----------------
        verdict = guard.judge(step, step_loss, applied, nonfinite, window_start, t)
        if verdict is not None:
            skipped_total += 0 if applied else 1
            tracker.event(step, verdict, step_loss=step_loss, bad_streak=guard.bad_streak,
                          batch=batch_no, skipped_steps=skipped_total)
            if guard.must_roll_back(verdict, t):
                bad_window = [guard.streak_start, loader.state_dict()["consumed_samples"]]
                if rollbacks >= t.max_rollbacks:
                    raise TrainingAborted(
                        f"step {step}: {verdict} after {rollbacks} rollbacks "
                        f"(trainer.max_rollbacks={t.max_rollbacks}); stopping so that nothing "
                        f"worse is saved. The newest good checkpoint is {last_good}; inspect the "
                        f"data window {bad_window} (global samples) or lower optim.lr."
                    )
                if last_good is None:
                    raise TrainingAborted(
                        f"step {step}: {verdict} needs a rollback but this run has no checkpoint "
                        f"yet; lower trainer.save_every (now {t.save_every}) or raise "
                        f"trainer.max_bad_steps (now {t.max_bad_steps})."
                    )
                bad_step = step
                skip_windows.append(bad_window)
                target = ckpts.resolve_resume(str(last_good))  # verify it again before loading
                state, rank_state = ckpts.load(engine, target,
                                               universal and target == resume_from)
                rollbacks += 1
                step, tokens = state["step"], state["tokens"]
                loader.load_state_dict(state["data"])
                data_iter = iter(loader)
                if rank_state and not (universal and target == resume_from):
                    set_rng_state(rank_state["rng"])
                guard.after_rollback(state.get("fault", {}))
                tracker.rewind(state["tracker"].get("metrics_lines"), step)
                tracker.event(bad_step, "rollback", to_step=step, checkpoint=str(target),
                              rollbacks=rollbacks, skip_window=bad_window, reason=verdict)
                losses = {k: v for k, v in losses.items() if k <= step}
                last_saved = step
                continue
        losses[step] = step_loss

        # ---- log -------------------------------------------------------------------------------
        if step % t.log_every == 0 or step == t.max_steps or step == 1 or verdict is not None:
            if grad_norm is None:
                grad_norm = engine.get_global_grad_norm()
            tps = plan.tokens_per_step / dt
            metrics = {
                "loss": step_loss, "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": tokens, "tokens_per_s": tps, "mfu": peak.mfu(fpt * tps),
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
            last_good = save(step)
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
        last_good = save(step)

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


# ------------------------------------------------------------------------------------------------
# Faults during training


class TrainingAborted(RuntimeError):
    """The fault policy gave up (too many rollbacks, nothing to roll back to)."""


_PROGRESS: Dict[str, Optional[int]] = {"step": None}  # for the lost-rank message


class _FaultGuard:
    """Decides, step by step, whether a step was bad and whether to roll back.

    A step is bad when it was not applied (non-finite loss or gradients: skipped), when it was
    applied although non-finite (``nonfinite_applied``: DeepSpeed missed it, the weights are
    suspect) or when its loss exceeds ``spike_factor`` x the running mean of good losses
    (``spike``). ``max_bad_steps`` bad steps in a row, a spike or a suspect step roll back. Its
    state travels in checkpoints so a resumed run decides exactly as the uninterrupted one.
    """

    def __init__(self):
        self.loss_ema: Optional[float] = None  # mean of good losses (decay 0.9)
        self.bad_streak = 0
        self.streak_start = 0  # global sample where the current streak of bad steps began

    def judge(self, step: int, loss: float, applied: bool, nonfinite: bool, window_start: int,
              t) -> Optional[str]:
        if not applied:
            verdict = "skipped_step"
        elif nonfinite:
            verdict = "nonfinite_applied"
        elif (t.spike_factor > 0 and self.loss_ema is not None and step > t.spike_warmup_steps
              and loss > t.spike_factor * self.loss_ema):
            verdict = "spike"
        else:
            self.bad_streak = 0
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
            return None
        if self.bad_streak == 0:
            self.streak_start = window_start
        self.bad_streak += 1
        return verdict

    def must_roll_back(self, verdict: str, t) -> bool:
        return verdict != "skipped_step" or self.bad_streak >= t.max_bad_steps

    def after_rollback(self, saved: Dict[str, Any]) -> None:
        self.loss_ema = saved.get("loss_ema")
        self.bad_streak, self.streak_start = 0, 0

    def state_dict(self) -> Dict[str, Any]:
        return {"loss_ema": self.loss_ema, "bad_streak": self.bad_streak,
                "streak_start": self.streak_start}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loss_ema = state.get("loss_ema")
        self.bad_streak = state.get("bad_streak", 0)
        self.streak_start = state.get("streak_start", 0)


@contextmanager
def _optimizer_step_skipped(engine, skip: bool):
    """ZeRO-0: make ``engine.step()`` leave weights and optimizer state alone (the optimizer's
    ``step`` is a no-op for the call), as DeepSpeed itself does for an overflow under ZeRO>=1."""
    if not skip:
        yield
        return
    opt = engine.optimizer
    opt.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
    try:
        yield
    finally:
        del opt.step


def _skip_bad_windows(loader, windows: List[List[int]]) -> Optional[List[int]]:
    """Move the loader past every recorded bad window it stands in; the [from, to) it jumped."""
    start = pos = loader.state_dict()["consumed_samples"]
    moved = True
    while moved:
        moved = False
        for lo, hi in windows:
            if lo <= pos < hi:
                pos, moved = hi, True
    if pos == start:
        return None
    loader.load_state_dict({**loader.state_dict(), "consumed_samples": pos})
    return [start, pos]


def _check_token_ids(x, y, vocab_size: int, prepared_dir: str, window_start: int) -> None:
    """Token ids outside the vocabulary (a shard changed on disk after prepare) would index
    past the embedding: refuse them before the forward pass."""
    lo, hi = int(x.min()), int(x.max())
    bad_y = bool(((y >= vocab_size) | ((y < 0) & (y != -100))).any())
    if lo < 0 or hi >= vocab_size or bad_y:
        from llama_train.data import DataError

        raise DataError(
            f"token ids outside [0, model.vocab_size={vocab_size}) in the global batch starting "
            f"at sample {window_start} of {prepared_dir} (min {lo}, max {hi}): the shards are "
            f"corrupt or from another tokenizer. Check them with data.verify=true, or delete "
            f"{prepared_dir} and prepare again."
        )


def _check_checkpoint_tokenizer(ckpt: Path, prepared) -> None:
    """A checkpoint resumed on data encoded by another tokenizer would train on garbage."""
    from llama_train.data import DataError
    from llama_train.data.tokenizer import file_sha256

    theirs = Path(ckpt) / "tokenizer.model"
    ours = prepared.meta["tokenizer"].get("sha256")
    if theirs.is_file() and ours and file_sha256(theirs) != ours:
        raise DataError(
            f"checkpoint {ckpt} was trained with a different tokenizer (sha256 "
            f"{file_sha256(theirs)[:12]}) than the data in {prepared.dir} (sha256 {ours[:12]}): "
            f"prepare the data with data.tokenizer={theirs}, or start a new trainer.output_dir."
        )


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


# Exit codes (docs/reliability.md): 2 bad config or data, 3 a checkpoint could not be saved or
# loaded, 4 the fault policy gave up, 5 another rank was lost. 17: trainer.fail_at_step.
EXIT_BAD_INPUT, EXIT_CHECKPOINT, EXIT_ABORTED, EXIT_LOST_RANK = 2, 3, 4, 5


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="config")
def _hydra_main(dcfg: DictConfig) -> Optional[float]:
    from llama_train.checkpoint import CheckpointError
    from llama_train.faults import find_comm_error

    try:
        cfg = load_config(dcfg)
        result = train(cfg)
    except ValueError as e:  # ConfigError, DataError, ModelArgs checks: a message, not a trace
        _fail(EXIT_BAD_INPUT, e)
    except (CheckpointError, TrainingAborted) as e:
        _fail(EXIT_CHECKPOINT if isinstance(e, CheckpointError) else EXIT_ABORTED, e)
    except Exception as e:
        import torch.distributed as dist

        comm = find_comm_error(e)
        if comm is None or not (dist.is_initialized() and dist.get_world_size() > 1):
            raise
        _exit_lost_rank(comm, cfg.comm.timeout_s)
    return result["val_loss"]


def _exit_lost_rank(comm: BaseException, timeout_s: float) -> None:
    """A collective failed: say which rank is gone (as far as the store can tell) and exit at
    once; the process group is broken and a clean shutdown could block on it."""
    import traceback

    import torch.distributed as dist

    from llama_train.faults import diagnose_lost_ranks

    # The launcher is tearing the job down: a DataLoader worker it terminates must not
    # interrupt the diagnosis through torch's SIGCHLD handler.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    rank, world, step = dist.get_rank(), dist.get_world_size(), _PROGRESS["step"]
    frames = traceback.extract_tb(comm.__traceback__)
    where = ([f for f in frames if "llama_train" in f.filename] or frames)[-1]
    log.error("rank %d: a collective failed (%s, %s:%d); checking which ranks are alive",
              rank, where.name, Path(where.filename).name, where.lineno)
    who = diagnose_lost_ranks(rank, world, wait_s=min(3.0, float(timeout_s)))
    first = str(comm).strip().splitlines()[0][:300] if str(comm).strip() else type(comm).__name__
    msg = (f"rank {rank} lost contact with the job{f' at step {step}' if step else ''}: {who}. "
           f"Collective error: {first}. Relaunch the job: it resumes from the last complete "
           f"checkpoint.")
    log.error(msg)
    print(f"llama-train: error: {msg}", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_LOST_RANK)


def _fail(code: int, e: BaseException) -> None:
    log.error("%s: %s", type(e).__name__, e)
    print(f"llama-train: error: {e}", file=sys.stderr)
    raise SystemExit(code) from None


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
