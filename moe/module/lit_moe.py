"""LitMoE: the LightningModule that trains `moe.model.MoETransformer` on DDP, DeepSpeed and FSDP2.

The objective is moe.model.loss's (CE + every MoE layer's router terms), the optimizer and
schedule moe.module.optim's; how the model is spread over devices is the backend's business
(moe/backends), which parallelises it in `configure_model` and handles what is special about
its gradients and checkpoints through the hooks below. The Neuron backend trains the same
model, loss and optimizer groups through its own NxD module (moe/backends/neuron/module.py).

One optimizer step, in the order Lightning runs it (each line: where it lives):

    1. seed            StepSeed.on_train_batch_start: torch reseeded per micro-batch (router jitter)
    2. forward         training_step: routing statistics only where read (monitor_routing, logs_step),
                       the model's loss (moe.model.loss: CE + router terms), StepStats.add; a pipelined
                       model runs steps 2-3 of every micro-batch inside the schedule (PipelinedSteps)
    3. backward        backward (Lightning's, DDP/FSDP2/DeepSpeed reduce as their strategies do), then
                       on_after_backward -> Backend.after_backward (DDP with EP: the expert gradients over
                       expert-DP; 16-mixed: unscale); steps 1-3 repeat for accumulate_grad_batches
    4. grad norm       RunMetrics.on_before_optimizer_step -> grad_norm (once a step: metrics, guard, clip)
    5. guard           SpikeGuard.on_before_optimizer_step: a spike skips the update or rolls back
    6. clip            clip_gradients -> Backend.clip_gradients (the global norm), else Lightning's
    7. step            optimizer_step: AdamW, the LR schedule, then the expert bias update (aux-loss-free)
    8. metrics         RunMetrics.on_train_batch_end: on a logged step, one reduce of StepStats over the
                       ranks and a metrics.csv row; else nothing read back
    9. checkpoint      StepCheckpoint / PreemptionCheckpoint.on_train_batch_end: the format the backend
                       declares saves it (moe.checkpoint.formats, atomic; moe.backends.checkpoints)
"""
from __future__ import annotations

import itertools

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from moe.model.model import ModelOutput, MoETransformer
from moe.module.optim import build_optimizer, build_scheduler
from moe.module.step_stats import StepStats, logs_step
from moe.parallel.apply import clear_replays, moe_layers


class LitMoE(L.LightningModule):
    def __init__(self, cfg: DictConfig, backend, on_meta: bool = False):
        """backend: the run's (moe.backends.build_backend; moe.backends.single_process_module builds a
        module on its own). on_meta: build the model on the meta device (no storage); the backend's
        `parallelize` materialises this rank's shard in `configure_model` (Backend.build_module)."""
        super().__init__()
        container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        self.save_hyperparameters({"cfg": container})
        self.cfg = OmegaConf.create(container)
        self.backend = backend
        with torch.device("meta" if on_meta else "cpu"):
            self.model = MoETransformer(self.cfg.model, self.cfg.moe_opt, init_seed=self.cfg.seed)
        self.step_stats, self.val_stats = StepStats(), StepStats()
        self._parallelized = False
        self._expert_bias = None  # moe.module.expert_bias.ExpertBiasUpdate, made at the first step
        self.pipelined = None  # moe.module.pipelined.PipelinedSteps, set by a backend that pipelines
        self._grad_norm = None  # this step's, once computed (grad_norm)

    def configure_model(self) -> None:
        """Parallelise once the process group exists, before the strategy wraps the model."""
        if not self._parallelized:
            self.backend.shorten_world_timeout()
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

    def losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, ModelOutput]:
        """(training loss, LM loss, model output) for one micro-batch."""
        out = self.model(batch["input_ids"], labels_BS=batch["labels"])  # chunked LM head + CE
        return out.lm_loss + out.router_loss, out.lm_loss, out

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        clear_replays(self.model)
        self.monitor_routing(logs_step(self.trainer.global_step + 1, self.cfg.trainer.log_every_n_steps,
                                       self.trainer.max_steps))
        if self.pipelined is not None:
            return self.pipelined.training_step(self, batch)
        loss, lm, out = self.losses(batch)
        self.step_stats.add(loss=loss, lm_loss=lm, routing=out.routing, tokens=batch["input_ids"].numel())
        self.count_expert_picks(out.routing)
        self.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=batch["input_ids"].shape[0])
        return loss

    def monitor_routing(self, on: bool) -> None:
        """Whether the MoE layers compute their drop, load and entropy numbers: only for a step that
        metrics.csv logs (the losses and the expert bias get what they read either way)."""
        for layer in moe_layers(self.model):
            layer.monitor = on

    def count_expert_picks(self, routing: list) -> None:
        """One micro-batch's picks per expert, for the aux-loss-free balancing (moe.module.expert_bias)."""
        if self.cfg.moe_opt.enable_expert_bias:
            if self._expert_bias is None:
                from moe.module.expert_bias import ExpertBiasUpdate

                self._expert_bias = ExpertBiasUpdate(self.model, self.cfg.moe_opt.bias_update_rate)
            self._expert_bias.add(routing)

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """A pipelined step has run its backward inside training_step (the schedule's)."""
        if self.pipelined is None:
            super().backward(loss, *args, **kwargs)

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.monitor_routing(False)  # validation reads the LM loss alone
        if self.pipelined is not None:
            return self.pipelined.validation_step(self, batch)
        _, lm, _ = self.losses(batch)
        self.val_stats.add_losses(lm, lm)  # RunMetrics sums it over ranks for metrics.csv
        self.log("val_loss", lm, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return lm

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.cfg.optimizer)
        self.backend.prepare_optimizer(optimizer)  # before the schedule captures the param groups
        scheduler = build_scheduler(optimizer, self.cfg.optimizer, self.cfg.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_step(self, *args, **kwargs) -> None:
        """The optimizer step, then the aux-loss-free balancing bias update (moe.module.expert_bias)."""
        super().optimizer_step(*args, **kwargs)
        if self._expert_bias is not None:
            # every rank of the stage holds these layers (under pipelining, other stages hold others)
            self._expert_bias.step(lambda t: self.backend.all_reduce(self, t, "sum", stage_only=True))

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients before clipping (expert shards summed over the EP group), on the
        CPU; computed once per optimizer step and read by the metrics, the spike guard and the clipping
        (each computation is a pass over every gradient, a collective and a host sync)."""
        if self._grad_norm is None:
            self._grad_norm = self.backend.grad_norm(self)
        return self._grad_norm

    # -- what the backend does around the step and in checkpoints -------------------------------------
    def on_after_backward(self) -> None:
        self._grad_norm = None  # the gradients changed
        self.backend.after_backward(self)

    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        norm_clip = gradient_clip_val and gradient_clip_algorithm != "value"
        if not (norm_clip and self.backend.clip_gradients(self, optimizer, float(gradient_clip_val))):
            super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.backend.on_save_checkpoint(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self._trainer is not None:  # schedulers exist when the strategy restores after setup
            from moe.module.optim import fit_scheduler_states

            schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
            fit_scheduler_states(checkpoint, schedulers, self.cfg.optimizer, self.cfg.trainer.max_steps)
        self.backend.on_load_checkpoint(self, checkpoint)

    def on_fit_start(self) -> None:
        self.backend.on_fit_start(self)
