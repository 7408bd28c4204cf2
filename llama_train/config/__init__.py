"""Structured Hydra configs: one dataclass per config group, registered in the ConfigStore.

Each YAML file under ``configs/<group>/`` is merged onto its dataclass, so an unknown key or a
wrong type fails while Hydra composes the config, and each dataclass checks its own values in
``__post_init__`` when :func:`load_config` builds it, with a message that names the key and the
fix. The few checks that need several groups at once (batch arithmetic against the world size,
sequence length against the model, precision against the device) are :func:`validate`. All of
it runs before any process group starts.

This package is the one place to import them from (``from llama_train.config import ...``);
its modules split the work: :mod:`.groups` (the groups of one run and their own checks),
:mod:`.deepspeed_group` (the ``deepspeed`` group and the DeepSpeed keys ``deepspeed.extra`` may
not set), :mod:`.schema` (the whole :class:`Config`, registered with Hydra on import),
:mod:`.validation` (the checks across groups: :func:`validate`, :func:`resolve_batch`,
:func:`parallel_layout`) and :mod:`.load` (:func:`load_config`, composition errors, secrets).
"""

from __future__ import annotations

from omegaconf import MISSING

from llama_train.comm import CommConfig
from llama_train.config.deepspeed_group import (DEEPSPEED_OWNED, DEEPSPEED_OWNED_WHEN_ON,
                                                DeepSpeedConfig, ZeroPPConfig)
from llama_train.config.groups import (COMM_MAX_TIMEOUT_S, COMPILE_CHOICES, FLOAT8_RECIPES,
                                       Float8Config, OptimConfig, ParallelConfig, RecoveryConfig,
                                       SampleConfig, ScalingConfig, TensorBoardConfig,
                                       TrackingConfig, TrainerConfig, WandbConfig)
from llama_train.config.load import (config_keys, explain_composition_error, flatten,
                                     is_secret_key, load_config, scrub_secrets, to_container,
                                     unknown_key_message)
from llama_train.config.schema import Config, register_configs, short_number
from llama_train.config.validation import (BatchPlan, config_warnings, mics_unavailable,
                                           parallel_layout, resolve_batch, validate)
from llama_train.data.config import DataConfig
from llama_train.errors import ConfigError  # defined there, exported here as always
from llama_train.layout import ParallelLayout
from llama_train.model.args import ModelArgs

__all__ = [
    "BatchPlan", "Config", "ConfigError", "DeepSpeedConfig", "Float8Config", "OptimConfig",
    "RecoveryConfig", "SampleConfig", "ScalingConfig", "TensorBoardConfig", "TrackingConfig",
    "TrainerConfig", "WandbConfig", "MISSING",
    "load_config", "register_configs", "resolve_batch", "to_container", "validate",
]
