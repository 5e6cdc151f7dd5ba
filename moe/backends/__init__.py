"""Backends, keyed by `hardware.strategy`: the only place that branches on the hardware.

`build_backend(cfg, dims)` imports the chosen backend (and its library) only when a run
builds it; `moe.config.specs` says what each can do without importing any of them, and
`moe.backends.base.Backend` is the contract they all implement.
"""
from __future__ import annotations


def build_backend(cfg, dims):
    """The backend of cfg.hardware.strategy (a name moe.config.validate has checked against SPECS)."""
    name = cfg.hardware.strategy
    if name == "ddp":
        from moe.backends.ddp import DDPBackend as backend_class
    elif name == "deepspeed":
        from moe.backends.deepspeed import DeepSpeedBackend as backend_class
    elif name == "fsdp2":
        from moe.backends.fsdp2 import FSDP2Backend as backend_class
    else:
        from moe.backends.neuron import NeuronBackend as backend_class
    return backend_class(cfg, dims)


def single_process_module(cfg):
    """A LitMoE built on its own, eagerly, in one process (tests, tools), with DDP's one-rank backend;
    `cfg` a config or the plain dict a checkpoint stores."""
    from omegaconf import OmegaConf

    from moe.backends.ddp import DDPBackend
    from moe.module import LitMoE
    from moe.parallel.dims import ParallelDims

    cfg = OmegaConf.create(cfg)
    return LitMoE(cfg, DDPBackend(cfg, ParallelDims.from_config(cfg)))


__all__ = ["build_backend", "single_process_module"]
