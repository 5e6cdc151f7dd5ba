"""LitMoE's training and validation steps when the model is pipelined (moe.parallel.pipeline).

Lightning still drives the step: it hands over one micro-batch at a time and steps the optimizer after
`accumulate_grad_batches` of them (clipping, the spike guard, the metrics and the step checkpoints run
as usual). The micro-batches are gathered here until the step's last one, then the schedule runs the
forward and backward of all of them at once; Lightning's own backward of what training_step returns
has nothing left to do (LitMoE.backward). The step statistics are sums and counts
(moe.module.step_stats): each stage adds its own MoE layers' routing and router terms, the last stage
the LM losses and their count.
"""
from __future__ import annotations

import torch

from moe.module.step_stats import StepStats
from moe.parallel.pipeline import Pipeline


class PipelinedSteps:
    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.pending: list[dict] = []  # the micro-batches of the step being gathered

    def training_step(self, module, batch: dict) -> torch.Tensor:
        """The step's mean LM loss on its last micro-batch where the last stage is, else 0 (Lightning takes
        no None from a distributed training_step; its backward of the value does nothing)."""
        self.pending.append(batch)
        if module.trainer.fit_loop._should_accumulate():
            return torch.zeros(())
        ids, labels = (torch.cat([b[k] for b in self.pending]) for k in ("input_ids", "labels"))
        self.pending.clear()
        self.pipeline.train(ids, labels)
        return self._record(module, ids.numel() // self.pipeline.n_microbatches)

    def validation_step(self, module, batch: dict) -> torch.Tensor | None:
        """A validation batch holds a step's micro-batches (Backend.val_micro_batches); their LM losses."""
        self.pipeline.eval(batch["input_ids"], batch["labels"])
        for part in self.pipeline.parts:
            for record in part.records:
                if record.lm_loss is not None:
                    module.val_stats.add_losses(record.lm_loss, record.lm_loss)
        return None

    def _record(self, module, tokens_per_micro_batch: int) -> torch.Tensor:
        stats: StepStats = module.step_stats
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
            module.count_expert_picks([layer for record in micro_batch for layer in record.routing])
        return torch.stack(losses).mean() if losses else torch.zeros(())
