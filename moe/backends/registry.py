"""Every backend, keyed by `hardware.strategy`: what the shared code asks of one without naming it.

Each backend's package holds its spec (what it can do, `spec.py`) and the refusals of its library
(`rules.py`), both leaf modules that import no torch, Lightning or library, so the validator, the planner
and a dry run read them without building anything; its Backend class (`backend.py`) is imported only when
a run builds it (moe.backends.build_backend, by the spec's `backend` path).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe.backends.ddp import spec as ddp
from moe.backends.deepspeed import spec as deepspeed
from moe.backends.fsdp2 import rules as fsdp2_rules
from moe.backends.fsdp2 import spec as fsdp2
from moe.backends.neuron import rules as neuron_rules
from moe.backends.neuron import spec as neuron
from moe.config.specs import BackendSpec


@dataclass(frozen=True)
class Registered:
    spec: BackendSpec
    # what its library refuses beyond the spec, with the fix: a rule of moe.config.validate's table, called
    # with what its parameters name (moe.config.validate); None: its spec says it all
    rules: Callable[..., None] | None = None


BACKENDS: dict[str, Registered] = {registered.spec.name: registered for registered in (
    Registered(ddp.SPEC),
    Registered(deepspeed.SPEC),
    Registered(fsdp2.SPEC, fsdp2_rules.check_fsdp2),
    Registered(neuron.SPEC, neuron_rules.check_neuron),
)}
SPECS: dict[str, BackendSpec] = {name: registered.spec for name, registered in BACKENDS.items()}


def spec_of(hardware) -> BackendSpec:
    """The spec of hardware.strategy (validate has checked the name)."""
    return SPECS[hardware.strategy]
