"""A callback train.py instantiates in a test (`+callbacks.val_probe._target_=tests._val_probe.ValLossProbe`):
each rank writes the `val_loss` Lightning's loggers and callbacks got (trainer.callback_metrics) to
`<path>.<rank>.json`, one value per validation pass."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L


class ValLossProbe(L.Callback):
    def __init__(self, path: str):
        self.path, self.seen = path, []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.seen.append(float(trainer.callback_metrics["val_loss"]))
        Path(f"{self.path}.{trainer.global_rank}.json").write_text(json.dumps(self.seen))
