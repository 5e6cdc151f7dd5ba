"""What LitMoE (lit_moe.py) and NeuronLitMoE (moe/backends/neuron/module.py) share, written once: the run's
config and backend, the optimizer step (moe.module.train_step.TrainStep, which drives either through its
`StepModule` contract), the validation loss over every rank, and a checkpoint's loop counters as today's run
counts them. Each module adds its model, its loss and its optimizer: Lightning's or NxD's.
"""
from __future__ import annotations

import math

from moe.config.schema import TrainConfig
from moe.config.settled import as_container
from moe.module.step_stats import StepStats, validation_loss
from moe.module.train_step import TrainStep, upgrade_loop_state


class SharedHooks:
    """Mixed into a LightningModule (first among its bases); `train_on` completes its __init__."""

    def train_on(self, backend, guard=None) -> None:
        """backend: the run's (moe.backends.build_backend), whose config the module reads: one config per run,
        held by the backend. guard: the run's spike guard (moe.train.guard.SpikeGuard), which the step asks;
        None: none."""
        self.automatic_optimization = False  # the step is ours: moe.module.train_step
        self.cfg: TrainConfig = backend.cfg  # the run's settled config (frozen dataclasses): read, not edited
        self.backend = backend
        self.save_hyperparameters({"cfg": as_container(self.cfg)})
        self.val_stats = StepStats()  # the validation pass's sums, over every rank at its end
        self.val_loss = math.nan  # the last validation pass's, over every rank
        self.schedule = None  # a pipeline's (moe.module.pipelined, NxD's), set where the model is pipelined
        self.train_step = TrainStep(self, backend, guard)

    def training_step(self, rows: dict, batch_idx: int):
        """One optimizer step over this rank's rows of it (moe.module.train_step)."""
        return self.train_step(rows)

    def on_validation_epoch_end(self) -> None:
        """`val_loss`: the mean LM loss over every rank's batches, as metrics.csv has it."""
        self.val_loss = validation_loss(self)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        upgrade_loop_state(checkpoint)  # before Lightning restores its loops from it
