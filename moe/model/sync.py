"""The only places the MoE layer reads device values back to the host.

On a GPU each read is a host sync: the CPU waits for every kernel queued before it. The
dropless local path needs none (its shapes follow from the batch); an expert-parallel layer
needs one per forward (the all-to-all split sizes, sent and received, fetched together);
capacity mode needs one for the kept-row count (or the group's largest capacity under EP).

Under fake tensors (`simulate=true`, moe/tools/simulate.py) no values exist: the simulation
assumes perfectly balanced routing, so `total` rows spread evenly over the entries.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def host_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """`counts` as Python ints (one sync); under fake tensors, `total` split evenly over its entries."""
    if is_fake(counts):
        n = counts.numel()
        return [total // n + (i < total % n) for i in range(n)]
    return counts.tolist()


def host_int(value: torch.Tensor, assumed: int) -> int:
    """`value` (a one-element tensor) as a Python int; `assumed` under fake tensors."""
    return assumed if is_fake(value) else int(value.item())
