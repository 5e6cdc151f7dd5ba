"""Token dispatch for the MoE layer: the `Dispatcher` contract and the one-process dispatcher.

The layer routes, then asks its dispatcher for the rows of the experts held here, runs them,
and hands the outputs back to the dispatcher to combine. Every dispatcher is a `Dispatcher`:

    agree_capacity(capacity, device) -> capacity   the slots per expert every rank of the exchange uses
    dispatch(x_TH, idx_TK, keep_TK, capacity, num_experts, weights_TK=None)
        -> Dispatched(rows_MH, counts_E, ctx, weights_M)
        rows_MH   the rows for the experts held here, sorted by expert
        counts_E  how many of them each local expert owns (a long tensor, one entry per local expert; or
                  Python ints when the dispatcher knows them on the host: fixed buffers)
        ctx       whatever combine needs for the return trip (opaque to the layer)
        weights_M each row's routing weight [M, 1], moved as its row is, where weights_TK was given
                  (moe_opt.weights_in_activation: the experts apply them); else None
    combine(y_MH, weights_TK, ctx, weighted=True) -> y_TH
                                                   the experts' outputs back in token order, weighted
                                                   (summed only, where the experts applied the weights)

A layer may also hold a `TokenShard` (installed by moe.parallel.apply.apply_token_shard under tensor
parallelism): its tokens, equal on every rank of the shard's group, are split before routing and
the outputs gathered back, so each rank routes and computes only its share (EP folded with TP).

`LocalDispatcher` (the default) holds every expert in this process; moe.parallel.expert_exchange's
`AllToAllDispatcher`, installed by `moe.parallel.apply.apply_ep`, sends rows to the expert-parallel
rank holding their expert and back. The dispatcher holds the process group; the layer never sees
one. On trn1, neuronx-distributed's ExpertMLPs does the same three steps inside one call (capacity
slots, `enter_expert_parallel_region`, the expert MLPs, `exit_expert_parallel_region`, unpermute:
modules/moe/expert_mlps_v2.py:485-594, experts.py:182-213), so its layer is swapped whole and meets
the layer's contract instead (`MoEFeedForward` in moe/model/moe.py).

Shapes: T tokens, K picks per token, N = T*K assignments, M kept assignments in expert order,
R rows received from every EP rank, E experts in all, C slots per expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from moe.model.routing import combine as combine_rows
from moe.model.routing import dispatch_order, inverse_index, move_rows, sort_rows


class Dispatched(NamedTuple):
    """What `dispatch` returns: rows for the experts here, rows per local expert, the return ticket."""

    rows_MH: torch.Tensor
    counts_E: torch.Tensor | list[int]
    ctx: Any
    weights_M: torch.Tensor | None = None  # each row's routing weight [M, 1], where dispatch was given them


@runtime_checkable
class Dispatcher(Protocol):
    """Where a MoE layer's rows go and how they come back (module docstring)."""

    def agree_capacity(self, capacity: int | None, device: torch.device) -> int | None: ...

    def dispatch(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, keep_TK: torch.Tensor | None,
                 capacity: int | None, num_experts: int,
                 weights_TK: torch.Tensor | None = None) -> Dispatched: ...

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, ctx: Any,
                weighted: bool = True) -> torch.Tensor: ...


@runtime_checkable
class TokenShard(Protocol):
    """Splits a layer's rows over `size` ranks that hold the same rows, and gathers outputs back."""

    size: int

    def split(self, x_TH: torch.Tensor) -> torch.Tensor: ...

    def gather(self, y_tH: torch.Tensor) -> torch.Tensor: ...

    def whole_sequences(self, t_tX: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """A per-token tensor of this rank's rows -> every rank's, in [B*S] order (per-sequence losses)."""
        ...


@dataclass
class Sorted:
    """Assignments in expert order: order_M indexes the flat [N] picks, pos_N is its inverse (dropped
    assignments, after every expert's slice, at the zero row: `drops`)."""

    order_M: torch.Tensor
    pos_N: torch.Tensor
    drops: bool = False


def sort_by_expert(x_TH, idx_TK, keep_TK, num_experts, weights_TK=None) -> Dispatched:
    """(token rows in expert order [M, H], kept rows per expert [E], Sorted, their weights [M, 1] where
    weights_TK is given). With drops the rows are all N assignments', the dropped ones after the experts'
    slices: no host sync for the kept count."""
    keep_N = None if keep_TK is None else keep_TK.reshape(-1)
    order_M, counts_E = dispatch_order(idx_TK.reshape(-1), num_experts, keep_N)
    pos_N = inverse_index(order_M, idx_TK.numel(), keep_N)
    drops = keep_N is not None
    rows_MH = sort_rows(x_TH, order_M, pos_N, idx_TK.shape[1], drops)
    weights_M = None if weights_TK is None else move_rows(weights_TK.reshape(-1, 1), order_M, pos_N,
                                                          pad_back=drops)
    return Dispatched(rows_MH, counts_E, Sorted(order_M, pos_N, drops), weights_M)


class LocalDispatcher:
    """Every expert is in this process: sort rows by expert, run them, add them back weighted."""

    def agree_capacity(self, capacity: int | None, device: torch.device) -> int | None:
        return capacity

    def dispatch(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, keep_TK: torch.Tensor | None,
                 capacity: int | None, num_experts: int,
                 weights_TK: torch.Tensor | None = None) -> Dispatched:
        return sort_by_expert(x_TH, idx_TK, keep_TK, num_experts, weights_TK)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, ctx: Sorted,
                weighted: bool = True) -> torch.Tensor:
        return combine_rows(y_MH, weights_TK, ctx.order_M, ctx.pos_N, ctx.drops, weighted)
