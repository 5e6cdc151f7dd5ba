"""Expert-parallel (EP) and expert-data-parallel process groups, from the run's Layout.

16 ranks with ep 8 (tp = pp = 1), as the 16-GPU MoE recipe lays out 2 nodes of 8 GPUs:

    EP groups         [0..7], [8..15]                 all-to-all of tokens (inside a node)
    expert-DP groups  [0, 8], [1, 9], ..., [7, 15]    all-reduce of expert gradients (across nodes)

`new_group` is collective: every rank creates every group, in the same order (expert-DP groups
first, then EP groups, as DeepSpeed's `_create_expert_and_data_parallel` does).
"""
from __future__ import annotations

import torch.distributed as dist

from moe.backends.base import ExpertGroups
from moe.config.layout import Layout


def build_expert_groups(layout: Layout) -> ExpertGroups:
    """Create every EP and expert-DP group of `layout`; return the two that hold this rank."""
    rank = dist.get_rank()
    mine = {}
    for kind in ("expert-DP", "EP"):
        for ranks in layout.group(kind).ranks:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return ExpertGroups(ep=mine["EP"], expert_dp=mine["expert-DP"])
