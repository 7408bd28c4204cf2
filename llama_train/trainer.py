"""The training loop: build -> resume -> loop {batch, forward/backward, step, log, eval, save}.

:class:`Trainer` reads top to bottom: :meth:`Trainer.fit` is the loop, :meth:`Trainer.train_step`
one optimizer step. The pieces it calls are components with small interfaces: the DeepSpeed
boundary (:class:`llama_train.engine.Engine`), checkpoints (:class:`CheckpointManager`), the data
stream (:class:`TrainLoader`), tracking (:class:`Tracker`), recovery from bad steps
(:class:`Recovery`) and hooks (fault injection, benchmarks). Everything a checkpoint must carry
about the loop itself is one :class:`TrainState`.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llama_train import engine as eng
from llama_train import watchdog
from llama_train.checkpoint import (CheckpointManager, prepare_universal, read_state, rng_state,
                                    set_rng_state)
from llama_train.config import ConfigError, to_container
from llama_train.data import DataError, Tokenizer, TrainLoader, eval_sets
from llama_train.data.tokenizer import file_sha256
from llama_train.faults import FaultInjector
from llama_train.hooks import Hook
from llama_train.model import count_params, document_ids, flops_per_token
from llama_train.optim import lr_at, param_groups
from llama_train.recovery import Recovery
from llama_train.tracking import Tracker

log = logging.getLogger("llama_train")


@dataclass
class TrainState:
    """The loop's own progress; travels in every checkpoint (trainer_state.json)."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    rollbacks: int = 0
    skip_windows: List[List[int]] = field(default_factory=list)  # [from, to) global samples
    loss_ema: Optional[float] = None  # running mean of good losses (spike detection)
    bad_streak: int = 0
    streak_start: int = 0  # global sample where the current streak of bad steps began

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_steps,
                "rollbacks": self.rollbacks, "skip_windows": [list(w) for w in self.skip_windows],
                "fault": {"loss_ema": self.loss_ema, "bad_streak": self.bad_streak,
                          "streak_start": self.streak_start}}

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        fault = d.get("fault", {})
        self.step, self.tokens = d["step"], d["tokens"]
        self.skipped_steps, self.rollbacks = d.get("skipped_steps", 0), d.get("rollbacks", 0)
        self.skip_windows = [list(w) for w in d.get("skip_windows", [])]
        self.loss_ema = fault.get("loss_ema")
        self.bad_streak, self.streak_start = fault.get("bad_streak", 0), fault.get("streak_start", 0)


@dataclass
class StepOutput:
    loss: float
    lr: float
    result: eng.StepResult
    seconds: float
    data_wait_s: float
    verdict: Optional[str]
    stop_requested: bool
    window_end: int


class Interval:
    """Throughput over the log interval: training tokens over the wall time since the last
    logged step (evaluations and saves in between included, as anyone recomputing it from the
    records' ``time`` would), the median step time and the summed data wait of its steps. One
    step's figure is not the interval's: a 5-step interval of 1,024-token steps at 3.9 s read
    6,724 tok/s from its last step, ~1,300 in fact."""

    def __init__(self, tokens: int):
        self.reset(tokens)

    def reset(self, tokens: int) -> None:
        self.t0, self.tokens0 = time.perf_counter(), tokens
        self.step_s: List[float] = []
        self.wait_s = 0.0

    def add(self, out: "StepOutput") -> None:
        self.step_s.append(out.seconds)
        self.wait_s += out.data_wait_s

    def take(self, tokens: int) -> Dict[str, float]:
        wall = time.perf_counter() - self.t0
        figures = {"tokens_per_s": (tokens - self.tokens0) / wall,
                   "step_time_s": statistics.median(self.step_s), "data_wait_s": self.wait_s,
                   "interval_s": wall, "interval_steps": len(self.step_s)}
        self.reset(tokens)
        return figures


