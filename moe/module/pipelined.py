"""A pipelined model's part of the step (moe.parallel.pipeline): the schedule runs every micro-batch.

The step (moe.module.train_step) hands the step's micro-batches and its statistics to `forward_backward`,
where the schedule runs the forward and backward of all of them at once, in its own order. The step
statistics are sums and counts (moe.module.step_stats): each stage adds its own MoE layers' routing and
router terms, the last stage the LM losses and their count.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from moe.module.step_stats import StepStats
from moe.parallel.pipeline import Pipeline


class PipelineSchedule:
    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    def forward_backward(self, module, micro_batches: list[dict], stats: StepStats,
                         count_picks: Callable[[list], None]) -> torch.Tensor:
        """Every micro-batch's forward and backward through the schedule, their numbers into the step's
        `stats`, each micro-batch's routing (over this rank's stages) to `count_picks`; the step's mean LM
        loss where the last stage is, else 0."""
        ids, labels = (torch.cat([b[k] for b in micro_batches]) for k in ("input_ids", "labels"))
        self.pipeline.train(ids, labels)
        return self._record(stats, count_picks, ids.numel() // self.pipeline.n_microbatches)

    def validation_step(self, module, batch: dict) -> torch.Tensor | None:
        """A validation batch holds a step's micro-batches (Backend.val_micro_batches); their LM losses."""
        self.pipeline.eval(batch["input_ids"], batch["labels"])
        for part in self.pipeline.parts:
            for record in part.records:
                if record.lm_loss is not None:
                    module.val_stats.add_losses(record.lm_loss, record.lm_loss)
        return None

    def _record(self, stats: StepStats, count_picks: Callable[[list], None],
                tokens_per_micro_batch: int) -> torch.Tensor:
        losses = []
        for part in self.pipeline.parts:
            for record in part.records:
                if record.router_loss is not None:
                    stats.add_loss_term(record.router_loss)
                if record.lm_loss is not None:
                    stats.add_losses(record.lm_loss, record.lm_loss)
                    losses.append(record.lm_loss.detach())
                stats.add_routing(record.routing, tokens_per_micro_batch)
        stats.micro_batches += self.pipeline.n_microbatches
        for micro_batch in zip(*(part.records for part in self.pipeline.parts), strict=True):
            count_picks([layer for record in micro_batch for layer in record.routing])
        return torch.stack(losses).mean() if losses else torch.zeros(())
