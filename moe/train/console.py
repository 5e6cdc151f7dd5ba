"""What a training run prints, and what train.log keeps.

Hydra gives the root logger two handlers: the console (stdout) and `<run dir>/train.log`.
- Lightning's lines are printed once, through Hydra's handlers: its package loggers' own stderr
  handlers are removed and propagation restored (LIGHTNING_LOGGERS).
- One line per logged optimizer step (`step 40/300 loss ... lr ... tok/s ... drop ...`) always goes
  to train.log, and to the console when no progress bar is drawn (SLURM logs, pipes, CI).
- The progress bar, drawn only on a terminal, counts optimizer steps out of trainer.max_steps
  (Lightning's counts batches of an epoch: "Epoch 0/-2", "50/20" with accumulation).
- Errors reach train.log as well as stderr (moe.errors.log_to_files).
"""
from __future__ import annotations

import logging
import math
import sys
import warnings

from lightning.pytorch.callbacks import RichProgressBar

from moe.errors import log_to_files

STEP_LOGGER = "moe.train.steps"
# Lightning's package loggers that install a stderr handler of their own: `lightning` always
# (lightning/__init__.py:9-14); `lightning.pytorch` and `lightning.fabric`, with propagation off,
# when imported before Hydra has configured the root logger (lightning/pytorch/__init__.py:16-23)
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


def bar_shown(progress_bar: bool) -> bool:
    """A bar only where someone watches a terminal; elsewhere its redraws are noise in a log file."""
    return progress_bar and sys.stdout.isatty()


def configure_output(progress_bar: bool) -> None:
    """Route Lightning's and the run's lines as the module docstring says (idempotent)."""
    root = logging.getLogger()
    if root.handlers:  # Hydra's: stdout + train.log
        for name in LIGHTNING_LOGGERS:
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:
                    logger.removeHandler(handler)
            logger.propagate = True
    steps = logging.getLogger(STEP_LOGGER)
    steps.setLevel(logging.INFO)
    for old in [f for f in steps.filters if isinstance(f, _FilesOnly)]:
        steps.removeFilter(old)
    if bar_shown(progress_bar):
        steps.addFilter(_FilesOnly())
    quiet_known_noise()


class _FilesOnly(logging.Filter):
    """Sends a step line to the log files itself and stops it before the console handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
                handler.handle(record)
        return False


def step_line(row: dict, max_steps: int) -> str:
    """`step 40/300 loss 4.9731 lr 3.00e-04 tok/s 4733 drop 2.1% grad_norm 0.947`: what a cluster user
    scans a log for; `-` where a value is missing or not finite."""
    def number(key: str, spec: str) -> str:
        value = row.get(key)
        return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "-"

    drop = row.get("drop_fraction")
    drop_text = f"{100 * drop:.1f}%" if isinstance(drop, (int, float)) and math.isfinite(drop) else "-"
    return (f"step {row['step']}/{max_steps} loss {number('loss', '.4f')} lr {number('lr', '.2e')} "
            f"tok/s {number('tokens_per_s', '.0f')} drop {drop_text} grad_norm {number('grad_norm', '.3f')}")


def say(message: str) -> None:
    """A run message (a note, the checkpoint resumed from, the run dir): on stdout and in train.log."""
    print(message, flush=True)
    log_to_files(message, logging.INFO)


def log_step(row: dict, max_steps: int) -> None:
    logging.getLogger(STEP_LOGGER).info(step_line(row, max_steps))


class StepProgressBar(RichProgressBar):
    """Rich's bar over optimizer steps (a training batch is one, moe.module.train_step): `step 40/300`,
    resumed runs starting where they left off."""

    def _get_train_description(self, current_epoch: int) -> str:  # private: Rich's bar names it nowhere else
        return "step"


class _DropAdvert(logging.Filter):
    """Lightning 2.6 logs a litlogger advert at every Trainer start (logger_connector.py:90-92)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_known_noise() -> None:
    """Lines that tell a cluster user nothing: Lightning's litlogger tip, torch 2.13's deprecation
    of `isinstance(treespec, LeafSpec)` raised from inside Lightning's own _pytree.py."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvert) for f in rank_zero.filters):  # train() may run many times
        rank_zero.addFilter(_DropAdvert())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
