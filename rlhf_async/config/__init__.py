"""Typed job configuration: the dataclasses (`schema`), loading with every problem in one
error (`load`), cross-field checks (`checks`), the generated reference file (`reference`)."""

from rlhf_async.config.fields import ConfigError
from rlhf_async.config.load import config_from_dict, load_config, parse_override
from rlhf_async.config.presets import AlgoConfig
from rlhf_async.config.schema import (
    CriticConfig,
    GenerationConfig,
    JobConfig,
    LoraConfig,
    ModelConfig,
    PlacementConfig,
    RayConfig,
    RewardModelConfig,
    RunConfig,
    RuntimeConfig,
    SFTConfig,
    TaskConfig,
    TrainConfig,
    WeightSyncConfig,
    collective_backend,
    to_dict,
    weight_sync_backend,
    weight_sync_delta,
)

__all__ = ["AlgoConfig", "ConfigError", "CriticConfig", "GenerationConfig", "JobConfig",
           "LoraConfig", "ModelConfig", "PlacementConfig", "RayConfig", "RewardModelConfig",
           "RunConfig", "RuntimeConfig", "SFTConfig", "TaskConfig", "TrainConfig",
           "WeightSyncConfig", "collective_backend", "config_from_dict", "load_config",
           "parse_override", "to_dict", "weight_sync_backend",
           "weight_sync_delta"]
