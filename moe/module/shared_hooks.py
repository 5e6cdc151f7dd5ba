"""What LitMoE (lit_moe.py) and NeuronLitMoE (moe/backends/neuron/module.py) share, written once: the run's
config and backend, the optimizer step (moe.module.train_step.TrainStep, which drives either through its
`StepModule` contract), the validation loss over every rank, and a checkpoint's loop counters as today's run
counts them. Each module adds its model, its loss and its optimizer: Lightning's or NxD's.
"""
from __future__ import annotations

import math

import torch

from moe.config.schema import TrainConfig, source_label
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
        # a mixture's (data.sources): each source's LM-loss sum and micro-batch count this pass, on this rank
        self.val_sources = [source_label(s) for s in self.cfg.data.sources or []]
        self.val_source_sums = [[0.0, 0] for _ in self.val_sources]
        self.val_source_losses: dict[str, float] = {}  # the last pass's, over every rank, by source name
        self._val_before = (0.0, 0)
        self.schedule = None  # a pipeline's (moe.module.pipelined, NxD's), set where the model is pipelined
        self.train_step = TrainStep(self, backend, guard)

    def training_step(self, rows: dict, batch_idx: int):
        """One optimizer step over this rank's rows of it (moe.module.train_step)."""
        return self.train_step(rows)

    def on_validation_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._val_before = (self.val_stats.sums["lm_loss"], self.val_stats.lm_count)

    def on_validation_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        """A mixture's batch (one source's, moe.data.datamodule.BlockBatches): the LM losses the step added to
        val_stats, whichever path added them (a pipeline's, NxD's), go to its source too."""
        if isinstance(batch, dict) and "source" in batch:
            total, count = self._val_before
            sums = self.val_source_sums[int(batch["source"])]
            sums[0] = sums[0] + (self.val_stats.sums["lm_loss"] - total)
            sums[1] += self.val_stats.lm_count - count

    def on_validation_epoch_end(self) -> None:
        """`val_loss`: the mean LM loss over every rank's batches, as metrics.csv has it; a mixture's
        `val_source_losses` the same per source (one more sum-reduce)."""
        self.val_loss = validation_loss(self)
        if self.val_sources:
            sums = torch.stack([torch.as_tensor(s, dtype=torch.float32).reshape(()).cpu()
                                for s, _ in self.val_source_sums])
            counts = torch.tensor([c for _, c in self.val_source_sums], dtype=torch.float32)
            totals = self.backend.all_reduce(self, torch.cat([sums, counts]), "sum").tolist()
            k = len(self.val_sources)
            self.val_source_losses = {name: totals[i] / totals[k + i] if totals[k + i] else math.nan
                                      for i, name in enumerate(self.val_sources)}
            self.val_source_sums = [[0.0, 0] for _ in self.val_sources]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        upgrade_loop_state(checkpoint)  # before Lightning restores its loops from it
