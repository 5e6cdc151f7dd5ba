"""Every token movement between expert-parallel ranks goes through `exchange_rows`.

Built on `torch.distributed.all_to_all_single`, which every backend (gloo included)
supports with uneven split sizes. The exchange is differentiable: its backward is the
reverse all-to-all, so gradients flow back to the rank a token came from.

A collective here that fails (a peer died, or stalled past parallel.collective_timeout_s, which
`set_collective_timeout` gives every group) raises moe.errors.CollectiveFailed naming this rank, the
collective and its ranks; train() turns it into one paragraph and exit 3 (moe.train.run).
"""
from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from moe.errors import CollectiveFailed
from moe.faults import maybe_fail_in_all_to_all
from moe.model.sync import host_int, host_sizes, hot_rows

# what the world group is made with: the rendezvous waits this long for every peer to join (imports on a
# busy node, other hosts starting later), torch's own default for gloo; collectives then get
# parallel.collective_timeout_s (apply_collective_timeout)
RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


def set_collective_timeout(seconds: float) -> timedelta:
    """Every process group made from now on waits at most `seconds` for a peer (parallel.
    collective_timeout_s): torch gives groups made without a timeout (DeviceMesh's, DeepSpeed's,
    new_group's) distributed_c10d.default_pg_timeout (torch/distributed/distributed_c10d.py
    `_get_default_timeout`), so that is set. Returns the timeout the strategy's world group is made
    with: never under RENDEZVOUS_TIMEOUT, since torch's rendezvous store waits that long for the peers
    to start; apply_collective_timeout shortens it once they all have."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=seconds)
    return max(c10d.default_pg_timeout, RENDEZVOUS_TIMEOUT)


def apply_collective_timeout(seconds: float) -> None:
    """The world group's collectives wait at most `seconds` for a peer, from now on (after the
    rendezvous: see set_collective_timeout); torch's `_set_pg_timeout` (torch 2.9 and 2.13 alike)."""
    if dist.is_initialized() and dist.get_backend() in ("gloo", "nccl"):
        import torch.distributed.distributed_c10d as c10d

        c10d._set_pg_timeout(timedelta(seconds=seconds), None)


@contextlib.contextmanager
def named_collective(name: str, group):
    """Run a collective; a failure (a dead or stalled peer) becomes CollectiveFailed naming it, its ranks."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        ranks = (dist.get_process_group_ranks(group) if group is not None
                 else list(range(dist.get_world_size())))
        raise CollectiveFailed(dist.get_rank(), f"{name} over ranks {ranks}", err) from err


class _AllToAll(torch.autograd.Function):
    """Rows split `in_splits` per destination rank go out; `out_splits` per source come in."""

    @staticmethod
    def forward(ctx, x_NH, in_splits, out_splits, group):
        ctx.in_splits, ctx.out_splits, ctx.group = in_splits, out_splits, group
        out = x_NH.new_empty((sum(out_splits),) + tuple(x_NH.shape[1:]))
        maybe_fail_in_all_to_all(group)
        with named_collective("the expert-parallel all_to_all_single (forward)", group):
            dist.all_to_all_single(out, x_NH.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.in_splits),) + tuple(grad_out.shape[1:]))
        with named_collective("the expert-parallel all_to_all_single (backward)", ctx.group):
            dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits,
                                   group=ctx.group)
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
    with named_collective("the expert-parallel all_to_all_single of row counts", group):
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    per_rank = torch.cat([send_counts.view(ep, -1).sum(1), recv_counts.view(ep, -1).sum(1)])
    if is_fake(per_rank):  # simulated: sends balanced, receives its hottest expert's extra rows
        sent = host_sizes(per_rank[:ep], rows)
        return recv_counts, sent, host_sizes(per_rank[ep:], hot_rows(rows, send_counts.numel() // ep))
    sizes = host_sizes(per_rank, 2 * rows)
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


IN_PLACE_ELEMENTS = 1 << 20  # a gradient this large is all-reduced where it lies; smaller ones share a buffer


@torch.no_grad()
def sum_grads(params, group, divide_by: int = 1) -> None:
    """Sum the gradients of `params` over `group` (then divide), in place: their local parts when they are
    DTensors (FSDP2's shards). Large gradients (experts' stacked weights) are all-reduced where they lie,
    without a copy; the small ones (routers, norms) in one flat buffer, one collective for them all. A
    parameter no token reached here gets a zero gradient and still joins."""
    from moe.parallel.grad_norm import local_part

    small = []
    with named_collective("the gradient all_reduce", group):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = local_part(p.grad)
            if g.numel() >= IN_PLACE_ELEMENTS and g.is_contiguous():
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
                if divide_by != 1:
                    g.div_(divide_by)
            else:
                small.append(g)
        if not small:
            return
        flat = torch.cat([g.reshape(-1) for g in small])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if divide_by != 1:
        flat.div_(divide_by)
    offset = 0
    for g in small:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def group_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum a statistics tensor over `group` (no gradient): routing numbers every rank logs alike."""
    t = t.detach().clone()
    with named_collective("the routing statistics' all_reduce", group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def group_max(value: int, group, device=None) -> int:
    """Largest `value` over `group` (e.g. expert capacity when ranks hold different token counts)."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    with named_collective("the expert capacity's all_reduce", group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return host_int(t, value)
