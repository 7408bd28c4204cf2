"""The whole config, one field per group (:class:`Config`), registered in Hydra's ConfigStore
as ``llama_train_schema`` on import, so every YAML file under ``configs/<group>/`` is merged onto
its typed node (an unknown key or a wrong type fails while Hydra composes the config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from llama_train.bounds import SIMULATE_MAX_RANKS, Range
from llama_train.comm import CommConfig
from llama_train.config.deepspeed_group import DeepSpeedConfig
from llama_train.config.groups import (COMM_MAX_TIMEOUT_S, Float8Config, OptimConfig,
                                       ParallelConfig, RecoveryConfig, SampleConfig,
                                       ScalingConfig, TrackingConfig, TrainerConfig,
                                       _check_ranges)
from llama_train.data.config import DataConfig
from llama_train.model.args import ModelArgs
from llama_train.policy import may_change


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    recovery: RecoveryConfig = may_change(factory=RecoveryConfig)
    sample: SampleConfig = may_change(factory=SampleConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    tracking: TrackingConfig = may_change(factory=TrackingConfig)
    comm: CommConfig = may_change(factory=CommConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # may change on resume: FP8 on or off changes how the matmuls round, not the weights or state
    float8: Float8Config = may_change(factory=Float8Config)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    experiment: Optional[Any] = None

    def __post_init__(self) -> None:
        # CommConfig (llama_train.comm) refuses a zero timeout or a 1-rank simulation; the
        # upper bounds of its numbers are here, with every other group's
        _check_ranges("comm", self.comm, {
            "timeout_s": Range(1, COMM_MAX_TIMEOUT_S, integer=True,
                               fix="seconds a collective may take before the job fails"),
            "simulate_ranks": Range(0, SIMULATE_MAX_RANKS, integer=True,
                                    fix="the ranks of the job to simulate (a simulated rank "
                                        "answers every collective for all of them, so its "
                                        "saves slow with N), or 0 to run for real"),
            "simulate_rank": Range(0, SIMULATE_MAX_RANKS - 1, integer=True),
        })


def short_number(x: Any) -> str:
    """``3e14`` for 3.0e14 (the ``${sci:...}`` resolver: readable directory names)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if abs(v) < 1e4:
        return f"{v:.6g}"
    mantissa, exponent = f"{v:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def register_configs() -> None:
    if not OmegaConf.has_resolver("sci"):
        OmegaConf.register_new_resolver("sci", short_number)
    cs = ConfigStore.instance()
    # The primary config extends this schema, so every group's YAML is merged onto its typed node.
    schema = OmegaConf.structured(Config)
    # deepspeed.extra takes keys of DeepSpeed's we do not list: out of Hydra's struct mode, so
    # deepspeed.extra.comms_logger.enabled=true needs no '+' (the flag survives composition)
    OmegaConf.set_struct(schema.deepspeed.extra, False)
    cs.store(name="llama_train_schema", node=schema)


register_configs()  # on import: whoever composes configs/ (the app, tests, tools) finds the schema
