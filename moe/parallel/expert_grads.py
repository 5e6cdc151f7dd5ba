"""Expert gradients when the library does not reduce them itself (DDP with expert parallelism).

Each expert lives on the ranks of one expert-data-parallel group, so its gradient is summed
over that group and divided by the data-parallel world size: the same average over ranks that
DDP gives dense parameters. Clipping then uses one global norm on every rank (moe.parallel.grad_norm), so
replicas stay equal.
"""
from __future__ import annotations

import torch

from moe.parallel.comm import sum_grads


def expert_param_names(module: torch.nn.Module) -> list[str]:
    """Names (as `named_parameters` spells them, the names DDP matches) of expert parameters."""
    return [name for name, p in module.named_parameters() if getattr(p, "is_expert", False)]


def expert_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "is_expert", False)]


def reduce_expert_grads(params: list[torch.nn.Parameter], expert_dp_group, dp_world_size: int) -> None:
    """Sum expert grads over the expert-DP group, divide by the data-parallel world size (in place:
    moe.parallel.comm.sum_grads)."""
    sum_grads(params, expert_dp_group, divide_by=dp_world_size)

