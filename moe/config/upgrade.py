"""A config an older version saved (a checkpoint's `hyper_parameters["cfg"]`), read under today's schema.

The one place such a config is upgraded: the keys it lacks get the schema's defaults (moe.config.schema),
so no other code restates a default for a key that might be missing. Keys a newer version dropped are
kept (nothing reads them).
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from moe.config.schema import TrainConfig


def with_schema_defaults(cfg) -> DictConfig:
    """`cfg` (a config or the plain dict a checkpoint stores) with every key today's schema has."""
    defaults = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False))
    return OmegaConf.merge(defaults, OmegaConf.create(OmegaConf.to_container(OmegaConf.create(cfg))))