class StopSignals:
    """SIGTERM/SIGINT: remember them; the loop finishes the step, saves and exits. Every rank
    learns of a signal that reached any rank through the per-step all-reduce."""

    def __init__(self):
        self.received: List[int] = []
        self._before = {s: signal.signal(s, lambda signum, _frame: self.received.append(signum))
                        for s in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        """Give the signals back to whoever had them (an embedding program, a test runner)."""
        for s, handler in self._before.items():
            signal.signal(s, handler)

    def exit_code(self) -> int:
        return 128 + (self.received[0] if self.received else signal.SIGTERM)


class Trainer:
    def __init__(self, pre, hooks: Sequence[Hook] = ()):
        """Build: process group, resume point, model, engine, data, tracking. ``pre`` is the
        :class:`llama_train.train.Preflight` (config checked, data prepared)."""
        self.cfg, self.rt, self.plan, self.prepared = pre.cfg, pre.rt, pre.plan, pre.prepared
        self.command = getattr(pre, "command", None)  # for run_info.json
        self.model_args = pre.model_args
        cfg, t, rt = self.cfg, pre.cfg.trainer, pre.rt
        faults = FaultInjector.from_env(rt.rank)
        self.hooks: List[Hook] = [faults, *hooks]
        eng.init_distributed(cfg.comm, rt.device_type)
        log.info("process group up: %d ranks over %s", rt.world_size, dist.get_backend())
        torch.manual_seed(t.seed)
        self.ckpts = CheckpointManager(t.output_dir, t.keep_last, t.verify_checksums, rt.rank,
                                       rt.world_size, faults)
        run_files = (*(() if cfg.tracking.wandb.dir else ("wandb",)),  # default <output_dir>/wandb
                     *(() if cfg.tracking.tensorboard.dir else ("tensorboard",)))
        self.resume_from = self.ckpts.resolve_resume(  # verified before unpickling
            t.resume, t.on_existing, cfg.tracking.metrics_file, run_files)
        self.run_config = to_container(OmegaConf.structured(cfg))
        self.config_changes: Dict[str, List[Any]] = {}
        self.universal = self._check_resume_point()
        self.engine = self._build_engine()
        self.loader = TrainLoader(self.prepared.dir, seq_len=t.seq_len,
                                  global_batch=self.plan.global_batch,
                                  micro_batch=self.plan.micro_batch, dp_rank=rt.rank,
                                  dp_world=rt.world_size, seed=cfg.data.seed,
                                  num_workers=cfg.data.num_workers,
                                  pin_memory=rt.device_type == "cuda")
        self.tracker = Tracker(cfg.tracking, t.output_dir, rt.rank, self.run_config)
        self.state = TrainState()
        self.recovery = Recovery(cfg.recovery, self.state, self.tracker)
        self.fpt = flops_per_token(self.model_args, t.seq_len)
        precision = eng.resolve_precision(cfg.deepspeed, rt.device_type)
        self.peak = eng.PeakFlops(rt.device, precision, rt.world_size, t.peak_flops)
        self._said_mfu = False
        self.losses: Dict[int, float] = {}
        self.val_loss: Optional[float] = None
        # data.val_fraction=0: no validation split, so no evaluation (said once at start)
        self.has_val = self.prepared.meta["splits"].get("val", {}).get("tokens", 0) > 0
        self.eos_id = int(self.prepared.meta["tokenizer"]["eos_id"])  # documents end with it
        self.source_epochs = self.loader.mixture_epochs()  # data.mixture: noted as they change
        self._log_start(precision)

    def _check_resume_point(self) -> bool:
        """The checkpoint must continue this run: the same run-defining config (or changes the
        user allowed), global batch and tokenizer. True when it must be loaded through
        DeepSpeed's universal format (another world size). Every rank reads the same files and
        raises the same error, before anything is written."""
        if self.resume_from is None:
            return False
        saved = read_state(self.resume_from)
        self.config_changes = check_config_changes(
            self.resume_from, saved, self.run_config, self.plan.global_batch,
            self.prepared.meta["tokenizer"].get("sha256"), self.cfg.trainer.allow_config_change,
            say=self.rt.is_main)
        if saved["world_size"] != self.rt.world_size and saved["zero_stage"] > 0:
            prepare_universal(self.resume_from, self.rt.rank)
            return True
        return False

    def _build_engine(self) -> eng.Engine:
        t = self.cfg.trainer
        ds_config = eng.build_ds_config(self.cfg.deepspeed, self.cfg.optim, self.plan,
                                        self.rt.device_type, universal=self.universal,
                                        model_dim=self.model_args.dim)
        model = eng.build_model(self.model_args, ds_config, self.rt.device, t.seed)
        if t.init_from and self.resume_from is None:
            load_initial_weights(model, self.model_args, t.init_from, self.cfg.deepspeed.zero_stage)
        if t.compile:
            for block in model.layers:
                block.compile()  # in place: parameter names stay those of the plain model
        return eng.initialize(model, param_groups(model, self.cfg.optim), ds_config)

    def _log_start(self, precision: str) -> None:
        if not self.rt.is_main:
            return
        out, n = Path(self.cfg.trainer.output_dir), count_params(self.model_args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(self.run_config))
        self.write_run_info()
        p = self.plan
        log.info("model: %s params (%s non-embedding); %d ranks x micro %d x accum %d = global "
                 "batch %d x %d tokens; ZeRO-%d %s on %s; MFU against %.3g FLOP/s (%s), fixed "
                 "for the run", f"{n['total']:,}", f"{n['non_embedding']:,}",
                 self.rt.world_size, p.micro_batch, p.grad_accum, p.global_batch, p.seq_len,
                 self.cfg.deepspeed.zero_stage, precision, self.rt.device_type, self.peak.value,
                 self.peak.source)
        if not self.has_val:
            log.warning("data.val_fraction=%g: the data has no validation split, so there is no "
                        "evaluation (no val_loss)", self.cfg.data.val_fraction)

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> Dict[str, Any]:
        """The whole run; returns a summary (final step, losses) for callers such as tests."""
        t, s = self.cfg.trainer, self.state
        self.resume()
        stop = StopSignals()
        try:
            self.data_iter = iter(self.loader)
            self.last_good = self.resume_from  # a rollback returns here: the newest of this run
            last_saved = s.step if self.resume_from is not None else -1
            first_step, run_done = s.step, False
            self.engine.train()
            self.interval = Interval(s.tokens)
            while s.step < t.max_steps:
                for h in self.hooks:
                    h.on_step_begin(s.step + 1)
                watchdog.note(step=s.step + 1, phase="train")  # named if this rank stops
                out = self.train_step(stop)
                if self.recovery.must_roll_back(out.verdict):
                    self.recovery.roll_back(out.verdict, out.window_end, self.last_good,
                                            self._roll_back_to, t.save_every)
                    self.losses = {k: v for k, v in self.losses.items() if k <= s.step}
                    last_saved = s.step
                    self.interval.reset(s.tokens)
                    continue
                self.losses[s.step] = out.loss
                self.interval.add(out)
                metrics = self.log_step(out)
                self._note_source_epochs()
                if self.has_val and (s.step % t.eval_every == 0 or s.step == t.max_steps):
                    self.evaluate()
                run_done = (t.steps_this_run is not None
                            and s.step - first_step >= t.steps_this_run)
                if (s.step % t.save_every == 0 or s.step == t.max_steps or out.stop_requested
                        or run_done):
                    self.last_good, last_saved = self.save(), s.step
                for h in self.hooks:
                    h.on_step_end(s.step, metrics)
                if out.stop_requested:
                    log.warning("signal %s: saved step %d, exiting",
                                stop.received or "(other rank)", s.step)
                    self.close()
                    raise SystemExit(stop.exit_code())
                if run_done:
                    log.info("trainer.steps_this_run=%d reached at step %d: checkpoint saved, "
                             "exiting", t.steps_this_run, s.step)
                    break
            if last_saved != s.step and not run_done:
                self.last_good = self.save()
        except BaseException:
            self.loader.close()  # its workers ignore SIGTERM: stop them on every way out
            raise
        finally:
            stop.restore()
        sample = self.finish()
        return {"step": s.step, "losses": self.losses, "val_loss": self.val_loss,
                "sample": sample, "skipped_steps": s.skipped_steps, "rollbacks": s.rollbacks}

    def train_step(self, stop: Optional[StopSignals] = None) -> StepOutput:
        """One optimizer step over ``grad_accum`` micro-batches of this rank's slice of the
        next global batch."""
        s, p, cfg = self.state, self.plan, self.cfg
        skip_to = self.recovery.skip_bad_windows(self.loader.consumed_samples, s.step + 1)
        if skip_to is not None:  # data that caused a rollback is never read again
            self.loader.skip_samples(skip_to - self.loader.consumed_samples)
            self.data_iter = iter(self.loader)
        window_start = self.loader.consumed_samples
        batch_no = window_start // p.global_batch + 1  # this step's global batch in the stream
        t0 = time.perf_counter()
        lr = lr_at(s.step + 1, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps,
                   max_steps=cfg.trainer.max_steps, min_lr_ratio=cfg.optim.min_lr_ratio)
        self.engine.set_lr(lr)
        loss_sum = torch.zeros((), dtype=torch.float64)
        data_wait = 0.0
        for micro in range(p.grad_accum):
            t_data = time.perf_counter()
            x, y = next(self.data_iter)  # x, y: (micro_batch, seq_len) token ids
            data_wait += time.perf_counter() - t_data
            _check_token_ids(x, y, self.model_args.vocab_size, self.prepared.dir, window_start)
            x = x.to(self.rt.device, non_blocking=True)
            y = y.to(self.rt.device, non_blocking=True)
            _, loss = self.engine(x, y, **self._masking(x))
            for h in self.hooks:
                loss = h.on_loss(batch_no, loss)
            self.engine.backward(loss)
            loss_sum += loss.detach().double().cpu()
            if micro < p.grad_accum - 1:
                self.engine.micro_step()
        loss, nonfinite, stop_requested = self._all_ranks(loss_sum, stop)
        result = self.engine.step(nonfinite)
        s.step += 1
        s.tokens += p.tokens_per_step
        if self.rt.device_type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        verdict = self.recovery.judge(s.step, loss, result.applied, result.nonfinite,
                                      window_start, batch_no)
        return StepOutput(loss, lr, result, seconds, data_wait, verdict, stop_requested,
                          self.loader.consumed_samples)

    def _note_source_epochs(self) -> None:
        """data.mixture: a source that ran out starts its next epoch (its own reshuffle); say
        so, in the log and as a ``source_epoch`` event in the metrics."""
        now = self.loader.mixture_epochs()
        if now is None or now == self.source_epochs:
            return
        for name, epoch in now.items():
            if epoch > self.source_epochs.get(name, 0):
                if self.rt.is_main:
                    log.info("data.mixture: source %s was read through; it starts epoch %d at "
                             "step %d", name, epoch, self.state.step)
                self.tracker.event(self.state.step, "source_epoch", source=name, epoch=epoch)
        self.source_epochs = now

    def _masking(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """trainer.document_mask: the forward's ``doc_ids`` (B, T), documents ending at EOS."""
        if not self.cfg.trainer.document_mask:
            return {}
        return {"doc_ids": document_ids(x, self.eos_id)}

    def _all_ranks(self, loss_sum: torch.Tensor, stop: Optional[StopSignals]):
        """One small all-reduce per step: the mean loss (NaN if any rank saw a non-finite one),
        whether any rank did, and whether any rank was asked to stop."""
        finite = bool(torch.isfinite(loss_sum))
        stats = torch.tensor([loss_sum.item() if finite else 0.0, 0.0 if finite else 1.0,
                              1.0 if stop is not None and stop.received else 0.0],
                             dtype=torch.float64).to(self.rt.device)
        dist.all_reduce(stats)
        total, bad, stopping = stats.cpu().tolist()
        n = self.plan.grad_accum * self.rt.world_size
        return (float("nan") if bad > 0 else total / n), bad > 0, stopping > 0

    # -- around the step -----------------------------------------------------------------------
    def log_step(self, out: StepOutput) -> Dict[str, Any]:
        t, s = self.cfg.trainer, self.state
        if not (s.step % t.log_every == 0 or s.step == t.max_steps or s.step == 1
                or out.verdict is not None):
            return {}
        grad_norm = out.result.grad_norm
        speed = self.interval.take(s.tokens)
        mfu = self.peak.mfu(self.fpt * speed["tokens_per_s"])
        metrics = {"loss": out.loss, "lr": out.lr, "grad_norm": grad_norm, "tokens": s.tokens,
                   **speed, "mfu": mfu, "skipped_steps": s.skipped_steps,
                   **eng.memory_stats(self.rt.device)}
        mixture = self.loader.mixture_tokens()
        if mixture is not None:  # data.mixture: cumulative tokens per source
            metrics["mixture_tokens"] = mixture
        self.tracker.log(s.step, metrics)
        if mfu > 1.0 and not self._said_mfu and self.rt.is_main:
            self._said_mfu = True
            log.warning("MFU %.0f%% > 100%%: the peak of %.3g FLOP/s (%s) is too low for this "
                        "machine; set trainer.peak_flops to its per-device peak", 100 * mfu,
                        self.peak.value, self.peak.source)
        if self.rt.is_main and self.cfg.tracking.console:
            log.info("step %5d/%d | loss %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | mfu %.1f%% | "
                     "%d steps in %.1fs (median %.2fs)", s.step, t.max_steps, out.loss, out.lr,
                     grad_norm if grad_norm is not None else float("nan"),
                     speed["tokens_per_s"], 100 * mfu, speed["interval_steps"],
                     speed["interval_s"], speed["step_time_s"])
        return metrics

    def evaluate(self) -> float:
        """The mean loss per token over the evaluation set (``trainer.eval_sequences`` windows
        of the validation split, each evaluated once by one rank: EvalSet), so the number does
        not depend on the micro-batch, world size or ZeRO stage. With data.mixture: each
        source's (``val_loss/<name>``, its share of the windows by weight) and the weighted
        mean of them (``val_loss``, the mixture's loss)."""
        t, rt = self.cfg.trainer, self.rt
        t0 = time.perf_counter()
        self.engine.eval()
        sets = eval_sets(self.prepared.dir, t.seq_len, t.micro_batch, t.eval_sequences, rt.rank,
                         rt.world_size)
        total = torch.zeros(len(sets), 2, dtype=torch.float64)  # per set: [loss sum, tokens]
        with torch.no_grad(), watchdog.phase("eval"):
            for i, (_, _, batches) in enumerate(sets):
                for x, y in batches:
                    x = x.to(rt.device)
                    _, loss = self.engine(x, y.to(rt.device), **self._masking(x))  # token mean
                    n = int((y != -100).sum())
                    if n:
                        total[i] += torch.tensor([loss.double().item() * n, n],
                                                 dtype=torch.float64)
        total = total.to(rt.device)
        dist.all_reduce(total)
        self.engine.train()
        per_set = total.cpu().tolist()
        losses = [ls / max(n, 1.0) for ls, n in per_set]
        tokens = int(sum(n for _, n in per_set))
        metrics: Dict[str, Any] = {}
        if sets[0][0] is None:
            self.val_loss = losses[0]
        else:  # the mixture's loss: the sources' losses weighted as training draws them
            weights = [w for _, w, _ in sets]
            self.val_loss = sum(w * v for w, v in zip(weights, losses)) / sum(weights)
            metrics = {f"val_loss/{name}": v for (name, _, _), v in zip(sets, losses)}
            metrics["mixture_tokens"] = self.loader.mixture_tokens()
        ppl = math.exp(min(self.val_loss, 50.0))
        seconds = time.perf_counter() - t0
        self.tracker.log(self.state.step, {"val_loss": self.val_loss, "val_ppl": ppl, **metrics,
                                           "val_tokens": tokens, "val_time_s": seconds})
        log.info("step %5d | val_loss %.4f | val_ppl %.2f | %d tokens in %.1fs%s",
                 self.state.step, self.val_loss, ppl, tokens, seconds,
                 "".join(f" | {k} {v:.4f}" for k, v in metrics.items() if k.startswith("val_")))
        return self.val_loss

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        t0, step = time.perf_counter(), self.state.step
        path = self.ckpts.save(
            self.engine, step,
            trainer_state={**self.state.state_dict(), "data": self.loader.state_dict(),
                           "tracker": self.tracker.state_dict(),
                           "world_size": self.rt.world_size,
                           "zero_stage": self.cfg.deepspeed.zero_stage,
                           "global_batch": self.plan.global_batch,
                           "seq_len": self.cfg.trainer.seq_len},
            rank_state={"rng": rng_state()},
            describe={"config": self.run_config, "model_args": asdict(self.model_args),
                      "tokenizer": self.prepared.tokenizer_path},
        )
        self.tracker.event(step, "checkpoint", path=str(path),
                           seconds=round(time.perf_counter() - t0, 3))
        return path

    def resume(self) -> None:
        """Continue from ``resume_from`` (if any) and open the tracker's sinks."""
        ckpt = self.resume_from
        if ckpt is not None:
            saved = self._restore(ckpt)
            self.tracker.load_state_dict(saved["tracker"])
            log.info("resumed from %s at step %d (%d tokens)", ckpt, self.state.step,
                     self.state.tokens)
        self.tracker.start(resume_step=self.state.step if ckpt is not None else None,
                           checkpoint=str(ckpt) if ckpt is not None else None)
        if ckpt is not None:
            changed = {"config_changes": self.config_changes} if self.config_changes else {}
            self.tracker.event(self.state.step, "resume", checkpoint=str(ckpt), **changed)

    def _restore(self, ckpt: Path) -> Dict[str, Any]:
        """Load ``ckpt`` into the engine, the train state, the data position and (same world
        size) the RNGs. Returns its saved state."""
        universal = self.universal and ckpt == self.resume_from
        watchdog.note(step=read_state(ckpt)["step"])  # a rank lost while loading is named at it
        saved, rank_state = self.ckpts.load(self.engine, ckpt, universal)
        self.state.load_state_dict(saved)
        self.loader.load_state_dict(saved["data"])  # the caller starts the next iterator
        self.source_epochs = self.loader.mixture_epochs()
        if rank_state and not universal:
            set_rng_state(rank_state["rng"])
        return saved

    def _roll_back_to(self, ckpt: Path) -> None:
        """Recovery's way back: verify the checkpoint again, restore it, and cut the metrics
        back to it (events stay on record)."""
        saved = self._restore(self.ckpts.resolve_resume(str(ckpt)))
        self.data_iter = iter(self.loader)
        self.tracker.rewind(saved["tracker"].get("metrics_lines"), self.state.step)

    # -- the end -------------------------------------------------------------------------------
    def finish(self) -> str:
        """A text sample, the final run_info.json, then close."""
        sample = generate_sample(self.engine, self.cfg.sample, self.cfg.trainer.seed,
                                 self.prepared.tokenizer_path, self.rt)
        if self.rt.is_main:
            log.info("sample: %r", sample)
            (Path(self.cfg.trainer.output_dir) / "sample.txt").write_text(sample + "\n")
            self.write_run_info(final_val_loss=self.val_loss, final_step=self.state.step)
        self.close()
        return sample

    def close(self) -> None:
        self.tracker.finish()
        self.loader.close()
        if dist.is_initialized():
            dist.barrier()  # the group itself is destroyed in main(), after every multirun job

    def write_run_info(self, **extra) -> None:
        cfg, p, n = self.cfg, self.plan, count_params(self.model_args)
        steps = cfg.trainer.max_steps
        info = {"params": n, "model_args": asdict(self.model_args),
                "flop_budget": cfg.scaling.flops if cfg.scaling.mode != "none" else None,
                "tokens": steps * p.tokens_per_step, "global_batch": p.global_batch,
                "seq_len": p.seq_len, "max_steps": steps, "flops_per_token": self.fpt,
                "flops": self.fpt * steps * p.tokens_per_step,
                "peak_flops": {"value": self.peak.value, "source": self.peak.source},
                "command": self.command, **extra}
        (Path(cfg.trainer.output_dir) / "run_info.json").write_text(json.dumps(info, indent=1))


# ------------------------------------------------------------------------------------------------
# Checks and helpers the trainer uses


def _check_token_ids(x, y, vocab_size: int, prepared_dir: str, window_start: int) -> None:
    """Token ids outside the vocabulary (a shard changed on disk after prepare) would index
    past the embedding: refuse them before the forward pass."""
    lo, hi = int(x.min()), int(x.max())
    bad_y = bool(((y >= vocab_size) | ((y < 0) & (y != -100))).any())
    if lo < 0 or hi >= vocab_size or bad_y:
        raise DataError(
            f"token ids outside [0, model.vocab_size={vocab_size}) in the global batch starting "
            f"at sample {window_start} of {prepared_dir} (min {lo}, max {hi}): the shards are "
            f"corrupt or from another tokenizer. Check them with data.verify=true, or delete "
            f"{prepared_dir} and prepare again."
        )


def check_config_changes(ckpt: Path, saved_state: Dict[str, Any], run_config: Dict[str, Any],
                         global_batch: int, tokenizer_sha: Optional[str],
                         allowed: Sequence[str], say: bool = False) -> Dict[str, List[Any]]:
    """Compare the checkpoint's config with this run's (llama_train.config.config_changes).
    Run-defining changes not in ``allowed`` refuse the resume with all of them listed; a changed
    global batch, model shape or tokenizer always does (the data order, weights or token ids
    would not continue). ``tokenizer_sha``: the sha256 of the tokenizer that encoded this run's
    data, None where it is not known yet (preflight, before data preparation). Reads files
    only, so preflight runs it before the data and the process group. Returns the changes
    that go ahead ({key: [old, new]}), logged when ``say``."""
    from llama_train.config import config_changes

    cfg_file = Path(ckpt) / "config.yaml"
    saved_cfg = to_container(OmegaConf.load(cfg_file)) if cfg_file.is_file() else {}
    defining, safe = config_changes(saved_cfg, run_config)
    hard = []
    if saved_state["global_batch"] != global_batch:
        hard.append(("global batch (sequences per step, as resolved)",
                     saved_state["global_batch"], global_batch))
    theirs = Path(ckpt) / "tokenizer.model"
    if theirs.is_file() and tokenizer_sha and file_sha256(theirs) != tokenizer_sha:
        hard.append(("tokenizer sha256 (of the data)", file_sha256(theirs)[:12],
                     tokenizer_sha[:12]))
    shape = _shape_change(saved_cfg.get("model"), run_config["model"])
    if shape:  # no allow_config_change can load these weights
        hard.append(("model shape (the checkpoint's weights would not load)",
                     ", ".join(f"{n}={old}" for n, old, _ in shape),
                     ", ".join(f"{n}={new}" for n, _, new in shape)))
        defining = [c for c in defining if c[0] not in SHAPE_KEYS]  # listed once, above
    allowed = [a.strip() for a in allowed]
    refused = [c for c in defining if not any(c[0] == a or c[0].startswith(a + ".")
                                              for a in allowed)]
    if refused or hard:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in [*hard, *refused])
        fix = []
        if refused:
            keys = ",".join(k for k, _, _ in refused)
            fix.append(f"to change them on purpose add trainer.allow_config_change=[{keys}]")
        if hard:
            fix.append(f"a changed model shape, global batch or tokenizer cannot continue this "
                       f"run: keep them (for the tokenizer, prepare the data with "
                       f"data.tokenizer={theirs}); a new shape is a new run")
        fix.append("or start a new trainer.output_dir (or trainer.resume=never with "
                   "trainer.on_existing=archive)")
        raise ConfigError(f"checkpoint {ckpt} was trained with another run-defining config: "
                          f"{listed}. Nothing was changed. {'; '.join(fix)}.")
    go = {k: [old, new] for k, old, new in [*safe, *defining]}
    if go and say:
        log.warning("resuming %s with changed settings: %s", ckpt,
                    "; ".join(f"{k}: {v[0]!r} -> {v[1]!r}{'' if (k, *v) in safe else ' (allowed)'}"
                              for k, v in go.items()))
    return go


# The model keys that set weight shapes (ModelArgs.SHAPE_FIELDS as written in the config).
SHAPE_KEYS = tuple(f"model.{k}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                          "multiple_of", "ffn_dim_multiplier", "tie_embeddings"))


def _shape_change(saved_model: Optional[dict], model: dict) -> list:
    """[(field, checkpoint's, ours)] where the checkpoint's model has other weight shapes."""
    from llama_train.model import ModelArgs

    if not saved_model:
        return []
    try:
        theirs = ModelArgs.from_dict(saved_model)
    except (TypeError, ValueError):  # written by another version: the load itself will tell
        return []
    return [(n, old, new) for n, new, old in ModelArgs.from_dict(model).shape_differences(theirs)]


def _read_init_from(path: str, with_weights: bool):
    """(ModelArgs, state dict or None) of trainer.init_from: a Hugging Face Llama directory or a
    llama-import file (memory-mapped: reading its shape costs no copy of the weights)."""
    from llama_train.hf import from_hf_config, import_hf
    from llama_train.model import ModelArgs

    p = Path(path)
    what = (f"trainer.init_from={path} is not weights we can start from: give a Hugging Face "
            f"Llama directory (config.json + safetensors) or a .pt written by llama-import "
            f"(a llama_train checkpoint directory: llama-export it first, or continue it with "
            f"trainer.resume=<it>)")
    try:
        if p.is_dir():
            if with_weights:
                return import_hf(p)
            if not (p / "config.json").is_file():
                raise ValueError(f"{p / 'config.json'} does not exist")
            return from_hf_config(json.loads((p / "config.json").read_text())), None
        blob = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(blob, dict) or not {"model_args", "model"} <= set(blob):
            raise ValueError(f"it holds {type(blob).__name__} "
                             f"{sorted(blob)[:5] if isinstance(blob, dict) else ''}, not "
                             f"{{'model_args', 'model'}}")
        return ModelArgs(**blob["model_args"]), (blob["model"] if with_weights else None)
    except Exception as e:  # noqa: BLE001 - whatever the reader says, the answer is the same
        raise ConfigError(f"{what}. Reading it said: {str(e).strip().splitlines()[0][:300]}") \
            from None


def check_init_from(path: str, model_args) -> None:
    """trainer.init_from must be readable weights of this model's shape: checked before the
    process group starts."""
    args, _ = _read_init_from(path, with_weights=False)
    diff = model_args.shape_differences(args)
    if diff:
        raise ConfigError(
            f"trainer.init_from={path} has "
            + ", ".join(f"{n}={theirs}" for n, _, theirs in diff) + " but the model config has "
            + ", ".join(f"{n}={ours}" for n, ours, _ in diff) + ": pick the matching model preset.")


def load_initial_weights(model, model_args, path: str, zero_stage: int = 0) -> None:
    """trainer.init_from: weights from a Hugging Face Llama directory or a llama-import file
    (ZeRO-3: into the partitioned model, one gathered parameter at a time)."""
    check_init_from(path, model_args)
    _, sd = _read_init_from(path, with_weights=True)
    eng.load_full_state(model, sd, zero_stage)
    log.info("initialised weights from %s", path)


def generate_sample(engine: eng.Engine, sample_cfg, seed: int, tokenizer_path: str, rt) -> str:
    """Text from the trained model. Rank 0 generates; under ZeRO-3 every rank runs the same
    decoding (same seed, same logits, so the same number of steps), and DeepSpeed gathers one
    layer at a time as it does in training, never the whole model."""
    tok = Tokenizer(tokenizer_path)
    model = engine.module
    model.eval()
    prompt = tok.encode(sample_cfg.prompt, bos=False, eos=False)
    gen = torch.Generator(device=rt.device).manual_seed(seed)
    text = ""
    if rt.is_main or engine.zero_stage == 3:
        out = model.generate(torch.tensor([prompt], device=rt.device),
                             max_new_tokens=sample_cfg.tokens, temperature=sample_cfg.temperature,
                             top_k=sample_cfg.top_k, eos_id=tok.eos_id, generator=gen)
        text = tok.decode(out[0].tolist())
    model.train()
    return text
