"""The loop's own progress (:class:`TrainState`): step, tokens, Recovery's streaks and windows;
travels in every checkpoint (``trainer_state.json``, registered by the Trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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
