"""StepCheckpoint: the run's checkpoints, at optimizer steps, through Lightning's public save.

Every `checkpoint_every_n_steps` steps, at the run's end and when pre-emption asks (`save`), each rank calls
`trainer.save_checkpoint(checkpoints/step-NNNNNN.ckpt)`: the strategy writes the format its backend declares
(moe.checkpoint.formats, atomic, through moe.backends.checkpoints or moe.checkpoint.lightning_io). Then the
newest `keep` are kept (the format removes the rest: sidecars and ZeRO partitions with the file) and
`last.ckpt` is pointed at the newest, atomically. What a relaunch resumes from is moe.checkpoint.picker's
choice. Lightning's ModelCheckpoint is not used: under manual optimization (moe.module.train_step) it saves
through a path written for one test model and warns at every save (callbacks/model_checkpoint.py
on_train_batch_end, Lightning 2.6).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from moe.checkpoint.formats import candidates, step_hint
from moe.checkpoint.io import META_SUFFIX, TMP_SUFFIX, fsync_dir, remove

LAST = "last.ckpt"


def step_name(step: int) -> str:
    return f"step-{step:06d}.ckpt"


class StepCheckpoint(Callback):
    """`keep`: the newest steps kept (None: every one, or the format prunes itself, NxD); `link_last`:
    whether last.ckpt names the newest."""

    def __init__(self, dirpath: str | Path, every_n_steps: int, keep: int | None, link_last: bool):
        self.dirpath, self.every_n_steps = Path(dirpath), every_n_steps
        self.keep, self.link_last = keep, link_last
        self.saved_step: int | None = None  # the step whose checkpoint this run saved or resumed from

    def on_train_start(self, trainer, pl_module) -> None:
        self.saved_step = trainer.global_step if trainer.ckpt_path else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps > 0 and trainer.global_step % self.every_n_steps == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save(trainer)  # the final step, unless it was just saved

    def save(self, trainer) -> None:
        """Checkpoint the step just taken (collective; once per step)."""
        step = trainer.global_step
        if self.saved_step == step:
            return
        path = self.dirpath / step_name(step)
        trainer.save_checkpoint(path)
        self.saved_step = step
        if trainer.is_global_zero:
            if self.link_last:
                link_atomically(path, self.dirpath / LAST)
            if self.keep is not None and self.keep >= 0:
                self._remove_older(trainer, keep=max(self.keep, 1))
        trainer.strategy.barrier("step_checkpoint")

    def _remove_older(self, trainer, keep: int) -> None:
        """All but the newest `keep` step checkpoints of the folder (this run's, and an earlier run's it
        resumed), removed with what belongs to each (the strategy's format)."""
        steps = sorted((p for p in candidates(self.dirpath) if p.name.startswith("step-")), key=step_hint)
        for path in steps[:-keep]:
            trainer.strategy.remove_checkpoint(path)


def link_atomically(target: Path, link: Path) -> None:
    """Point `link` at `target` with a new link renamed over the old one: a kill in between leaves the
    old link (Lightning's own removes it first, model_checkpoint.py:610-622)."""
    if link.is_dir() and not link.is_symlink():  # a sharded last.ckpt saved as a directory (older runs)
        shutil.rmtree(link)
    remove(link.with_name(link.name + META_SUFFIX))  # a full copy's sidecar (older runs)
    tmp = link.with_name(link.name + ".link" + TMP_SUFFIX)
    remove(tmp)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)
