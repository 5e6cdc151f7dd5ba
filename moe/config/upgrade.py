"""A config an older version saved (a checkpoint's `hyper_parameters["cfg"]`), read under today's schema.

The one place such a config is upgraded: the keys it lacks get the schema's defaults (moe.config.schema),
so no other code restates a default for a key that might be missing; keys a newer version dropped are left
out (nothing reads them).
"""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from moe.config.schema import Section, TrainConfig


def with_schema_defaults(cfg) -> DictConfig:
    """`cfg` (a config or the plain dict a checkpoint stores) as a config typed by today's schema, with every
    key it has."""
    values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), known_keys(values, TrainConfig))


def known_keys(values: dict, schema: type[Section]) -> dict:
    """`values` without the keys `schema` no longer has (a section's free-form dicts kept whole)."""
    fields = {item.name: item for item in dataclasses.fields(schema)}
    kept = {}
    for key, value in values.items():
        if key not in fields:
            continue
        factory = fields[key].default_factory
        is_section = isinstance(factory, type) and issubclass(factory, Section)
        kept[key] = known_keys(value, factory) if is_section and isinstance(value, dict) else value
    return kept
