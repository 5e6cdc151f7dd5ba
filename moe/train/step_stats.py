"""Per-optimizer-step accumulation of losses and routing statistics.

The LightningModule adds one micro-batch at a time; the metrics callback reads the
step's means once the optimizer has stepped, reduces them over ranks and resets.
Nothing here recomputes routing: it only sums what the MoE layers returned, as detached
tensors, so an accelerator is synchronised once a step (in `means`), not once a micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCALAR_KEYS = ("loss", "lm_loss", "aux_loss", "z_loss", "drop_fraction",
               "max_expert_load", "mean_expert_load", "router_entropy")


@dataclass
class StepStats:
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SCALAR_KEYS, 0.0))
    micro_batches: int = 0
    tokens: int = 0
    last_tokens_per_expert: list = field(default_factory=list)  # per MoE layer: counts [E], last forward
    last_tokens_per_forward: int = 0

    def add(self, *, loss, lm_loss, aux_loss, z_loss, routing, tokens: int) -> None:
        """Record one micro-batch: its losses and the RoutingStats of each MoE layer."""
        values = {"loss": loss, "lm_loss": lm_loss, "aux_loss": aux_loss, "z_loss": z_loss}
        if routing:
            n = len(routing)
            values["drop_fraction"] = sum(_f(r.dropped_fraction) for r in routing) / n
            values["max_expert_load"] = sum(_f(r.max_load) for r in routing) / n
            values["mean_expert_load"] = sum(_f(r.mean_load) for r in routing) / n
            values["router_entropy"] = sum(_f(r.entropy) for r in routing) / n
            self.last_tokens_per_expert = [r.tokens_per_expert_E.detach() for r in routing]
            self.last_tokens_per_forward = tokens
        for key, value in values.items():
            self.sums[key] = self.sums[key] + _f(value)
        self.micro_batches += 1
        self.tokens += tokens

    def means(self) -> dict[str, float]:
        n = max(1, self.micro_batches)
        return {key: float(total) / n for key, total in self.sums.items()}

    def tokens_per_expert(self) -> list[list[int]]:
        """[moe_layer][expert] routed assignments of the step's last forward (before drops)."""
        return [counts.tolist() for counts in self.last_tokens_per_expert]

    def reset(self) -> None:
        self.__init__()


def _f(value):
    """A detached float32 tensor, or the number itself."""
    return value.detach().float() if torch.is_tensor(value) else float(value)
