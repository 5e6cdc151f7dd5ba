"""Backends, keyed by `hardware.strategy`: the only place that branches on the hardware.

Each backend is one package (ddp/, deepspeed/, fsdp2/, neuron/): its spec, its library's refusals and
what its machine needs, readable without its library, and its Backend. `moe.backends.registry` lists
them for the shared code (validation, planning, the environment check), `build_backend(cfg, dims)`
imports the chosen Backend (and its library) only when a run builds it, and `moe.backends.base.Backend`
is the contract they all implement.
"""
from __future__ import annotations


def backend_class(hardware):
    """The Backend subclass of hardware.strategy (a name moe.config.validate has checked against
    moe.backends.registry.SPECS), imported from its spec's `backend` path: its library is imported only
    when a run builds it."""
    import importlib

    from moe.backends.registry import spec_of

    module, name = spec_of(hardware).backend.split(":")
    return getattr(importlib.import_module(module), name)


def build_backend(cfg, dims):
    """The backend of cfg.hardware.strategy, built for this run."""
    return backend_class(cfg.hardware)(cfg, dims)

__all__ = ["backend_class", "build_backend"]
