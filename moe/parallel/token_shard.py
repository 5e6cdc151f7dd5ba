"""EP folded with TP: a MoE layer's tokens split over the tensor-parallel group before routing.

Under tensor parallelism (without sequence parallelism) every TP rank holds the same activations
between blocks. Were the MoE layer to route them all, every TP rank would push the same tokens
through the experts: tp times the expert work. Instead each TP rank takes its 1/tp of the tokens,
routes and dispatches them over its EP group (which may hold the other TP ranks: the folded
order of moe.parallel.dims), and the outputs are gathered back, as torchtitan does ("MoE reuses
the TP axis for token sharding", torchtitan 0.3.0 models/common/moe_sharding.py:71-104: the router
computes on the local shard) and Megatron-Core's token dispatcher with tp > 1 (its
gather_from_sequence_parallel_region / reduce_scatter_to_sequence_parallel_region around the
all-to-all, megatron/core/transformer/moe/token_dispatcher.py).

Gradients: the split's backward all-gathers the slices' input gradients (every TP rank then holds
the whole, equal gradient, as replicated activations need); the gather's backward keeps the rank's
own slice (the gradient arriving from the replicated layers above is equal on every TP rank). The
router's and the shared expert's weights, replicated over TP, see only their rank's tokens: their
gradients are summed over the TP group after the backward (moe.parallel.comm.sum_grads, Megatron-Core's
finalize_model_grads.py:318-394 `_allreduce_non_tensor_model_parallel_grads` does the same for
its sequence-parallel weights).

Sequence parallelism (parallel.sequence_parallel) keeps the activations between blocks split along
the sequence over the TP group (`SequenceShard`): norms and the MoE layer run on the rank's chunk
(already its own tokens: `SequenceParallelTokenShard`), attention and dense MLPs gather the
sequence on entry and reduce-scatter on exit (DTensor, moe.parallel.tensor_parallel), and the LM
loss is taken on each chunk. The norms' and the LM head's gradients are then partial too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _own_chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _Split(torch.autograd.Function):
    """Forward: this rank's chunk along `dim`; backward: the chunks' gradients all-gathered."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """Forward: every rank's chunk along `dim`, concatenated; backward: this rank's chunk of the
    gradient (which is equal on every rank of the group)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.dim, ctx.group), None, None


class TPTokenShard:
    """A moe.model.dispatcher.TokenShard over `group` (the TP group), whose ranks hold the same rows: rank t
    takes rows [t*T/n, (t+1)*T/n)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def split(self, x_TH: torch.Tensor) -> torch.Tensor:
        return _Split.apply(x_TH, 0, self.group)

    def gather(self, y_tH: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(y_tH, 0, self.group)

    def whole_sequences(self, t_tX: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """Every rank's rows of a per-token tensor, in [B*S] order."""
        return self.gather(t_tX)


class SequenceParallelTokenShard(TPTokenShard):
    """Under sequence parallelism the rows reaching the MoE layer are already this rank's: its chunk of
    every sequence ([B, S/n] flattened). Nothing to split or gather."""

    def split(self, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH

    def gather(self, y_tH: torch.Tensor) -> torch.Tensor:
        return y_tH

    def whole_sequences(self, t_tX: torch.Tensor, num_sequences: int) -> torch.Tensor:
        gathered = _Gather.apply(t_tX, 0, self.group)  # [n][B][S/n]
        return gathered.view(self.size, num_sequences, -1, *t_tX.shape[1:]).transpose(0, 1).flatten(0, 2)


class SequenceShard:
    """Sequence parallelism's ends (Megatron-Core's scatter_to / gather_from_sequence_parallel_region):
    the embeddings' output split along the sequence over the TP group, the final hidden states gathered
    back for logits, or the LM loss taken on each rank's chunk (no [tokens, vocab] work repeated)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def split(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return _Split.apply(x_BSH, 1, self.group)

    def gather(self, x_BsH: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x_BsH, 1, self.group)

    def lm_loss(self, hidden_BsH: torch.Tensor, weight_VH: torch.Tensor,
                labels_BS: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over every token of the sequences: in the forward the whole value, in the
        backward the gradient of this rank's chunk's share (the chunks' gradients meet in the collectives
        below and in the TP sum of the replicated weights' gradients)."""
        from moe.model.fused_ce import linear_cross_entropy
        from moe.model.loss import IGNORE_INDEX

        labels_Bs = _own_chunk(labels_BS, 1, self.group)
        mine = (labels_Bs != IGNORE_INDEX).sum()
        every = (labels_BS != IGNORE_INDEX).sum().clamp(min=1)
        mean = linear_cross_entropy(hidden_BsH.flatten(0, 1), weight_VH, labels_Bs.flatten())
        share = mean * (mine / every)
        whole = share.detach().clone()
        dist.all_reduce(whole, group=self.group)
        return share + (whole - share).detach()


def partial_params(model: nn.Module, sequence_parallel: bool = False) -> list[nn.Parameter]:
    """Weights replicated over TP whose gradients cover only the rank's tokens: routers and shared
    experts (and their gates); under sequence parallelism also the norms on the sequence chunks and the
    LM head."""
    from moe.model.moe import MoELayer

    found = []
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        found += list(layer.router.parameters())
        for shared in (layer.shared_expert, layer.shared_expert_gate):
            found += list(shared.parameters()) if shared is not None else []
    if sequence_parallel:
        for block in model.layers:
            found += [*block.attn_norm.parameters(), *block.ffn_norm.parameters()]
        for end in (model.norm, model.lm_head):  # a pipeline stage may hold neither
            found += list(end.parameters()) if end is not None else []
    return found
