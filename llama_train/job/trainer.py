"""The training loop: build -> resume -> loop {batch, forward/backward, step, log, eval, save}.

:class:`Trainer` reads top to bottom: :meth:`Trainer.fit` is the loop, :meth:`Trainer.train_step`
one optimizer step. The pieces it calls are components with small interfaces: one global batch
trained (:class:`TrainModule`, over the DeepSpeed boundary :class:`llama_train.engine.Engine`),
checkpoints (:class:`CheckpointManager`), the data stream (:class:`TrainLoader`), tracking
(:class:`Tracker`), recovery from bad steps (:class:`Recovery`) and hooks (fault injection,
benchmarks), the rank-0 files (:class:`llama_train.job.run_files.RunFiles`) and a simulated rank's
measurements (:mod:`llama_train.job.simulation`'s component, a no-op on a real rank). Everything a
checkpoint must carry about the loop itself is one :class:`TrainState`. :func:`start` sets the job
up and builds its parts (:mod:`llama_train.job.build`: resolve_job, build_job -> Components); the
Trainer builds nothing.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from llama_train import watchdog
from llama_train.checkpoint import Fixed, RngState, StateRegistry, read_state
from llama_train.data import eval_sets
from llama_train.engine.flops import memory_stats
from llama_train.hooks import Hook
from llama_train.inference.sample import generate_sample
from llama_train.job.build import Components, build_job, resolve_job
from llama_train.job.compile_watch import CompileWatch
from llama_train.job.progress import Interval, Progress
from llama_train.job.summary import duration, end_of_run
from llama_train.job.train_module import BatchResult
from llama_train.job.train_state import TrainState
from llama_train.model import count_params
from llama_train.proc import job_command, launcher_gone

__all__ = ["Components", "CompileWatch", "StepOutput", "StopSignals", "Trainer", "TrainState",
           "build_job", "start"]

log = logging.getLogger("llama_train")


@dataclass
class StepOutput:
    """One optimizer step as the loop sees it: the batch's result, timed and judged."""

    batch: BatchResult
    seconds: float
    verdict: Optional[str]  # Recovery's: skipped_step, spike, nonfinite_applied, or None
    window_end: int  # the stream's position after the step (global samples)


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

    def stopped_line(self, step: int, checkpoint: Any, command: Optional[str],
                     resume: str, gone: Optional[str] = None) -> str:
        """The one line a stopped job ends with (rank 0, once the save is durable): why, the
        step saved and where, the command that resumes it (``trainer.resume=auto`` added where
        the run's own setting would not resume). ``gone``: proc.launcher_gone()'s answer; a
        rank that learnt of the stop from another rank whose watcher saw the ``deepspeed``
        command (or the launcher) go says the SIGTERM its own would have sent it."""
        first = self.received[0] if self.received else None
        if first is None and gone is not None:
            first = signal.SIGTERM
        why = ("Ctrl-C (SIGINT)" if first == signal.SIGINT else signal.Signals(first).name
               if first is not None else "a signal to another rank")
        again = (f"{command}{'' if resume == 'auto' else ' trainer.resume=auto'}" if command
                 else f"the same command{'' if resume == 'auto' else ' with trainer.resume=auto'}")
        return f"stopped by {why}: saved step {step}, exiting ({checkpoint}); resume with: {again}"


def start(pre, hooks: Sequence[Hook] = ()) -> Optional["Trainer"]:
    """Set the job up after preflight (``pre``, a :class:`llama_train.job.preflight.Preflight`):
    the process group, the checkpoint to continue (:func:`llama_train.job.build.resolve_job`); then
    the Trainer on the job's parts (:func:`llama_train.job.build.build_job`). None when the
    checkpoint already holds trainer.max_steps: the run is complete."""
    job = resolve_job(pre, hooks)
    if job is None:
        return None
    return Trainer(pre, build_job(pre, job))


