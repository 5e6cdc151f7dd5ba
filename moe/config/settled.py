"""The run's config once settled: the schema's dataclasses (moe.config.schema), frozen.

Hydra composes an OmegaConf config, typed by the schema at composition; the run sets what it derives in
a copy of it (moe.train.run.settle: an HF directory's architecture, prepared data's seq_len), validates the
copy and freezes it, once (moe.config.schema.freeze). Everything after reads these objects, section by
section: assigning to a field raises (dataclasses.FrozenInstanceError), and a changed config is a new
object (`replaced`). A checkpoint stores `as_container`'s plain dict, which `settled_config` reads back
(older ones through moe.config.upgrade).
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf

from moe.config.schema import Section, TrainConfig, freeze

S = TypeVar("S", bound=Section)


def settled_config(cfg) -> TrainConfig:
    """`cfg` as frozen dataclasses: the composed config, a config already settled (returned as is), or the
    plain dict a checkpoint stores (keys it lacks get today's defaults)."""
    if isinstance(cfg, TrainConfig):
        return cfg if cfg.__dict__.get("_frozen") else freeze(cfg)
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is TrainConfig:
        return freeze(OmegaConf.to_object(cfg))
    from moe.config.upgrade import with_schema_defaults

    return freeze(OmegaConf.to_object(with_schema_defaults(cfg)))


def replaced(section: S, **changes) -> S:
    """A frozen copy of `section` with `changes`: how a settled config changes."""
    return freeze(dataclasses.replace(section, **changes))


def as_container(cfg: Section) -> dict:
    """The plain dict a checkpoint stores (weights-only loading reads it back)."""
    return dataclasses.asdict(cfg)


def section_values(section) -> dict:
    """A section's keys and values, settled (a dataclass) or still composing (an OmegaConf node)."""
    if isinstance(section, Section):
        return dataclasses.asdict(section)
    return OmegaConf.to_container(section, resolve=True)


def value_at(cfg: Section, dotted: str):
    """The value of `dotted` ("trainer.max_steps") in `cfg`."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
