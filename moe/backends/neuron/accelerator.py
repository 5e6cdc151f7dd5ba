"""What a trn1 run needs installed (hardware.accelerator=neuron): neuronx-distributed and torch-xla, checked
before anything is built (moe.backends.accelerators)."""
from __future__ import annotations

import importlib.util

from moe.errors import ConfigError


def check_installed(hardware) -> None:
    from moe.backends.neuron.backend import INSTALL_HINT, NOT_INSTALLED

    missing = [p for p in ("neuronx_distributed", "torch_xla") if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError("hardware", hardware.name, INSTALL_HINT,
                          problem=f"{NOT_INSTALLED} (no module {', '.join(missing)})")
