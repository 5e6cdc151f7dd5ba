"""LitMoE: the LightningModule that trains `moe.model.MoETransformer` on DDP, DeepSpeed and FSDP2.

Its training_step is one optimizer step, moe.module.train_step.TrainStep (manual optimization: Lightning
hands it one step's rows; what it shares with NeuronLitMoE is moe.module.shared_hooks); the objective is
the model's `ModelOutput.loss` (CE + every MoE layer's router terms + the weighted multi-token-prediction
loss), the optimizer and schedule moe.module.optim's; how the model is spread over devices is the
backend's business (moe/backends), which parallelises it in `configure_model` and answers what differs
by hardware inside the step and in checkpoints. The Neuron backend trains the same model, loss, optimizer
groups and step through its own NxD module (moe/backends/neuron/module.py).
"""
from __future__ import annotations

import itertools
import math

import lightning as L
import torch

from moe.model.documents import packed_documents
from moe.model.model import ModelOutput, MoETransformer
from moe.module.optim import build_optimizer, build_scheduler
from moe.module.shared_hooks import SharedHooks
from moe.parallel.apply import moe_layers
from moe.parallel.comm import apply_collective_timeout
from moe.ranks import trainer_of


class LitMoE(SharedHooks, L.LightningModule):
    def __init__(self, backend, on_meta: bool = False, guard=None):
        """backend: the run's (moe.backends.build_backend; `LitMoE(DDPBackend(cfg, dims))` is a module on
        its own, in one process). on_meta: build the model on the meta device (no storage); the backend's
        `parallelize` materialises this rank's shard in `configure_model` (Backend.build_module). guard: the
        run's spike guard, which the step asks; None: none (moe.module.shared_hooks)."""
        super().__init__()
        self.train_on(backend, guard)
        with torch.device("meta" if on_meta else "cpu"):
            self.model = MoETransformer(self.cfg.model, self.cfg.moe_opt, init_seed=self.cfg.seed)
        self._parallelized = False

    def configure_model(self) -> None:
        """Parallelise once the process group exists, before the strategy wraps the model."""
        if not self._parallelized:
            apply_collective_timeout(self.cfg.parallel.collective_timeout_s)  # every peer has joined
            self.backend.parallelize(self)
            self._parallelized = True

    def cpu(self):
        """Lightning's teardown moves the module to the CPU, also after a failure in setup, while the model
        may still be on the meta device: nothing to move there, and copying out of a meta tensor would raise
        over the failure's own error (the user would read "Cannot copy out of meta tensor")."""
        if any(t.device.type == "meta" for t in itertools.chain(self.parameters(), self.buffers())):
            return self
        return super().cpu()

    def forward(self, input_ids: torch.Tensor) -> ModelOutput:
        return self.model(input_ids)

    def micro_batch_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, list, torch.Tensor | None]:
        """(training loss, LM loss, each MoE layer's RoutingStats, multi-token-prediction loss or None) of one
        micro-batch."""
        out = self.model(batch["input_ids"], labels_BS=batch["labels"],  # chunked LM head + CE
                         documents=packed_documents(batch))
        return out.loss, out.lm_loss, out.routing, out.mtp_loss

    def training_step(self, rows: dict, batch_idx: int) -> torch.Tensor:
        """The step (SharedHooks), and its loss on the progress bar."""
        loss = super().training_step(rows, batch_idx)
        if self.trainer.progress_bar_callback is not None:  # only the bar reads it (2 ms a step on a CPU)
            self.log("loss", loss, prog_bar=True, logger=False, batch_size=self.cfg.trainer.micro_batch_size)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        for layer in moe_layers(self.model):  # validation reads the LM loss alone
            layer.monitor = False
        if self.schedule is not None:
            return self.schedule.validation_step(self, batch)
        out = self.model(batch["input_ids"], labels_BS=batch["labels"], documents=packed_documents(batch))
        self.val_stats.add_losses(out.lm_loss, out.lm_loss)  # summed over every rank at the pass's end
        return out.lm_loss

    def on_validation_epoch_end(self) -> None:
        """`val_loss` (SharedHooks) for the progress bar, loggers and callbacks (EarlyStopping) too. It is the
        same on every rank, so Lightning's mean over ranks (sync_dist, without which it warns in a
        multi-process run) keeps it."""
        super().on_validation_epoch_end()
        if not math.isnan(self.val_loss):
            self.log("val_loss", self.val_loss, prog_bar=True, sync_dist=True)
        for name, loss in self.val_source_losses.items():
            if not math.isnan(loss):
                self.log(f"val_loss/{name}", loss, sync_dist=True)

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.cfg.optimizer)
        self.backend.prepare_optimizer(optimizer)  # before the schedule captures the param groups
        scheduler = build_scheduler(optimizer, self.cfg.optimizer, self.cfg.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- what the backend does in checkpoints ------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.backend.on_save_checkpoint(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)  # the loop counters first (SharedHooks)
        if trainer_of(self) is not None:  # schedulers exist when the strategy restores after setup
            from moe.module.optim import fit_scheduler_states

            schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
            fit_scheduler_states(checkpoint, schedulers, self.cfg.optimizer, self.cfg.trainer.max_steps)
        self.backend.on_load_checkpoint(self, checkpoint)

    def on_fit_start(self) -> None:
        self.backend.on_fit_start(self)
