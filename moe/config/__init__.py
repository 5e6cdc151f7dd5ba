"""Configs: typed schemas (Hydra's ConfigStore), the validator, derived values, model sizes and backend specs.

Importing `moe.config` registers `train_schema` (and the `sweep` group); `moe.config.infer` and
`moe.config.data_prep` register the other two entry points' roots.
"""
from moe.config.schema import (
    DataConfig,
    HardwareConfig,
    ModelConfig,
    MoEOptConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    TrainerConfig,
    register_configs,
)

__all__ = ["DataConfig", "HardwareConfig", "ModelConfig", "MoEOptConfig", "OptimizerConfig", "ParallelConfig",
           "TrainConfig", "TrainerConfig", "register_configs"]
