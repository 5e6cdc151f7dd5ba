"""StepCheckpoint: Lightning's ModelCheckpoint at optimizer-step boundaries, `last.ckpt` an atomic link.

What it writes goes through the strategy's CheckpointIO (moe.checkpoint.lightning_io, or a backend's
own); what a relaunch resumes from is moe.checkpoint.picker's choice.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from moe.checkpoint.io import META_SUFFIX, TMP_SUFFIX, fsync_dir, remove


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, saving only at optimizer-step boundaries, and the final step too.

    Two Lightning 2.6 behaviours break an exact resume with gradient accumulation:
    - `_last_global_step_saved` is not restored, so a run resumed at step N (N a multiple of
      every_n_train_steps) saves step N again after its first micro-batch, mid-accumulation: that
      checkpoint drops the accumulated gradient, and resuming from it replays a different step.
      Here a batch end that did not complete an optimizer step never saves.
    - With a monitor set, the save of an epoch's last batch waits for a validation pass that, with
      `check_val_every_n_epoch=None`, may never come: a finished run's last.ckpt would stop short
      of max_steps. Here the run's end saves whatever step was not saved yet.
    """

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._step_seen = trainer.global_step

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        """Point `last.ckpt` at the newest step atomically: a new link renamed over the old one.
        Lightning's own (model_checkpoint.py:610-622) removes the old link first, and a kill between
        the two would leave no last.ckpt."""
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link = Path(linkpath)
            if link.is_dir() and not link.is_symlink():  # a sharded last.ckpt saved as a directory
                shutil.rmtree(link)
            remove(link.with_name(link.name + META_SUFFIX))  # a full copy's sidecar (older runs)
            tmp = link.with_name(link.name + ".link" + TMP_SUFFIX)
            remove(tmp)
            os.symlink(os.path.relpath(filepath, link.parent), tmp)
            os.replace(tmp, link)
            fsync_dir(link.parent)
        trainer.strategy.barrier()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == getattr(self, "_step_seen", None):
            return  # accumulating micro-batches: no optimizer step ended here
        self._step_seen = trainer.global_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        done = self._last_global_step_saved == trainer.global_step
        if not done and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)
