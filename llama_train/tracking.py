"""Metrics and experiment tracking: ``metrics.jsonl`` always, W&B when enabled. Rank 0 only.

This is the one place that decides which rank writes; the training loop calls it on every rank.

``metrics.jsonl`` holds one line per logged step of the run as it finally went, plus ``event``
lines (checkpoint, resume, skipped_step, spike, rollback). Its length at each checkpoint travels
in the checkpoint, so a resume cuts the file back to exactly what it was then, and a rollback
cuts it back but keeps the events that explain why. W&B gets the same records against a ``step``
axis of its own (steps may repeat after a rollback; W&B's own step counter never goes back).
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import string
from pathlib import Path
from typing import Any, Dict, Optional

from llama_train.config import TrackingConfig
from llama_train.util import jsonable

log = logging.getLogger("llama_train")


def wandb_api_key_present() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_wandb_mode(mode: Optional[str]) -> str:
    if mode is not None:
        return mode
    return "online" if wandb_api_key_present() else "offline"


class Tracker:
    """``log(step, metrics)`` appends a JSON line and forwards to W&B; ``event`` records
    checkpoints, resumes and rollbacks. Its state (the W&B run id) travels in checkpoints."""

    def __init__(self, cfg: TrackingConfig, output_dir: str, rank: int,
                 run_config: Optional[Dict[str, Any]] = None):
        self.cfg = cfg
        self.enabled = rank == 0
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / cfg.metrics_file
        self.run_config = run_config or {}
        self.run_id: Optional[str] = None
        self._wandb = None
        self.mode = resolve_wandb_mode(cfg.wandb.mode)
        self.lines = 0  # complete lines in metrics.jsonl
        self._resume_lines: Optional[int] = None

    # -- state carried in checkpoints -----------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"wandb_run_id": self.run_id, "metrics_lines": self.lines if self.enabled else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = state.get("wandb_run_id") or self.run_id
        self._resume_lines = state.get("metrics_lines")

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, resume_step: Optional[int] = None, checkpoint: Optional[str] = None) -> None:
        """Open the sinks. On resume, cut the file back to what it held when the checkpoint was
        written (and that checkpoint's own event), so lines written after it by the run that
        died are replaced by the lines of the run that continues."""
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.metrics_path.exists():
                self.metrics_path.unlink()  # a fresh run starts a fresh history
            self.lines = 0
        elif self._resume_lines is not None:
            self._cut(self._resume_lines, keep=lambda r: r.get("event") == "checkpoint"
                      and r.get("path") == checkpoint, keep_first_only=True)
        else:  # a checkpoint from before line counts were saved: cut by step
            rows = self._read()
            self._write([line for line, r in rows if r is not None and r.get("step", 0)
                         <= resume_step])
        if self.mode != "disabled":
            self._start_wandb(resume=resume_step is not None)

    def rewind(self, lines: Optional[int], step: int) -> None:
        """After a rollback to a checkpoint: drop what was logged after it except event lines
        (the skipped steps, the spike, the rollback stay on record)."""
        if not self.enabled:
            return
        if lines is None:  # old checkpoint: fall back to steps
            rows = self._read()
            self._write([line for line, r in rows if r is not None
                         and (r.get("step", 0) <= step or "event" in r)])
            return
        self._cut(lines, keep=lambda r: "event" in r)

    def _read(self):
        if not self.metrics_path.exists():
            return []
        rows = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rows.append((line, json.loads(line)))
            except json.JSONDecodeError:
                rows.append((line, None))  # a line cut by a kill -9
        return rows

    def _cut(self, lines: int, keep, keep_first_only: bool = False) -> None:
        rows = self._read()
        kept = [line for line, r in rows[:lines] if r is not None]
        for line, r in rows[lines:]:
            if r is not None and keep(r):
                kept.append(line)
                if keep_first_only:
                    break
            elif keep_first_only:
                break
        self._write(kept)

    def _write(self, lines) -> None:
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in lines))
        os.replace(tmp, self.metrics_path)
        self.lines = len(lines)

    def _start_wandb(self, resume: bool) -> None:
        import wandb

        w = self.cfg.wandb
        if self.run_id is None:
            alphabet = string.ascii_lowercase + string.digits  # W&B's own id alphabet
            self.run_id = "".join(secrets.choice(alphabet) for _ in range(8))
        wandb_dir = Path(w.dir or self.output_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name,
            group=w.group,
            tags=list(w.tags) or None,
            dir=str(wandb_dir),
            id=self.run_id,
            resume="allow",
            mode=self.mode,
            config=self.run_config,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        # Our step can repeat (resume, rollback); W&B's own must grow: plot against "step".
        self._wandb.define_metric("step")
        self._wandb.define_metric("*", step_metric="step")
        log.info("wandb: run %s (%s) in %s", self.run_id, self.mode, wandb_dir)

    # -- logging ---------------------------------------------------------------------------
    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: jsonable(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        self.lines += 1
        if self._wandb is not None and "event" not in metrics:
            self._wandb.log({"step": step, **{k: v for k, v in metrics.items()
                                              if isinstance(v, (int, float))}})

    def event(self, step: int, name: str, **fields: Any) -> None:
        if not self.enabled:
            return
        self.log(step, {"event": name, **fields})
        if self._wandb is not None:  # a counter per event kind, its numeric fields beside it
            self._wandb.log({"step": step, f"event/{name}": 1,
                             **{f"event/{name}/{k}": v for k, v in fields.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool)}})
        log.info("[step %d] %s %s", step, name, fields or "")

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
