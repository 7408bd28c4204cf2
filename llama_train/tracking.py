"""Metrics and experiment tracking: ``metrics.jsonl`` always, W&B when enabled. Rank 0 only.

This is the one place that decides which rank writes; the training loop calls it on every rank.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import secrets
import string
from pathlib import Path
from typing import Any, Dict, Optional

from llama_train.config import TrackingConfig

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


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # NaN/inf are not JSON; keep them visible as strings
    return v


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

    # -- state carried in checkpoints -----------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"wandb_run_id": self.run_id}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = state.get("wandb_run_id") or self.run_id

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, resume_step: Optional[int] = None) -> None:
        """Open the sinks. On resume, drop metric lines past the checkpoint's step so the file
        holds exactly one line per step of the run that continues."""
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.metrics_path.exists():
                self.metrics_path.unlink()  # a fresh run starts a fresh history
        else:
            self._truncate_after(resume_step)
        if self.mode != "disabled":
            self._start_wandb(resume=resume_step is not None)

    def _truncate_after(self, step: int) -> None:
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill -9
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.metrics_path)

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
        log.info("wandb: run %s (%s) in %s", self.run_id, self.mode, wandb_dir)

    # -- logging ---------------------------------------------------------------------------
    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                            step=step)

    def event(self, step: int, name: str, **fields: Any) -> None:
        if not self.enabled:
            return
        self.log(step, {"event": name, **fields})
        log.info("[step %d] %s %s", step, name, fields or "")

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
