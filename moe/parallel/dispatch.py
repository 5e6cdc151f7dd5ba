"""The expert-parallel dispatcher: rows go to the rank holding their expert and back (all-to-all).

`AllToAllDispatcher(group)` is a moe.model.dispatch.Dispatcher: experts are spread over the ranks
of `group` (rank r holds experts [r*E/ep, (r+1)*E/ep)), and rows travel with
`all_to_all_single` (moe.parallel.comm.exchange_rows): uneven splits when dropless (one host sync
for the split sizes), fixed [E, C] buffers under a capacity (no sync). Installed by
moe.parallel.apply.apply_ep.

Shapes as moe.model.dispatch: T tokens, K picks, M kept assignments in expert order, R rows
received from every EP rank, E experts in all, C slots per expert, X = E * C buffer slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.model.dispatch import Dispatched, Sorted, sort_by_expert
from moe.model.routing import combine as combine_rows
from moe.model.routing import inverse_index, move_rows
from moe.parallel.comm import even_splits, exchange_counts, exchange_rows, group_max


@dataclass
class _Exchanged:
    """What the return trip of a dropless exchange needs."""

    sorted: Sorted
    sent_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    by_expert_R: torch.Tensor  # received rows -> local-expert order
    arrival_R: torch.Tensor  # its inverse


@dataclass
class _Slotted:
    """What the return trip of a fixed-buffer exchange needs."""

    sorted: Sorted
    slot_M: torch.Tensor  # kept row m -> its slot (expert * C + rank within the expert)
    row_X: torch.Tensor  # slot -> kept row (M = empty slot)
    capacity: int


class AllToAllDispatcher:
    """Experts are spread over the ranks of `group` (rank r holds experts [r*E/ep, (r+1)*E/ep))."""

    def __init__(self, group):
        self.group = group
        self.ep = dist.get_world_size(group)

    def agree_capacity(self, capacity: int | None, device: torch.device) -> int | None:
        """Every rank's buffers must have one size: the group's largest capacity."""
        return None if capacity is None else group_max(capacity, self.group, device)

    def dispatch(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, keep_TK: torch.Tensor | None,
                 capacity: int | None, num_experts: int) -> Dispatched:
        if capacity is None:
            return self._dispatch_dropless(x_TH, idx_TK, num_experts)
        return self._dispatch_fixed(x_TH, idx_TK, keep_TK, capacity, num_experts)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor,
                ctx: _Exchanged | _Slotted) -> torch.Tensor:
        if isinstance(ctx, _Exchanged):
            y_RH = move_rows(y_MH, ctx.arrival_R, ctx.by_expert_R)  # back to arrival order
            y_MH = exchange_rows(y_RH, ctx.recv_splits, ctx.sent_splits, self.group)
        else:
            E_local, C = y_MH.shape[0] // (self.ep * ctx.capacity), ctx.capacity
            y_XH = y_MH.view(E_local, self.ep, C, -1).transpose(0, 1).reshape(self.ep * E_local * C, -1)
            splits = even_splits(y_XH.shape[0], self.group)
            back_XH = exchange_rows(y_XH, splits, splits, self.group)
            y_MH = move_rows(back_XH, ctx.slot_M, ctx.row_X)
        return combine_rows(y_MH, weights_TK, ctx.sorted.order_M, ctx.sorted.pos_N)

    def _dispatch_dropless(self, x_TH, idx_TK, num_experts):
        """Rows sorted by expert are also sorted by owning rank: send, then regroup by local expert."""
        local = num_experts // self.ep
        x_MH, counts_E, sorted_ = sort_by_expert(x_TH, idx_TK, None, num_experts)
        recv_counts, sent, received = exchange_counts(counts_E, self.group, x_MH.shape[0])  # the one sync
        recv_RH = exchange_rows(x_MH, sent, received, self.group)
        # rows arrive grouped [source rank][local expert]; regroup them by local expert
        local_R = torch.arange(local, device=x_TH.device).repeat(self.ep).repeat_interleave(
            recv_counts, output_size=recv_RH.shape[0])
        by_expert_R = torch.argsort(local_R, stable=True)
        arrival_R = inverse_index(by_expert_R, by_expert_R.numel())
        x_RH = move_rows(recv_RH, by_expert_R, arrival_R)
        ctx = _Exchanged(sorted_, sent, received, by_expert_R, arrival_R)
        return Dispatched(x_RH, recv_counts.view(self.ep, local).sum(0), ctx)

    def _dispatch_fixed(self, x_TH, idx_TK, keep_TK, capacity, num_experts):
        """Fixed [E, C, H] buffers: kept row m goes to slot (expert, its rank within the expert)."""
        E, C, local, H = num_experts, capacity, num_experts // self.ep, x_TH.shape[-1]
        x_MH, counts_E, sorted_ = sort_by_expert(x_TH, idx_TK, keep_TK, E)
        expert_M = idx_TK.reshape(-1)[sorted_.order_M]
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        slot_M = expert_M * C + torch.arange(expert_M.numel(), device=x_TH.device) - starts_E[expert_M]
        row_X = inverse_index(slot_M, E * C)  # buffer slot -> kept row (M = empty slot, zeros)
        send_XH = move_rows(x_MH, row_X, slot_M)
        splits = even_splits(send_XH.shape[0], self.group)
        recv_XH = exchange_rows(send_XH, splits, splits, self.group)  # [source rank][local expert][slot]
        x_LRH = recv_XH.view(self.ep, local, C, H).transpose(0, 1).reshape(local * self.ep * C, H)
        counts_L = torch.full((local,), self.ep * C, dtype=torch.long, device=x_TH.device)
        return Dispatched(x_LRH, counts_L, _Slotted(sorted_, slot_M, row_X, C))
