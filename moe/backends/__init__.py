"""Backends, keyed by `hardware.strategy`: the only place that branches on the hardware.

`build_backend(cfg, dims)` imports the chosen backend (and its library) only when a run
builds it; `moe.config.specs` says what each can do without importing any of them (and where its
class lives), and `moe.backends.base.Backend` is the contract they all implement.
"""
from __future__ import annotations


def backend_class(hardware):
    """The Backend subclass of hardware.strategy (a name moe.config.validate has checked against SPECS),
    imported from its spec's `backend` path: its library is imported only when a run builds it."""
    import importlib

    from moe.config.specs import spec_of

    module, name = spec_of(hardware).backend.split(":")
    return getattr(importlib.import_module(module), name)


def build_backend(cfg, dims):
    """The backend of cfg.hardware.strategy, built for this run."""
    return backend_class(cfg.hardware)(cfg, dims)

__all__ = ["backend_class", "build_backend"]
