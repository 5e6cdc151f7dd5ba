"""Aux-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437 section 2.1.2; Megatron-Core's
`moe_router_enable_expert_bias`): after each optimizer step every MoE layer's selection bias moves
by `bias_update_rate * sign(mean load - load_i)`, so an overloaded expert is picked less next step.

The loads are the step's top-k picks per expert, summed over its micro-batches (from the routing
statistics, so a recomputed forward under activation checkpointing is not counted twice) and over
every rank (one all-reduce of [layers, E] per step). Statistics already summed over an EP group
are counted once per member there, a uniform factor the sign ignores. Every rank computes the
same update, so the biases stay identical; they live in the routers' buffers, in checkpoints.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from moe.model.moe import RoutingStats
from moe.parallel.apply import moe_layers


class ExpertBiasUpdate:
    def __init__(self, model: torch.nn.Module, rate: float):
        self.routers = [layer.router for layer in moe_layers(model)]
        self.rate = rate
        self.loads: torch.Tensor | None = None

    def add(self, routing: list[RoutingStats]) -> None:
        """Count one micro-batch's picks (routing: one RoutingStats per MoE layer, in layer order)."""
        picks = torch.stack([s.tokens_per_expert_E for s in routing]).double()
        self.loads = picks if self.loads is None else self.loads + picks

    @torch.no_grad()
    def step(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the optimizer step: move every bias against its layer's load, then start counting anew."""
        if self.loads is None:
            return
        loads = all_reduce_sum(self.loads)
        delta = self.rate * torch.sign(loads.mean(dim=1, keepdim=True) - loads)
        for router, d in zip(self.routers, delta, strict=True):
            router.expert_bias += d.to(router.expert_bias)
        self.loads = None
