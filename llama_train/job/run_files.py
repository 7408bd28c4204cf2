"""The files rank 0 alone writes into ``trainer.output_dir`` beside the tracker's metrics:
``config.yaml`` and ``run_info.json`` when the run starts (once a resume has loaded), ``sample.txt``
and the final ``run_info.json`` at its end. :class:`RunFiles` holds the rank-0 gating: the
Trainer calls it on every rank, and only the lead rank writes."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from llama_train.model import count_params
from llama_train.paths import replace_file
from llama_train.records import RUN_INFO_FILE, RunInfo

log = logging.getLogger("llama_train")

SAMPLE_FILE = "sample.txt"


class RunFiles:
    """config.yaml, run_info.json (:class:`llama_train.records.RunInfo`) and sample.txt of one
    run; written where ``lead`` (rank 0, or a simulated rank), nothing elsewhere."""

    def __init__(self, output_dir: str, lead: bool, run_info: Dict[str, Any]):
        self.out, self.lead = Path(output_dir), lead
        self.run_info = run_info  # RunInfo's fields but the final_* ones

    @classmethod
    def of(cls, pre, fpt: float, peak) -> "RunFiles":
        """The run's files for preflight's job (``pre``), its FLOPs per token and peak."""
        cfg, p, model_args = pre.cfg, pre.plan, pre.model_args
        steps = cfg.trainer.max_steps
        return cls(cfg.trainer.output_dir, pre.rt.is_main, dict(
            params=count_params(model_args), model_args=asdict(model_args),
            flop_budget=cfg.scaling.flops if cfg.scaling.mode != "none" else None,
            tokens=steps * p.tokens_per_step, global_batch=p.global_batch,
            seq_len=p.seq_len, max_steps=steps, flops_per_token=fpt,
            flops=fpt * steps * p.tokens_per_step,
            peak_flops={"value": peak.value, "source": peak.source},
            command=pre.command,
            count=cfg.scaling.count if cfg.scaling.mode != "none" else None,
            epoch_tokens=int(pre.prepared.meta["splits"]["train"]["tokens"])))

    def start(self, run_config: Any) -> None:
        """config.yaml and run_info.json: only once the run has started (a resume that fails to
        load leaves the run's files as they were: a finished run's final_*)."""
        if not self.lead:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        replace_file(self.out / "config.yaml", OmegaConf.to_yaml(run_config))  # no link
        self.write_run_info()

    def finish(self, sample: Optional[str], final_val_loss: Optional[float], final_step: int,
               simulation: Optional[Dict[str, Any]]) -> None:
        """The end: the text sample (logged, and sample.txt; none with sample.tokens=0, and an
        earlier start's sample.txt removed: it does not describe this end), then the final
        run_info.json."""
        if not self.lead:
            return
        sample_file = self.out / SAMPLE_FILE
        if sample is not None:
            log.info("sample: %r", sample)
            replace_file(sample_file, sample + "\n")  # never through a link
        else:  # an earlier start's sample does not describe this end
            sample_file.unlink(missing_ok=True)
        self.write_run_info(final_val_loss=final_val_loss, final_step=final_step,
                            simulation=simulation)

    def write_run_info(self, final_val_loss: Optional[float] = None,
                       final_step: Optional[int] = None,
                       simulation: Optional[Dict[str, Any]] = None) -> None:
        """run_info.json: at start, and at the end with the final step and val_loss (rank 0)."""
        if not self.lead:
            return
        RunInfo(**self.run_info, final_val_loss=final_val_loss, final_step=final_step,
                simulation=simulation).write(self.out / RUN_INFO_FILE)
