"""One strategy factory keyed by `hardware.strategy`: the only place that branches on hardware."""
from __future__ import annotations

from moe.strategies.base import StrategyBundle


def _ddp(cfg) -> StrategyBundle:
    from moe.strategies.cpu_ddp import build_ddp

    return build_ddp(cfg)


def _deepspeed(cfg) -> StrategyBundle:
    from moe.strategies.deepspeed import build_deepspeed

    return build_deepspeed(cfg)


def _neuron(cfg) -> StrategyBundle:
    from moe.strategies.neuron import build_neuron

    return build_neuron(cfg)


BUILDERS = {"ddp": _ddp, "deepspeed": _deepspeed, "neuron": _neuron}


def build_strategy(cfg) -> StrategyBundle:
    """hardware group -> Lightning strategy, precision, plugins and environment variables."""
    from moe.errors import ConfigError

    name = cfg.hardware.strategy
    if name not in BUILDERS:
        raise ConfigError("hardware.strategy", name, f"use one of {sorted(BUILDERS)}",
                          problem="is not a known strategy")
    return BUILDERS[name](cfg)


__all__ = ["BUILDERS", "StrategyBundle", "build_strategy"]
