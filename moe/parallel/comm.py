"""Every token movement between expert-parallel ranks goes through `exchange_tokens`.

Built on `torch.distributed.all_to_all_single`, which every backend (gloo included)
supports with uneven split sizes. The exchange is differentiable: its backward is the
reverse all-to-all, so gradients flow back to the rank a token came from.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


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


def exchange_tokens(
    x_NH: torch.Tensor,
    send_counts: torch.Tensor | None,
    group,
    recv_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send token rows to the ranks of `group`; return (received rows, recv_counts).

    Uneven (dropless): `send_counts` is a long tensor [ep * m]: chunk r (m entries, e.g.
    one per expert of rank r) counts the consecutive rows of `x_NH` bound for rank r.
    Rows come back ordered [source rank][group], with `recv_counts` [ep * m] in the same
    layout (exchanged here unless the caller already knows it, as on the return trip).

    Fixed (capacity mode): `send_counts=None` splits dim 0 of `x_NH` (e.g. an [E*C, H]
    buffer, experts in rank order) into ep equal chunks; the result has the same shape
    and needs no count exchange, so all shapes are static.
    """
    ep = dist.get_world_size(group)
    if send_counts is None:
        if x_NH.shape[0] % ep:
            raise ValueError(f"fixed-size exchange needs dim 0 ({x_NH.shape[0]}) divisible by ep={ep}")
        splits = [x_NH.shape[0] // ep] * ep
        return _AllToAll.apply(x_NH, splits, splits, group), None
    send_counts = send_counts.to(torch.long).contiguous()
    if recv_counts is None:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    in_splits = send_counts.view(ep, -1).sum(1).tolist()
    out_splits = recv_counts.view(ep, -1).sum(1).tolist()
    return _AllToAll.apply(x_NH, in_splits, out_splits, group), recv_counts


def group_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum a statistics tensor over `group` (no gradient): routing numbers every rank logs alike."""
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def group_max(value: int, group, device=None) -> int:
    """Largest `value` over `group` (e.g. expert capacity when ranks hold different token counts)."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
