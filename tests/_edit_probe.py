"""A callback train.py instantiates in a test (`+callbacks.edit._target_=tests._edit_probe.ConfigEditProbe`):
as training starts it tries to edit the run's config where a step or a callback reads it (the module's
and the backend's), and records what each try raised."""
from __future__ import annotations

import lightning as L

TRIED: dict[str, str] = {}


class ConfigEditProbe(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        for where, cfg in (("module", pl_module.cfg), ("backend", pl_module.backend.cfg)):
            try:
                cfg.trainer.max_steps = 1
                TRIED[where] = "edited"
            except Exception as err:  # noqa: BLE001  (what was raised is the result)
                TRIED[where] = type(err).__name__
