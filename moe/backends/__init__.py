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


__all__ = ["build_backend"]
