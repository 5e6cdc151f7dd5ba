"""A callback train.py instantiates in a test (`+callbacks.gc_probe._target_=tests._gc_probe.GcProbe`): it
records whether Python's collector is on as each batch starts, and each collection of the older
generations: (the batch it ran in, None before the first, and its generation)."""
from __future__ import annotations

import gc

import lightning as L

SEEN: dict[str, list] = {"enabled": [], "collected_in": []}


class GcProbe(L.Callback):
    def __init__(self):
        self.batch = None
        SEEN["enabled"].clear()
        SEEN["collected_in"].clear()

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] >= 1:
            SEEN["collected_in"].append((self.batch, info["generation"]))

    def on_train_start(self, trainer, pl_module) -> None:
        gc.callbacks.append(self._on_collect)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch = batch_idx
        SEEN["enabled"].append(gc.isenabled())

    def on_train_end(self, trainer, pl_module) -> None:
        gc.callbacks.remove(self._on_collect)
