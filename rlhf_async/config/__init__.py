"""Typed job configuration: the dataclasses (`schema`), loading with every problem in one
error (`load`), cross-field checks (`checks`), the generated reference file (`reference`),
the defaults sized to the user's model (`sizing`)."""

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
from rlhf_async.config.sizing import describe_sized

__all__ = ["AlgoConfig", "ConfigError", "CriticConfig", "GenerationConfig", "JobConfig",
           "LoraConfig", "ModelConfig", "PlacementConfig", "RayConfig", "RewardModelConfig",
           "RunConfig", "RuntimeConfig", "SFTConfig", "TaskConfig", "TrainConfig",
           "WeightSyncConfig", "collective_backend", "config_from_dict", "describe_sized",
           "load_config", "parse_override", "to_dict", "weight_sync_backend",
           "weight_sync_delta"]
