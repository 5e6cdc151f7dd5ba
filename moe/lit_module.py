"""LightningModule: loss = CE + sum over MoE layers of (aux_coeff * load-balance + z_coeff * z-loss).

The module owns the model, the loss and the optimizer; how the model is spread over
devices is the strategy's business (`moe.strategies`), which may call
`apply_parallelism` hooks before training starts.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from moe.model import MoETransformer
from moe.optim import build_optimizer, build_scheduler
from moe.parallel.expert_training import ExpertParallelHooks
from moe.step_stats import StepStats


def router_losses(routing: list, moe_opt) -> torch.Tensor | float:
    """Each MoE layer's load-balance and z-loss, weighted by its coefficient and summed over layers.

    As in Megatron-Core and DeepSpeed, the coefficient applies per layer, so a deeper model
    balances every layer as firmly as a shallow one (metrics.csv logs the per-layer mean).
    """
    return sum(moe_opt.aux_loss_coeff * r.aux_loss + moe_opt.z_loss_coeff * r.z_loss for r in routing)


class LitMoE(ExpertParallelHooks, L.LightningModule):
    """The training module; ExpertParallelHooks adds expert-gradient reduction, global-norm
    clipping and full-expert checkpoints when ep > 1."""

    def __init__(self, cfg: DictConfig):
        super().__init__()
        container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        self.save_hyperparameters({"cfg": container})
        self.cfg = OmegaConf.create(container)
        self.model = MoETransformer(self.cfg.model, self.cfg.moe_opt)
        self.step_stats = StepStats()

    def configure_model(self) -> None:
        """Apply parallelism after the process group exists and before the strategy wraps the model."""
        if getattr(self, "_parallel_applied", False):
            return
        from moe.parallel.apply import apply_ac, apply_compile
        from moe.parallel.expert_training import setup_expert_parallel

        par = self.cfg.parallel
        setup_expert_parallel(self, par.ep)  # no-op for ep == 1
        apply_ac(self.model, par.activation_checkpointing, par.activation_checkpointing_every_n)
        if self.cfg.model.compile:
            apply_compile(self.model)
        self._parallel_applied = True

    def forward(self, input_ids: torch.Tensor):
        return self.model(input_ids)

    def _losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, object]:
        out = self.model(batch["input_ids"])
        logits = out.logits_BSV
        lm_loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
        )
        loss = lm_loss + router_losses(out.routing, self.cfg.moe_opt)
        return loss, lm_loss, out

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, lm_loss, out = self._losses(batch)
        self.step_stats.add(
            loss=loss, lm_loss=lm_loss, aux_loss=out.aux_loss, z_loss=out.z_loss,
            routing=out.routing, tokens=batch["input_ids"].numel(),
        )
        self.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        _, lm_loss, _ = self._losses(batch)
        self.log("val_loss", lm_loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return lm_loss

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.cfg.optimizer)
        regroup = getattr(self._trainer.strategy, "regroup_optimizer", None) if self._trainer else None
        if regroup is not None:  # DeepSpeed: expert params into MoE param groups, before the schedule
            regroup(optimizer)
        scheduler = build_scheduler(optimizer, self.cfg.optimizer, self.cfg.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, before clipping.

        Expert gradients live on the rank that holds the expert, so under expert
        parallelism their squared norm is summed over the expert-parallel group.
        """
        dense, expert = torch.zeros(()), torch.zeros(())
        for p in self.model.parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().float().pow(2).sum().cpu()
            if getattr(p, "is_expert", False):
                expert += sq
            else:
                dense += sq
        ep_group = getattr(self, "ep_group", None)
        if ep_group is not None:
            expert = expert.to(self.device)
            torch.distributed.all_reduce(expert, group=ep_group)
            expert = expert.cpu()
        return (dense + expert).sqrt()
