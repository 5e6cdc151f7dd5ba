"""One strategy factory keyed by `hardware.strategy`: the only place that branches on hardware."""
from __future__ import annotations

from moe.strategies.base import StrategyBundle
from moe.strategies.cpu_ddp import build_ddp

BUILDERS = {"ddp": build_ddp}


def build_strategy(cfg) -> StrategyBundle:
    """hardware group -> Lightning strategy, precision, plugins and environment variables."""
    from moe.errors import ConfigError

    name = cfg.hardware.strategy
    if name not in BUILDERS:
        raise ConfigError("hardware.strategy", name, f"use one of {sorted(BUILDERS)}",
                          problem="is not a known strategy")
    return BUILDERS[name](cfg)


__all__ = ["StrategyBundle", "build_strategy"]
