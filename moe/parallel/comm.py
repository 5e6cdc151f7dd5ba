"""Every token movement between expert-parallel ranks goes through `exchange_rows`.

Built on `torch.distributed.all_to_all_single`, which every backend (gloo included)
supports with uneven split sizes. The exchange is differentiable: its backward is the
reverse all-to-all, so gradients flow back to the rank a token came from.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe.model.sync import host_int, host_sizes


class _AllToAll(torch.autograd.Function):
    """Rows split `in_splits` per destination rank go out; `out_splits` per source come in."""

    @staticmethod
    def forward(ctx, x_NH, in_splits, out_splits, group):
        ctx.in_splits, ctx.out_splits, ctx.group = in_splits, out_splits, group
        out = x_NH.new_empty((sum(out_splits),) + tuple(x_NH.shape[1:]))
        dist.all_to_all_single(out, x_NH.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.in_splits),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None


def exchange_counts(send_counts: torch.Tensor, group, rows: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Before an uneven exchange: (recv_counts, rows sent to each rank, rows received from each rank).

    `send_counts` is a long tensor [ep * m]: chunk r (m entries, e.g. one per expert of rank r)
    counts the consecutive rows of the `rows` about to be sent that are bound for rank r.
    `recv_counts` comes back in the same layout, [source rank][m]. The split sizes are read to the
    host together: the one host sync of an expert-parallel MoE forward (moe.model.sync).
    """
    ep = dist.get_world_size(group)
    send_counts = send_counts.to(torch.long).contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    per_rank = torch.cat([send_counts.view(ep, -1).sum(1), recv_counts.view(ep, -1).sum(1)])
    sizes = host_sizes(per_rank, 2 * rows)  # fake tensors: balanced, each rank receives what it sends
    return recv_counts, sizes[:ep], sizes[ep:]


def exchange_rows(x_NH: torch.Tensor, in_splits: list[int], out_splits: list[int], group) -> torch.Tensor:
    """Send `in_splits[r]` consecutive rows of `x_NH` to rank r; receive `out_splits[r]` from each.

    Differentiable: the backward sends the gradients back the reverse way. Fixed-size exchanges
    (capacity mode: an [E*C, H] buffer, experts in rank order) pass equal splits and need no counts.
    """
    return _AllToAll.apply(x_NH, in_splits, out_splits, group)


def even_splits(rows: int, group) -> list[int]:
    """Equal split sizes of `rows` over the ranks of `group` (a fixed-size exchange)."""
    ep = dist.get_world_size(group)
    if rows % ep:
        raise ValueError(f"fixed-size exchange needs dim 0 ({rows}) divisible by ep={ep}")
    return [rows // ep] * ep


def group_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum a statistics tensor over `group` (no gradient): routing numbers every rank logs alike."""
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def group_max(value: int, group, device=None) -> int:
    """Largest `value` over `group` (e.g. expert capacity when ranks hold different token counts)."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return host_int(t, value)
