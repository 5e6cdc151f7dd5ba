"""Python's garbage collector kept out of the training step (trainer.gc_every_n_steps).

The automatic collector runs whenever allocations pass a threshold, so a full collection can land inside a
step, where its pause (tens of milliseconds in a big process) leaves the accelerator idle and, with many
ranks, stalls every peer at the next collective. Megatron's `--manual-gc` and torchtitan's `gc_freq` turn it
off and collect between steps instead, on every rank at the same step; this callback does the same.
"""
from __future__ import annotations

import gc

import lightning as L


class StepGarbageCollection(L.Callback):
    """Automatic collection off while the run trains; a young-generation collection after every
    `every_n_steps` optimizer steps, a full one at the start and the end (torchtitan's GarbageCollection)."""

    def __init__(self, every_n_steps: int):
        self.every_n_steps = every_n_steps
        self._was_enabled = gc.isenabled()

    def on_train_start(self, trainer, pl_module) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps == 0:  # a batch is one optimizer step (moe.module)
            gc.collect(1)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
        gc.collect()
