"""What a run says when it ends, or when it is started again after it has ended: where its
model is and the commands that use it, so nobody has to piece that together from the log."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional


def duration(seconds: float) -> str:
    """``1:02:03`` (h:mm:ss), ``2:03`` under an hour."""
    s = max(0, int(round(seconds)))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _commands(checkpoint: Path, output_dir: str) -> List[str]:
    ckpt = shlex.quote(str(checkpoint))
    return [f"  export:   llama-export {ckpt} {shlex.quote(str(Path(output_dir) / 'hf'))}",
            f"  generate: llama-generate {ckpt} --prompt 'The'"]


def end_of_run(*, step: int, max_steps: int, wall_s: float, tokens: int, run_tokens: int,
               train_loss: Optional[float], val_loss: Optional[float],
               predicted_loss: Optional[float], plan: Optional[str],
               checkpoint: Optional[Path], output_dir: str) -> List[str]:
    """The lines a finished run ends its log with."""
    losses = [f"train loss {train_loss:.4f}" if train_loss is not None else "no train loss",
              f"val loss {val_loss:.4f}" if val_loss is not None else "no validation split"]
    lines = [f"run complete: step {step}/{max_steps} in {duration(wall_s)} (this start: "
             f"{run_tokens:,} tokens; the run: {tokens:,}); final {', '.join(losses)}"]
    if predicted_loss is not None:
        gap = (f", {val_loss - predicted_loss:+.4f} from it" if val_loss is not None else "")
        lines.append(f"  the scaling plan predicted val loss {predicted_loss:.4f}{gap} ({plan})")
    if checkpoint is not None:
        lines.append(f"  last checkpoint: {checkpoint}")
        lines += _commands(checkpoint, output_dir)
    return lines


def already_complete(*, step: int, max_steps: int, checkpoint: Path, output_dir: str,
                     val_loss: Optional[float]) -> List[str]:
    """The lines of a run started again after it reached trainer.max_steps: nothing trains."""
    val = f", final val loss {val_loss:.4f}" if val_loss is not None else ""
    return [f"run complete: {output_dir} holds step {step} of trainer.max_steps={max_steps}"
            f"{val}; nothing to train (a larger trainer.max_steps trains on)",
            f"  last checkpoint: {checkpoint}", *_commands(checkpoint, output_dir)]
