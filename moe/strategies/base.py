"""What every strategy builder returns: everything Trainer needs from the hardware group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StrategyBundle:
    accelerator: str
    strategy: Any  # a Lightning Strategy instance or a registry name such as "auto"
    precision: str
    plugins: list = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set before the accelerator starts
    num_threads: int | None = None  # intra-op threads per process (CPU: cores shared by ranks)
