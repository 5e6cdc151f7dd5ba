"""The training objective, defined once for every backend: LM cross-entropy + router terms of every MoE layer.

    loss = mean CE over tokens whose label is not -100
         + sum over MoE layers of (aux_loss_coeff * load-balance + z_loss_coeff * z-loss)

As in Megatron-Core and DeepSpeed, the coefficients apply per layer and the terms are
summed, so a deeper model balances every layer as firmly as a shallow one (metrics.csv logs
the per-layer mean). A backend whose logits are sharded over the vocabulary (NxD's
tensor parallelism) passes its own per-token cross-entropy; the formula stays this one.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# Per-token cross-entropy: (logits [N, V] fp32, labels [N] with no IGNORE_INDEX) -> losses [N]
TokenCrossEntropy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_NV, labels_N, reduction="none")


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
            cross_entropy: TokenCrossEntropy = token_cross_entropy) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens that carry loss, computed in fp32."""
    logits_NV = logits_BSV.float().reshape(-1, logits_BSV.shape[-1])
    labels_N = labels_BS.reshape(-1)
    valid_N = labels_N != IGNORE_INDEX
    losses_N = cross_entropy(logits_NV, labels_N.masked_fill(~valid_N, 0))
    return (losses_N * valid_N).sum() / valid_N.sum().clamp(min=1)


def router_loss(stats, moe_opt) -> torch.Tensor:
    """One MoE layer's router term: aux_loss_coeff * load-balance + z_loss_coeff * z-loss."""
    return moe_opt.aux_loss_coeff * stats.aux_loss + moe_opt.z_loss_coeff * stats.z_loss


def router_loss_sum(routing: Iterable, moe_opt) -> torch.Tensor | float:
    """The router terms of every MoE layer of one forward, summed (0 when there is none)."""
    return sum((router_loss(stats, moe_opt) for stats in routing), 0.0)