class Trainer:
    def __init__(self, pre, parts: Components):
        """The loop over a job's parts, as :func:`llama_train.job.build.build_job` built them (on a
        process group that is up, to continue ``parts.resume``; None: from step 0). ``pre`` is
        the :class:`llama_train.job.preflight.Preflight` (config checked, data prepared)."""
        self.cfg, self.rt, self.plan, self.prepared = pre.cfg, pre.rt, pre.plan, pre.prepared
        self.layout = pre.job.layout  # ranks / parallel.sequence, this rank's coordinates
        self.model_args = pre.model_args
        self.experiment = pre.experiment  # scaling.ExperimentPlan of experiment=... runs
        resume = parts.resume
        self.hooks: List[Hook] = parts.hooks
        self.ckpts = parts.ckpts
        self.resume_from = resume.checkpoint if resume is not None else None
        self.config_changes: Dict[str, List[Any]] = resume.changes if resume is not None else {}
        self.resume_s: Dict[str, float] = dict(resume.seconds) if resume is not None else {}
        self.universal = resume is not None and resume.universal
        self.run_config = parts.run_config
        # a simulated rank's measurements and names (its checkpoints say so), or none
        self.simulation = parts.simulation
        self.seq_mpu = parts.seq_mpu
        self.dp_rank = self.layout.dp_rank
        self.engine, self.module, self.loader = parts.engine, parts.module, parts.loader
        self.eos_id = self.module.eos_id  # the token documents end with (document masking)
        self.tracker, self.state, self.recovery = parts.tracker, parts.state, parts.recovery
        self._register_parts()
        self.fpt, self.peak = parts.fpt, parts.peak
        self.files = parts.files  # config.yaml, run_info.json, sample.txt (rank 0 writes them)
        self.losses: Dict[int, float] = {}
        self.val_loss: Optional[float] = None
        # data.val_fraction=0: no validation split, so no evaluation (said once at start)
        self.has_val = self.prepared.meta["splits"].get("val", {}).get("tokens", 0) > 0
        self.source_epochs = self.loader.mixture_epochs()  # data.mixture: noted as they change
        self._log_start(parts.precision)

    def _log_start(self, precision: str) -> None:
        if not self.rt.is_main:
            return
        n = count_params(self.model_args)
        p = self.plan
        sp = self.layout.sequence_parallel
        log.info("model: %s params (%s non-embedding); %d ranks%s x micro %d x accum %d = global "
                 "batch %d x %d tokens; ZeRO-%d %s on %s; MFU%s against %.3g FLOP/s (%s), "
                 "fixed for the run", f"{n['total']:,}", f"{n['non_embedding']:,}",
                 self.rt.world_size,
                 f" / sequence parallel {sp}" if sp > 1 else "", p.micro_batch, p.grad_accum,
                 p.global_batch, p.seq_len,
                 self.cfg.deepspeed.zero_stage, precision, self.rt.device_type,
                 self.simulation.mfu_note,
                 self.peak.value, self.peak.source)
        if not self.has_val:
            log.warning("data.val_fraction=%g: the data has no validation split, so there is no "
                        "evaluation (no val_loss)", self.cfg.data.val_fraction)

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> Dict[str, Any]:
        """The whole run; returns a summary (final step, losses) for callers such as tests."""
        t, s = self.cfg.trainer, self.state
        self.resume()
        stop = StopSignals()
        # under the launcher a stop takes W&B's service down with the job: expected, not a warning
        self.tracker.stopping = lambda: bool(stop.received)
        try:
            self.data_iter = iter(self.loader)
            self.last_good = self.resume_from  # a rollback returns here: the newest of this run
            last_saved = s.step if self.resume_from is not None else -1
            first_step, run_done = s.step, False
            self.started = (time.perf_counter(), s.step, s.tokens)  # for the summary
            self.engine.train()
            self.interval = Interval(s.tokens)
            self.progress = Progress(s.step, t.max_steps)
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
                self.losses[s.step] = out.batch.loss
                self.interval.add(out)
                metrics = self.log_step(out)
                self._note_source_epochs()
                if self.has_val and (s.step % t.eval_every == 0 or s.step == t.max_steps):
                    self.evaluate()
                run_done = (t.steps_this_run is not None
                            and s.step - first_step >= t.steps_this_run)
                if (s.step % t.save_every == 0 or s.step == t.max_steps or out.batch.stop_requested
                        or run_done):
                    self.last_good, last_saved = self.save(), s.step
                self._log_saves()
                for h in self.hooks:
                    h.on_step_end(s.step, metrics)
                if out.batch.stop_requested:
                    gone = launcher_gone()
                    if gone == "launcher":
                        log.error("the deepspeed launcher of this rank is gone (killed?): saved "
                                  "step %d and stopped; relaunch the job to continue from it. "
                                  "DeepSpeed's runner exits 0 when its launcher is killed by a "
                                  "signal: trust this line, not that status", s.step)
                    elif gone == "runner":
                        log.error("the deepspeed command that started this job is gone "
                                  "(stopped by a signal?): saved step %d and stopped; relaunch "
                                  "the job to continue from it", s.step)
                    self.close()
                    if self.rt.is_main:  # one line for the job, true once the save is durable
                        log.warning("%s", stop.stopped_line(s.step, self.last_good,
                                                            job_command(), t.resume, gone))
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
        """One optimizer step over this rank's slice of the next global batch, timed and
        judged."""
        s, p = self.state, self.plan
        skip_to = self.recovery.skip_bad_windows(self.loader.consumed_samples, s.step + 1)
        if skip_to is not None:  # data that caused a rollback is never read again
            self.loader.skip_samples(skip_to - self.loader.consumed_samples)
            self.data_iter = iter(self.loader)
        window_start = self.loader.consumed_samples
        batch_no = window_start // p.global_batch + 1  # this step's global batch in the stream
        t0 = time.perf_counter()
        batch = self.module.train_batch(self.data_iter, s.step + 1, batch_no, window_start,
                                        stop_received=bool(stop is not None and stop.received))
        s.step += 1
        s.tokens += p.tokens_per_step
        seconds = time.perf_counter() - t0
        verdict = self.recovery.judge(s.step, batch.loss, batch.result.applied,
                                      batch.result.nonfinite, window_start, batch_no)
        return StepOutput(batch, seconds, verdict, self.loader.consumed_samples)

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

    # -- around the step -----------------------------------------------------------------------
    def log_step(self, out: StepOutput) -> Dict[str, Any]:
        t, s = self.cfg.trainer, self.state
        self.progress.step_done(s.step, out.seconds)
        record = (s.step % t.log_every == 0 or s.step == t.max_steps or s.step == 1
                  or out.verdict is not None)
        console = self.rt.is_main and self.cfg.tracking.console
        if not (record or (console and self.progress.line_due())):
            return {}
        b = out.batch
        grad_norm = b.result.grad_norm
        # between records (a slow step): the interval so far, on the console only
        speed = self.interval.take(s.tokens) if record else self.interval.peek(s.tokens)
        mfu = self.peak.mfu(self.fpt * speed["tokens_per_s"] * self.simulation.own_share)
        if not record:
            self._step_line(out, speed, mfu)
            return {}
        metrics = {"loss": b.loss, "lr": b.lr, "grad_norm": grad_norm, "tokens": s.tokens,
                   **speed, "mfu": mfu, "skipped_steps": s.skipped_steps,
                   **memory_stats(self.rt.device)}
        mixture = self.loader.mixture_tokens()
        if mixture is not None:  # data.mixture: cumulative tokens per source
            metrics["mixture_tokens"] = mixture
        metrics = self.simulation.metrics(metrics)  # a simulated rank's: rank_loss
        self.tracker.log(s.step, metrics)
        if mfu > 1.0 and self.rt.is_main:  # every time: an MFU above 100% is never true
            log.warning("MFU %.0f%% > 100%% at step %d: the peak of %.3g FLOP/s (%s) is too low "
                        "for this machine; set trainer.peak_flops to its per-device peak", 100 * mfu,
                        s.step, self.peak.value, self.peak.source)
        if console:
            self._step_line(out, speed, mfu)
        return metrics

    def _step_line(self, out: StepOutput, speed: Dict[str, float], mfu: float) -> None:
        """The console's step line: the interval's throughput (since the last record) and the
        ETA (:class:`Progress`)."""
        s, b, grad_norm = self.state, out.batch, out.batch.result.grad_norm
        log.info("step %5d/%d | %s %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | mfu %.1f%% | "
                 "%d steps in %.1fs (median %.2fs) | eta %s", s.step, self.cfg.trainer.max_steps,
                 self.simulation.loss_label, b.loss, b.lr,
                 grad_norm if grad_norm is not None else float("nan"),
                 speed["tokens_per_s"], 100 * mfu, speed["interval_steps"],
                 speed["interval_s"], speed["step_time_s"], self.progress.eta(s.step))
        self.progress.last_line = time.perf_counter()

    def evaluate(self) -> float:
        """The mean loss per token over the evaluation set (``trainer.eval_sequences`` windows
        of the validation split, each evaluated once by one rank: EvalSet), so the number does
        not depend on the micro-batch, world size or ZeRO stage. With data.mixture: each
        source's (``val_loss/<name>``, its share of the windows by weight) and the weighted
        mean of them (``val_loss``, the mixture's loss)."""
        t, rt = self.cfg.trainer, self.rt
        t0 = time.perf_counter()
        self.engine.eval()
        sets = eval_sets(self.prepared.dir, t.seq_len, t.micro_batch, t.eval_sequences,
                         self.dp_rank, self.layout.data_parallel)
        total = torch.zeros(len(sets), 2, dtype=torch.float64)  # per set: [loss sum, tokens]
        with torch.no_grad(), watchdog.phase("eval"):
            for i, (_, _, batches) in enumerate(sets):
                for x, y in batches:
                    loss, n = self.module.eval_loss(x, y)  # token mean, target tokens
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
        record = {"val_loss": self.val_loss, "val_ppl": ppl, **metrics, "val_tokens": tokens,
                  "val_time_s": seconds}
        self.tracker.log(self.state.step, self.simulation.metrics(record))
        log.info("step %5d | %sval_loss %.4f | val_ppl %.2f | %d tokens in %.1fs%s",
                 self.state.step, self.simulation.val_prefix, self.val_loss,
                 ppl, tokens, seconds,
                 "".join(f" | {k} {v:.4f}" for k, v in metrics.items() if k.startswith("val_")))
        return self.val_loss

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        """Save this step; with trainer.async_save the write goes on in the background (the
        checkpoint is complete once ``ckpts.wait()`` returns). Returns the checkpoint's path."""
        with self.simulation.phase("save"):
            path = self._save(self.state.step)
        self.simulation.saved(path)
        return path

    def _log_saves(self) -> None:
        """A ``checkpoint`` event for each save that became durable: the seconds the loop was
        blocked (``seconds``, as before asynchronous saves) and until it was durable."""
        for r in self.ckpts.finished():
            if r.error is None:
                self.tracker.event(r.step, "checkpoint", path=str(r.path),
                                   seconds=round(r.blocked_s, 3), blocked_s=round(r.blocked_s, 3),
                                   waited_s=round(r.waited_s, 3),
                                   durable_s=round(r.durable_s or 0.0, 3),
                                   background=self.ckpts.async_save)

    def _register_parts(self) -> None:
        """What a checkpoint carries of the loop (:class:`StateRegistry`), in the order of
        trainer_state.json's keys: the train state (Recovery's streaks and windows included)
        at the top level, the data position, the tracker (loaded back by :meth:`resume`, which
        knows whether the checkpoint is another run's; rewound by a rollback), then the facts
        of the save a resume is judged by (llama_train.job.resume), never loaded back. Per rank
        (``ranks/rank_N.pt``): the RNGs."""
        rt = self.rt
        self.parts = StateRegistry()
        self.parts.register("train", self.state, merged=True)
        self.parts.register("data", self.loader)
        self.parts.register("tracker", self.tracker, restore=False)
        self.parts.register("run", Fixed({"world_size": rt.world_size,
                                          "zero_stage": self.cfg.deepspeed.zero_stage,
                                          "global_batch": self.plan.global_batch,
                                          "seq_len": self.cfg.trainer.seq_len}),
                            merged=True, restore=False)
        simulated = self.simulation.checkpoint_entry()
        if simulated is not None:  # a simulated rank's checkpoint holds its shard only
            self.parts.register("simulated", Fixed(simulated), restore=False)
        self.rank_parts = StateRegistry()
        self.rank_parts.register("rng", RngState())

    def _save(self, step: int) -> Path:
        return self.ckpts.save(
            self.engine, step,
            trainer_state=self.parts.state_dict(),
            rank_state=self.rank_parts.state_dict(),
            describe={"config": self.run_config, "model_args": asdict(self.model_args),
                      "tokenizer": self.prepared.tokenizer_path,
                      "tokenizer_sha256": self.prepared.meta["tokenizer"].get("sha256")},
        )

    def resume(self) -> None:
        """Continue from ``resume_from`` (if any) and open the tracker's sinks."""
        ckpt = self.resume_from
        if ckpt is not None:
            t0 = time.perf_counter()
            saved = self._restore(ckpt)
            self.resume_s["load_s"] = time.perf_counter() - t0
            own = Path(self.cfg.trainer.output_dir, "checkpoints").resolve()
            forked = Path(ckpt).resolve().parent != own  # another run's checkpoint: a new run
            self.tracker.load_state_dict(saved["tracker"], str(ckpt) if forked else None)
            self.simulation.resumed(self.state.step)
            log.info("resumed from %s at step %d (%d tokens)", ckpt, self.state.step,
                     self.state.tokens)
        self.files.start(self.run_config)  # only now: a resume that fails to load leaves the
        # run's files as they were (a finished run's final_*); rank 0 alone writes them
        self.tracker.start(resume_step=self.state.step if ckpt is not None else None,
                           checkpoint=str(ckpt) if ckpt is not None else None)
        if ckpt is not None:
            changed = {"config_changes": self.config_changes} if self.config_changes else {}
            seconds = {k: round(v, 3) for k, v in self.resume_s.items()}
            self.tracker.event(self.state.step, "resume", checkpoint=str(ckpt), **seconds,
                               **changed)

    def _restore(self, ckpt: Path) -> Dict[str, Any]:
        """Load ``ckpt`` into the engine, the train state, the data position and (same world
        size) the RNGs. Returns its saved state."""
        universal = self.universal and ckpt == self.resume_from
        watchdog.note(step=read_state(ckpt)["step"])  # a rank lost while loading is named at it
        with self.simulation.phase("load"):
            saved, rank_state = self.ckpts.load(self.engine, ckpt, universal)
        self.parts.load_state_dict(saved)  # the train state, the data position (the caller
        self.source_epochs = self.loader.mixture_epochs()  # starts the next iterator)
        if rank_state and not universal:
            self.rank_parts.load_state_dict(rank_state)  # the RNGs
        return saved

    def _roll_back_to(self, ckpt: Path) -> None:
        """Recovery's way back: verify the checkpoint again, restore it, and cut the metrics
        back to it (events stay on record). A write in flight (it may be ``ckpt``) ends first."""
        self.ckpts.wait()
        saved = self._restore(self.ckpts.resolve_resume(str(ckpt)))
        self.data_iter = iter(self.loader)
        self.tracker.rewind(saved["tracker"].get("metrics_lines"), self.state.step)

    # -- the end -------------------------------------------------------------------------------
    def finish(self) -> Optional[str]:
        """A text sample (None with sample.tokens=0: no line, no sample.txt), the final
        run_info.json, then close (the last save is durable first: a write that failed stops
        the run here, exit 3)."""
        try:
            self.ckpts.wait()
            self._log_saves()
            sample = (generate_sample(self.engine, self.cfg.sample, self.cfg.trainer.seed,
                                      self.prepared.tokenizer_path, self.rt.device,
                                      self.rt.is_main)
                      if self.cfg.sample.tokens else None)
            simulation = self.simulation.report(self._restore, self.last_good)
            self.files.finish(sample, self.simulation.final_val_loss(self.val_loss),
                              self.state.step, simulation)  # sample.txt, run_info.json: rank 0
            if self.rt.is_main and self.simulation.summarizes:
                self._summarize()
        except BaseException:
            # e.g. the last background write failed (exit 3): the loader's workers ignore
            # SIGTERM, and one left running made the process wait for it forever at exit
            self.loader.close()
            raise
        self.close()
        return sample

    def _summarize(self) -> None:
        """The end-of-run account (llama_train.job.summary) on rank 0."""
        s, exp = self.state, self.experiment
        t0, _, tokens0 = self.started
        wall = time.perf_counter() - t0
        lines = end_of_run(
            step=s.step, max_steps=self.cfg.trainer.max_steps,
            wall_s=wall, tokens=s.tokens, run_tokens=s.tokens - tokens0,
            train_loss=self.losses[max(self.losses)] if self.losses else None,
            val_loss=self.val_loss,
            predicted_loss=exp.target_loss if exp is not None else None,
            plan=exp.describe() if exp is not None else None, checkpoint=self.last_good,
            output_dir=self.cfg.trainer.output_dir)
        lines.insert(1, self._throughput(s.tokens - tokens0, wall))
        for line in lines:
            log.info("%s", line)

    def _throughput(self, tokens: int, wall_s: float) -> str:
        """The summary's mean tokens/s and MFU: over this start's wall time (as the records'
        tokens_per_s, evaluations and saves included), and over its steps alone."""
        pr = self.progress
        tps = tokens / max(wall_s, 1e-9)
        step_tps = pr.steps * self.plan.tokens_per_step / max(pr.step_s, 1e-9)
        return (f"  throughput: {tps:,.0f} tok/s, MFU {100 * self.peak.mfu(self.fpt * tps):.3g}% "
                f"over this start's {duration(wall_s)}; {step_tps:,.0f} tok/s, MFU "
                f"{100 * self.peak.mfu(self.fpt * step_tps):.3g}% in its {pr.steps} steps alone "
                f"({pr.step_s:.1f}s; no evaluations or saves)")

    def close(self) -> None:
        for h in self.hooks:
            if isinstance(h, CompileWatch):
                h.close()
        try:
            self.ckpts.wait()  # SIGTERM's save, the end of the run: durable before the exit
            self._log_saves()
        finally:
            self.tracker.finish()
            self.loader.close()
        if dist.is_initialized():
            dist.barrier()  # the group itself is destroyed in main(), after every multirun job
