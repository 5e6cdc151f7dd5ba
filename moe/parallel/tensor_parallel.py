"""Tensor parallelism with DTensor parallel styles (torch.distributed.tensor.parallel), Megatron's split.

Attention: `qkv_proj` column-parallel (each TP rank computes its heads' q, k and v), `o_proj`
row-parallel (its output all-reduced over the TP group). Dense SwiGLU: `gate_up_proj`
column-parallel, `down_proj` row-parallel. Embeddings, norms, the router, the LM head and the
experts stay whole on every TP rank (their gradients are equal there: a column-parallel layer
all-reduces its input gradient); experts are spread by expert parallelism instead.

The two fused projections ([q | k | v] rows, [gate | up] rows) cannot be cut into contiguous
chunks: TP rank t needs rows q_t, k_t, v_t. Their DTensor holds the rows *TP-interleaved*
([q_0 k_0 v_0 | q_1 k_1 v_1 | ...]), so `Shard(0)` gives every rank its own heads, and
`moe.parallel.placement` maps interleaved rows back to the canonical layout for initial values and
checkpoints, which therefore do not depend on tp.

Multi-head latent attention (moe/model/mla.py) as torchtitan splits it
(torchtitan/models/deepseek_v3/sharding.py:109-133 at b5bcd76): the per-head up-projections
(`q_proj` or `q_b_proj`, `kv_b_proj`) column-parallel, `o_proj` row-parallel, the latent
down-projections and their norms whole on every rank. Their rows are whole heads in order, so
plain contiguous chunks: no interleave. The decoupled RoPE key is shared by every head, so each
rank's heads give it only part of its gradient: `MLAttention.tp_group` sums that over the TP
group in the backward (Megatron's copy-to-tensor-parallel-region).
"""
from __future__ import annotations

import torch
from torch import nn

from moe.config.derived import dense_width, head_dim_of
from moe.model.attention import Attention
from moe.model.mla import MLAttention


def fused_segments(name: str, model_cfg) -> list[int] | None:
    """Canonical row segments of a fused projection's weight (`name` as state_dict spells it), else None."""
    if name.endswith("attn.qkv_proj.weight"):
        head_dim = head_dim_of(model_cfg)
        kv = model_cfg.num_kv_heads * head_dim
        return [model_cfg.num_heads * head_dim, kv, kv]
    if name.endswith("ffn.gate_up_proj.weight"):  # a dense block's SwiGLU (experts are not TP-split)
        return [dense_width(model_cfg)] * 2
    return None


def interleave_order(segments: list[int], tp: int) -> torch.Tensor:
    """Canonical row index of each TP-interleaved row: rank t's rows of every segment, rank by rank."""
    starts = [sum(segments[:i]) for i in range(len(segments))]
    return torch.cat([torch.arange(start + t * (size // tp), start + (t + 1) * (size // tp))
                      for t in range(tp) for start, size in zip(starts, segments, strict=True)])


def canonical_runs(first: int, count: int, segments: list[int], tp: int) -> list[tuple[int, int, int]]:
    """Interleaved rows [first, first + count) as runs (offset in them, length, canonical first row)."""
    order = interleave_order(segments, tp)[first:first + count].tolist()
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(order):
        if runs and runs[-1][2] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((i, 1, row))
    return runs


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Column/row-parallel attention (GQA or MLA) and dense layers' MLPs over `tp_mesh` (meta device or
    not); a shared expert stays whole, as the experts do."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in model.layers:
        if not block.is_moe:
            parallelize_module(block.ffn, tp_mesh, {"gate_up_proj": ColwiseParallel(),
                                                    "down_proj": RowwiseParallel()})
    for module in model.modules():
        if isinstance(module, Attention):
            parallelize_module(module, tp_mesh, {"qkv_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
            module.split_sizes = [size // tp for size in module.split_sizes]  # this rank's heads
        elif isinstance(module, MLAttention):
            queries = "q_proj" if hasattr(module, "q_proj") else "q_b_proj"
            parallelize_module(module, tp_mesh, {queries: ColwiseParallel(), "kv_b_proj": ColwiseParallel(),
                                                 "o_proj": RowwiseParallel()})
            module.tp_group = tp_mesh.get_group()
    return model
