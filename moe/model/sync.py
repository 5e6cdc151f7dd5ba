"""The only places the MoE layer reads device values back to the host.

On a GPU each read is a host sync: the CPU waits for every kernel queued before it. The
dropless local path needs none (its shapes follow from the batch); an expert-parallel layer
needs one per forward (the all-to-all split sizes, sent and received, fetched together);
capacity mode needs one for the kept-row count (or the group's largest capacity under EP).

Under fake tensors (`simulate=true`, moe/tools/simulate.py) no values exist: the simulation
assumes balanced routing, so `total` rows spread evenly over the entries, except that the simulated
rank holds the hottest expert at `ASSUMED.skew` times its share (`routing_skew`, what the planner
assumes too): an expert-parallel rank receives that many more rows.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from moe.config.derived import hottest_rank_load


@dataclass
class Assumed:
    skew: float = 1.0  # the simulated rank's hottest expert's load over its share


ASSUMED = Assumed()


@contextlib.contextmanager
def assumed_skew(skew: float):
    """Fake routing puts the hottest expert, at `skew` times its share, on the simulated rank."""
    before, ASSUMED.skew = ASSUMED.skew, skew
    try:
        yield
    finally:
        ASSUMED.skew = before


def hot_rows(balanced: int, experts_here: int) -> int:
    """Rows a rank holding `experts_here` experts receives when one of them is the hottest (fake tensors)."""
    return round(balanced * hottest_rank_load(experts_here, ASSUMED.skew))


def host_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """`counts` as Python ints (one sync); under fake tensors, `total` split evenly over its entries."""
    if is_fake(counts):
        n = counts.numel()
        return [total // n + (i < total % n) for i in range(n)]
    return counts.tolist()


def host_int(value: torch.Tensor, assumed: int) -> int:
    """`value` (a one-element tensor) as a Python int; `assumed` under fake tensors."""
    return assumed if is_fake(value) else int(value.item())
