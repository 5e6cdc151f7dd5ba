"""Expert-parallel (EP) and expert-data-parallel process groups, carved out of data parallelism.

Rank order (the same as DeepSpeed's `_create_expert_and_data_parallel` without model
parallelism): contiguous ranks form an EP group, and ranks holding the same experts,
`ep` apart, form an expert-data-parallel group. 16 ranks with ep 8:

    EP groups         [0..7], [8..15]                 all-to-all of tokens
    expert-DP groups  [0, 8], [1, 9], ..., [7, 15]    all-reduce of expert gradients

so contiguous ranks (one node's GPUs) exchange tokens and the gradient all-reduce
crosses nodes, as seed 004 lays out 16 GPUs (EP 8 inside a node, 2 replicas).
"""
from __future__ import annotations

import torch.distributed as dist

from moe.errors import ConfigError


def expert_group_ranks(world_size: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-DP groups) as rank lists, for `world_size` data-parallel ranks."""
    if ep < 1 or world_size % ep:
        raise ConfigError("parallel.ep", ep, f"use a divisor of the data-parallel world size ({world_size})",
                          problem="does not divide the data-parallel ranks")
    ep_groups = [list(range(start, start + ep)) for start in range(0, world_size, ep)]
    expert_dp_groups = [list(range(i, world_size, ep)) for i in range(ep)]
    return ep_groups, expert_dp_groups


def build_expert_groups(ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create every EP and expert-DP group; return (ep_group, expert_dp_group) holding this rank.

    `new_group` is collective: every rank creates every group, in the same order
    (expert-DP groups first, then EP groups, as DeepSpeed does).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_groups, expert_dp_groups = expert_group_ranks(world, ep)
    mine = {}
    for kind, rank_lists in (("expert_dp", expert_dp_groups), ("ep", ep_groups)):
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return mine["ep"], mine["expert_dp"]
