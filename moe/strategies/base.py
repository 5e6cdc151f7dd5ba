"""What every strategy builder returns: everything Trainer needs from the hardware group."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StrategyBundle:
    accelerator: str
    strategy: Any  # a Lightning Strategy instance or a registry name such as "auto"
    precision: str | None  # None when a precision plugin in `plugins` sets it (Neuron)
    plugins: list = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set before the accelerator starts
    num_threads: int | None = None  # intra-op threads per process (CPU: cores shared by ranks)
    # The LightningModule to train, `module_factory(cfg)`; None = moe.lit_module.LitMoE.
    # Neuron builds its model through NxD (initialize_parallel_model) in a NeuronLTModule.
    module_factory: Callable[[Any], Any] | None = None
    # Trainer arguments this strategy must override (Neuron: manual optimization, so Lightning's
    # own accumulation and clipping are off; NxD's optimizer accumulates and clips).
    trainer_overrides: dict[str, Any] = field(default_factory=dict)
