"""Per-optimizer-step accumulation of losses and routing statistics, as sums and counts.

The step (moe.module.train_step) adds each micro-batch's losses and each MoE layer's RoutingStats, and
on a step that reads them (a logged one, or the spike guard's) sums the sums and the counts over every
rank in one collective and divides. Sums and
counts (not local means) are what make that right on any layout: a pipeline stage that holds
no loss adds a count of 0, a stage adds only its own MoE layers, and tensor-parallel ranks,
which hold the same values, weigh in equally in numerator and denominator. Nothing here
recomputes routing, and values stay detached tensors until the step ends, so an accelerator
is synchronised once a step, not once a micro-batch.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.config.size import param_breakdown
from moe.model.loss import router_loss

MONITOR_KEYS = ("drop_fraction", "max_expert_load", "mean_expert_load", "router_entropy")
ROUTING_KEYS = ("aux_loss", "z_loss") + MONITOR_KEYS
KEYS = ("loss", "lm_loss", "mtp_loss") + ROUTING_KEYS  # mtp_loss: NaN for a model without depths


@dataclass
class StepStats:
    sums: dict = field(default_factory=lambda: dict.fromkeys(KEYS, 0.0))
    loss_count: int = 0  # micro-batches (pipeline: steps) whose loss this rank holds
    lm_count: int = 0  # ... whose LM loss it holds (NxD's pipeline returns the loss alone)
    mtp_count: int = 0  # ... whose multi-token-prediction loss it holds (model.mtp_layers)
    routing_count: int = 0  # MoE-layer forwards this rank ran
    monitor_count: int = 0  # ... that computed the monitoring numbers (MONITOR_KEYS)
    micro_batches: int = 0
    last_tokens_per_expert: list = field(default_factory=list)  # per MoE layer: counts [E], last forward
    last_tokens_per_forward: int = 0
    means: dict | None = None  # the means over every rank, once computed (step_means)

    def add_losses(self, loss, lm_loss=None, mtp_loss=None) -> None:
        """One micro-batch's training loss and, when known, its LM loss and multi-token-prediction loss."""
        self.means = None
        self.sums["loss"] = self.sums["loss"] + _detached(loss)
        self.loss_count += 1
        if lm_loss is not None:
            self.sums["lm_loss"] = self.sums["lm_loss"] + _detached(lm_loss)
            self.lm_count += 1
        if mtp_loss is not None:
            self.sums["mtp_loss"] = self.sums["mtp_loss"] + _detached(mtp_loss)
            self.mtp_count += 1

    def add_loss_term(self, value) -> None:
        """A term of the training loss this rank computed without the rest of it (a pipeline stage's router
        terms): summed into the loss, counted where the micro-batch's LM loss is."""
        self.means = None
        self.sums["loss"] = self.sums["loss"] + _detached(value)

    def add_routing(self, routing: list, tokens: int) -> None:
        """The RoutingStats of each MoE layer this rank ran in one micro-batch."""
        self.means = None
        for r in routing:
            for key, value in (("aux_loss", r.aux_loss), ("z_loss", r.z_loss),
                               ("drop_fraction", r.dropped_fraction), ("max_expert_load", r.max_load),
                               ("mean_expert_load", r.mean_load), ("router_entropy", r.entropy)):
                if value is not None:  # a forward that monitored nothing (routing_stats' `monitor`)
                    self.sums[key] = self.sums[key] + _detached(value)
            self.monitor_count += r.entropy is not None
        self.routing_count += len(routing)
        if routing:
            self.last_tokens_per_expert = [r.tokens_per_expert_E.detach() for r in routing]
            self.last_tokens_per_forward = tokens

    def add(self, *, loss, lm_loss, routing, tokens: int, mtp_loss=None) -> None:
        """One micro-batch: its losses and the RoutingStats of each of its MoE layers."""
        self.add_losses(loss, lm_loss, mtp_loss)
        self.add_routing(routing, tokens)
        self.micro_batches += 1

    def totals(self) -> torch.Tensor:
        """[sum of every key..., its count...]: one fp32 tensor to sum-reduce over ranks, on the device its
        sums are on (the CPU where none is a tensor), so that building it reads nothing back."""
        device = next((v.device for v in self.sums.values() if torch.is_tensor(v)), "cpu")
        values = [torch.as_tensor(self.sums[k], dtype=torch.float32).reshape(()).to(device) for k in KEYS]
        counts = torch.tensor(self._counts(), dtype=torch.float32, device=device)
        return torch.cat([torch.stack(values), counts])

    def _counts(self) -> list[int]:
        by_key = {"loss": self.loss_count, "lm_loss": self.lm_count, "mtp_loss": self.mtp_count,
                  **dict.fromkeys(MONITOR_KEYS, self.monitor_count)}
        return [by_key.get(k, self.routing_count) for k in KEYS]

    def tokens_per_expert(self) -> list[list[int]]:
        """[moe_layer][expert] routed assignments of the step's last forward (before drops)."""
        return [counts.tolist() for counts in self.last_tokens_per_expert]

    def reset(self) -> None:
        self.__init__()


def logs_step(step: int, log_every: int, max_steps: int) -> bool:
    """Whether optimizer step `step` (1-based) writes a metrics.csv row: every `log_every`-th, the first and
    the last. Its routing monitoring numbers are computed only then (moe.model.moe.MoELayer.monitor)."""
    return step % max(1, log_every) == 0 or step in (1, max_steps)


def means_from_totals(totals: torch.Tensor) -> dict[str, float]:
    """Per-key means from (possibly rank-summed) `StepStats.totals`; NaN where no rank counted any."""
    values = totals.tolist()
    sums, counts = values[: len(KEYS)], values[len(KEYS):]
    return {k: total / count if count else float("nan")
            for k, total, count in zip(KEYS, sums, counts, strict=True)}


def step_means(stats: StepStats, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], model: ModelConfig,
               moe_opt: MoEOptConfig) -> dict[str, float]:
    """The step's losses and routing statistics in `stats`, averaged over every rank: one sum-reduce and one
    host read, once a step however often asked (the spike guard and metrics.csv share them).

    Where no rank reported the LM loss (NxD's pipeline returns the loss alone), it is the loss less
    every MoE layer's router term at the step's mean load-balance and z-losses.
    """
    if stats.means is not None:
        return stats.means
    means = means_from_totals(sum_over_ranks(stats.totals()))
    stats.means = means
    if math.isnan(means["lm_loss"]) and not math.isnan(means["aux_loss"]):
        per_layer = router_loss(SimpleNamespace(aux_loss=means["aux_loss"], z_loss=means["z_loss"]), moe_opt)
        means["lm_loss"] = means["loss"] - param_breakdown(model).num_moe_layers * per_layer
    return means


def validation_loss(module) -> float:
    """The LM loss over every rank's batches of the validation pass just run (one sum-reduce, every rank
    takes part), NaN where no rank holds one; the pass's sums start anew."""
    totals = module.backend.all_reduce(module, module.val_stats.totals(), "sum")
    module.val_stats.reset()
    return means_from_totals(totals)["lm_loss"]


def _detached(value):
    return value.detach().float() if torch.is_tensor(value) else float(value)
