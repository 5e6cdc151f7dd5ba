"""How each parameter of our model is held on a tensor-parallel rank under neuronx-distributed, and back.

Pure tensor arithmetic (no NxD import), shared by the parameter initialisation on trn1 (each rank
builds only its shard of the full value moe.model.init gives, moe/backends/neuron/layers.py) and
the checkpoint converter (moe/tools/consolidate.py, shards -> full tensors), so both agree.

A parameter's layout is (dim, groups): the full tensor is cut along `dim` into consecutive groups
(e.g. [q | k | v] rows of the fused qkv weight, [gate | up] columns of an expert), each group is
split into tp contiguous pieces, and rank r holds its piece of every group, concatenated. With
equal groups this is NxD's `create_local_weight(full, partition_dim, per_partition_size, stride)`
with stride = the number of groups (neuronx_distributed/parallel_layers/layers.py:88-107, v2.28.0):
chunks rank::tp of the full weight cut into stride * tp pieces. Unequal groups (GQA's q and kv)
have no NxD stride equivalent; the fused qkv layer's forward splits its local output by the
local sizes (moe.model.model.Attention), so only our own code reads that layout.

Names: our state-dict names (moe.model.model.MoETransformer) and, under NxD, the names of the same
tensors in `NxDCausalLM` (moe/backends/neuron/causal_lm.py), where the model sits under `model.`
and the MoE layer's tensors are NxD's own (neuronx_distributed/modules/moe: router.linear_router,
expert_mlps.mlp_op.gate_up_proj / down_proj).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# our name suffix -> the NxD MoE module's name for the same tensor
MOE_NAMES = {
    "ffn.router.weight": "ffn.moe.router.linear_router.weight",
    "ffn.experts.gate_up": "ffn.moe.expert_mlps.mlp_op.gate_up_proj.weight",
    "ffn.experts.down": "ffn.moe.expert_mlps.mlp_op.down_proj.weight",
}
PREFIX = "model."  # NxDCausalLM.model
# stacked [E / ep, ...] expert tensors (our names): expert-parallel ranks hold consecutive experts
EXPERT_TENSORS = ("experts.gate_up", "experts.down")


@dataclass(frozen=True)
class Layout:
    """dim None: replicated on every tensor-parallel rank."""

    dim: int | None
    groups: tuple[int, ...] = ()  # sizes along dim; empty: one group, the whole dim


REPLICATED = Layout(None)


def layout_of(name: str, model_cfg) -> Layout:
    """How the tensor called `name` (our name) is split over tensor-parallel ranks."""
    m = model_cfg
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Layout(0)  # vocabulary rows: ParallelEmbedding, ColumnParallelLinear
    if name.endswith("attn.qkv_proj.weight"):
        q, kv = m.num_heads * head_dim, m.num_kv_heads * head_dim
        return Layout(0, (q, kv, kv))
    if name.endswith(("attn.o_proj.weight", "ffn.down_proj.weight")):
        return Layout(1)  # RowParallelLinear: input columns
    if name.endswith("ffn.gate_up_proj.weight"):
        f = m.dense_intermediate_size or m.intermediate_size
        return Layout(0, (f, f))  # [gate | up] rows
    if name.endswith("ffn.experts.gate_up"):
        return Layout(2, (m.intermediate_size, m.intermediate_size))  # [E, H, gate | up]
    if name.endswith("ffn.experts.down"):
        return Layout(1)  # [E, F, H]
    return REPLICATED  # norms, the router


def local_shard(full: torch.Tensor, layout: Layout, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full`."""
    if layout.dim is None:
        return full
    groups = layout.groups or (full.shape[layout.dim],)
    pieces = [g.chunk(tp, dim=layout.dim)[rank] for g in full.split(list(groups), dim=layout.dim)]
    return torch.cat(pieces, dim=layout.dim)


def full_tensor(shards: list[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The full tensor from every rank's piece (rank order); the inverse of `local_shard`."""
    if layout.dim is None:
        return shards[0]
    dim, tp = layout.dim, len(shards)
    n_groups = len(layout.groups) or 1
    local_groups = (tuple(g // tp for g in layout.groups) if layout.groups
                    else (shards[0].shape[dim],))
    per_rank = [s.split(list(local_groups), dim=dim) for s in shards]
    groups = [torch.cat([per_rank[r][g] for r in range(tp)], dim=dim) for g in range(n_groups)]
    return torch.cat(groups, dim=dim)


def nxd_name(name: str) -> str:
    """Our name -> the name of the same tensor in NxDCausalLM's state dict."""
    for ours, theirs in MOE_NAMES.items():
        if name.endswith(ours):
            return PREFIX + name[: -len(ours)] + theirs
    return PREFIX + name


def our_name(name: str) -> str:
    """NxDCausalLM's name -> ours (the inverse of `nxd_name`)."""
    name = name.removeprefix(PREFIX)
    for ours, theirs in MOE_NAMES.items():
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name
