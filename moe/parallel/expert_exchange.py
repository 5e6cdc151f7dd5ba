"""The expert-parallel dispatcher: rows go to the rank holding their expert and back (all-to-all).

`AllToAllDispatcher(group)` is a moe.model.dispatcher.Dispatcher: experts are spread over the ranks
of `group` (rank r holds experts [r*E/ep, (r+1)*E/ep)), and rows travel with
`all_to_all_single` (moe.parallel.comm.exchange_rows): uneven splits when dropless (one host sync
for the split sizes), fixed [E, C] buffers under a capacity (the one sync is the group's capacity).
With moe_opt.weights_in_activation each row's routing weight travels beside it (one more exchange, of
one fp32 value per row, as Megatron-Core sends its permuted probs). Installed by moe.parallel.apply.apply_ep.

Shapes as moe.model.dispatcher: T tokens, K picks, M kept assignments in expert order, R rows
received from every EP rank, E experts in all, C slots per expert, X = E * C buffer slots.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.model.dispatcher import Dispatched, Sorted, sort_by_expert
from moe.model.routing import capacity_slots, inverse_index, move_rows, weighted_sum
from moe.model.routing import combine as combine_rows
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

    slot_N: torch.Tensor  # assignment n -> its slot (expert * C + rank within the expert; X = dropped)
    row_X: torch.Tensor  # slot -> assignment (N = empty slot)
    capacity: int


class AllToAllDispatcher:
    """Experts are spread over the ranks of `group` (rank r holds experts [r*E/ep, (r+1)*E/ep))."""

    def __init__(self, group):
        self.group = group
        self.ep = dist.get_world_size(group)
        # the host values of forwards that activation checkpointing will recompute (moe.parallel.apply.
        # apply_ac sets it for the layers it wraps whole): None, nothing is kept
        self.replay: deque | None = None

    def agree_capacity(self, capacity: int | None, device: torch.device) -> int | None:
        """Every rank's buffers must have one size: the group's largest capacity (the one host sync)."""
        return None if capacity is None else self._host(lambda: group_max(capacity, self.group, device))

    def _host(self, read):
        """read() -> values read back to the host (a sync, after a collective). Where the layer's forward is
        recomputed in the backward (activation checkpointing), the recomputation takes the forward's values
        in order instead: it reads nothing back and runs no extra collective for them."""
        if self.replay is None or not torch.is_grad_enabled():
            return read()
        if torch._C._current_graph_task_id() != -1:  # inside the backward: a checkpoint recomputing
            return self.replay.popleft()
        values = read()
        self.replay.append(values)
        return values

    def dispatch(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, keep_TK: torch.Tensor | None,
                 capacity: int | None, num_experts: int,
                 weights_TK: torch.Tensor | None = None) -> Dispatched:
        if capacity is None:
            return self._dispatch_dropless(x_TH, idx_TK, num_experts, weights_TK)
        return self._dispatch_fixed(x_TH, idx_TK, keep_TK, capacity, num_experts, weights_TK)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, ctx: _Exchanged | _Slotted,
                weighted: bool = True) -> torch.Tensor:
        if isinstance(ctx, _Exchanged):
            y_RH = move_rows(y_MH, ctx.arrival_R, ctx.by_expert_R)  # back to arrival order
            y_MH = exchange_rows(y_RH, ctx.recv_splits, ctx.sent_splits, self.group)
            s = ctx.sorted
            return combine_rows(y_MH, weights_TK, s.order_M, s.pos_N, s.drops, weighted)
        back_XH = self._slots_back(y_MH, ctx.capacity)
        back_NH = move_rows(back_XH, ctx.slot_N, ctx.row_X, pad=True)  # a dropped assignment: a zero row
        return weighted_sum(back_NH, weights_TK, weighted)

    def _dispatch_dropless(self, x_TH, idx_TK, num_experts, weights_TK):
        """Rows sorted by expert are also sorted by owning rank: send, then regroup by local expert."""
        local = num_experts // self.ep
        x_MH, counts_E, sorted_, weights_M = sort_by_expert(x_TH, idx_TK, None, num_experts, weights_TK)
        recv_counts, sent, received = self._host(  # the one sync
            lambda: exchange_counts(counts_E, self.group, x_MH.shape[0]))
        recv_RH = exchange_rows(x_MH, sent, received, self.group)
        # rows arrive grouped [source rank][local expert]; regroup them by local expert
        local_R = torch.arange(local, device=x_TH.device).repeat(self.ep).repeat_interleave(
            recv_counts, output_size=recv_RH.shape[0])
        by_expert_R = torch.argsort(local_R, stable=True)
        arrival_R = inverse_index(by_expert_R, by_expert_R.numel())
        x_RH = move_rows(recv_RH, by_expert_R, arrival_R)
        if weights_M is not None:
            recv_R1 = exchange_rows(weights_M, sent, received, self.group)
            weights_M = move_rows(recv_R1, by_expert_R, arrival_R)
        ctx = _Exchanged(sorted_, sent, received, by_expert_R, arrival_R)
        return Dispatched(x_RH, recv_counts.view(self.ep, local).sum(0), ctx, weights_M)

    def _dispatch_fixed(self, x_TH, idx_TK, keep_TK, capacity, num_experts, weights_TK):
        """Fixed [E, C, H] buffers: kept assignment n goes to slot (expert, its rank within the expert),
        dropped ones nowhere; nothing is read back to the host (the buffers' size is known)."""
        E, C, H = num_experts, capacity, x_TH.shape[-1]
        K = idx_TK.shape[1]
        slot_N = capacity_slots(idx_TK, keep_TK, E, C)
        row_X = inverse_index(slot_N, E * C + 1)[:E * C]  # slot -> assignment (N = empty: a zero row)
        x_NH = x_TH.unsqueeze(1).expand(-1, K, -1).reshape(-1, H)  # backward: sums over the k copies
        x_LRH = self._slots_out(move_rows(x_NH, row_X, slot_N, pad=True), C)
        weights_M = None
        if weights_TK is not None:  # each slot's weight travels as its row does (empty slots: 0)
            weights_M = self._slots_out(move_rows(weights_TK.reshape(-1, 1), row_X, slot_N, pad=True), C)
        return Dispatched(x_LRH, [self.ep * C] * (E // self.ep), _Slotted(slot_N, row_X, C), weights_M)

    def _slots_out(self, send_XH: torch.Tensor, capacity: int) -> torch.Tensor:
        """An [E * C] buffer in expert order -> the local experts' slots from every rank, by local expert."""
        splits = even_splits(send_XH.shape[0], self.group)
        recv_XH = exchange_rows(send_XH, splits, splits, self.group)  # [source rank][local expert][slot]
        local = send_XH.shape[0] // (self.ep * capacity)
        return recv_XH.view(self.ep, local, capacity, -1).transpose(0, 1).reshape(send_XH.shape[0], -1)

    def _slots_back(self, y_MH: torch.Tensor, capacity: int) -> torch.Tensor:
        """The local experts' outputs -> each source rank's [E * C] buffer, in expert order."""
        E_local, C = y_MH.shape[0] // (self.ep * capacity), capacity
        y_XH = y_MH.view(E_local, self.ep, C, -1).transpose(0, 1).reshape(self.ep * E_local * C, -1)
        splits = even_splits(y_XH.shape[0], self.group)
        return exchange_rows(y_XH, splits, splits, self.group)
