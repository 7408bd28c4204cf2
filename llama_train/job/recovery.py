"""Recovery from bad steps: the fault guard, the data windows never to read again, rollback.

A step is bad when it was not applied (non-finite loss or gradients: skipped), when it was
applied although non-finite (``nonfinite_applied``: DeepSpeed missed it, the weights are
suspect) or when its loss exceeds ``spike_factor`` x the running mean of good losses
(``spike``). ``max_bad_steps`` bad steps in a row, a spike or a suspect step roll back to the
newest checkpoint of this run, and the data window that caused it is skipped from then on. All of
its state lives in :class:`~llama_train.job.trainer.TrainState`, so a resumed run decides exactly as
the uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from llama_train.config import RecoveryConfig


class TrainingAborted(RuntimeError):
    """The fault policy gave up (too many rollbacks, nothing to roll back to)."""


class Recovery:
    def __init__(self, cfg: RecoveryConfig, state, tracker, enabled: bool = True):
        """``enabled=False`` (a simulated rank, whose losses are not the job's): no step is
        judged bad, so nothing rolls back."""
        self.cfg, self.state, self.tracker = cfg, state, tracker
        self.enabled = enabled

    # -- before a step ---------------------------------------------------------------------
    def skip_bad_windows(self, position: int, step: int) -> Optional[int]:
        """Where the data stream must continue so that no recorded bad window is read again;
        None when ``position`` (global samples consumed) stands in none."""
        pos, moved = position, True
        while moved:
            moved = False
            for lo, hi in self.state.skip_windows:
                if lo <= pos < hi:
                    pos, moved = hi, True
        if pos == position:
            return None
        self.tracker.event(step, "data_skipped", window=[position, pos])
        return pos

    # -- after a step ----------------------------------------------------------------------
    def judge(self, step: int, loss: float, applied: bool, nonfinite: bool,
              window_start: int, batch: int) -> Optional[str]:
        """None for a good step (it updates the running mean), else the verdict, recorded."""
        s, c = self.state, self.cfg
        if not self.enabled:
            return None
        if not applied:
            verdict = "skipped_step"
        elif nonfinite:
            verdict = "nonfinite_applied"
        elif (c.spike_factor > 0 and s.loss_ema is not None and step > c.spike_warmup_steps
              and loss > c.spike_factor * s.loss_ema):
            verdict = "spike"
        else:
            s.bad_streak = 0
            s.loss_ema = loss if s.loss_ema is None else 0.9 * s.loss_ema + 0.1 * loss
            return None
        if s.bad_streak == 0:
            s.streak_start = window_start
        s.bad_streak += 1
        s.skipped_steps += 0 if applied else 1
        self.tracker.event(step, verdict, step_loss=loss, bad_streak=s.bad_streak, batch=batch,
                           skipped_steps=s.skipped_steps)
        return verdict

    def must_roll_back(self, verdict: Optional[str]) -> bool:
        return verdict is not None and (verdict != "skipped_step"
                                        or self.state.bad_streak >= self.cfg.max_bad_steps)

    def roll_back(self, verdict: str, window_end: int, last_good: Optional[Path],
                  restore: Callable[[Path], Dict[str, Any]], save_every: int) -> None:
        """Return to ``last_good`` through ``restore`` (which loads the checkpoint and gives back
        its saved train state) and skip the data window of the bad streak from now on.
        Counters that describe the whole history (rollbacks, skipped steps, windows) carry on."""
        s = self.state
        bad_step, bad_window = s.step, [s.streak_start, window_end]
        if s.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingAborted(
                f"step {bad_step}: {verdict} after {s.rollbacks} rollbacks "
                f"(recovery.max_rollbacks={self.cfg.max_rollbacks}); stopping so that nothing "
                f"worse is saved. The newest good checkpoint is {last_good}; inspect the data "
                f"window {bad_window} (global samples) or lower optim.lr.")
        if last_good is None and s.loss_ema is None:
            # not one good step since the start: no checkpoint interval would have saved one
            raise TrainingAborted(
                f"step {bad_step}: {verdict}, and no step of this run has been good yet (each "
                f"one since its first had a non-finite loss or gradients): there is nothing to "
                f"roll back to, and saving more often would not change that. The weights it "
                f"started from (trainer.init_from, or the initialisation) or the first batches "
                f"of its data give non-finite losses: check those weights (every value finite, "
                f"the model config they were trained with) and the data; optim.lr plays no part "
                f"in a first step's loss.")
        if last_good is None:
            raise TrainingAborted(
                f"step {bad_step}: {verdict} needs a rollback but this run has no checkpoint "
                f"yet; lower trainer.save_every (now {save_every}) or raise "
                f"recovery.max_bad_steps (now {self.cfg.max_bad_steps}).")
        windows: List[List[int]] = [*s.skip_windows, bad_window]
        rollbacks, skipped = s.rollbacks + 1, s.skipped_steps
        restore(last_good)  # s now holds the checkpoint's step, tokens and running mean
        s.skip_windows, s.rollbacks, s.skipped_steps = windows, rollbacks, skipped
        s.bad_streak, s.streak_start = 0, 0
        self.tracker.event(bad_step, "rollback", to_step=s.step, checkpoint=str(last_good),
                           rollbacks=rollbacks, skip_window=bad_window, reason=verdict)
