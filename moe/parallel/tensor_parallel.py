"""Tensor parallelism with DTensor parallel styles (torch.distributed.tensor.parallel), Megatron's split.

Attention: `qkv_proj` column-parallel (each TP rank computes its heads' q, k and v; its bias, model.qkv_bias,
split with its rows), `o_proj` row-parallel (its output all-reduced over the TP group; its bias, model.o_bias,
whole on every rank and added once, torch's RowwiseParallel), the sinks (model.attention_sinks) split by
head as the queries are (Shard(0): each rank's heads are a contiguous run of them). A per-head QK-norm
(model.qk_norm=per_head) stays whole on every rank, its gradient summed over the TP group (each rank's heads
give part of it); a full-width one would need the whole projection and is refused under TP
(moe.backends.fsdp2.rules).
Dense SwiGLU: `gate_up_proj` column-parallel, `down_proj` row-parallel. Embeddings, norms and the LM head
stay whole on every TP rank (their gradients are equal there: a column-parallel layer all-reduces its input
gradient). The MoE layer is not split by TP: it splits its tokens over the TP ranks instead and spreads the
experts by expert parallelism (moe.parallel.token_shard; its router's and shared expert's
gradients are summed over TP).

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
from moe.parallel.apply import block_slots


def fused_segments(name: str, model_cfg) -> list[int] | None:
    """Canonical row segments of a fused projection's weight (`name` as state_dict spells it), else None."""
    if name.endswith(("attn.qkv_proj.weight", "attn.qkv_proj.bias")):
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


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Column/row-parallel attention (GQA or MLA) and dense layers' MLPs over `tp_mesh` (meta device or
    not); a shared expert stays whole, as the experts do.

    sequence_parallel: their input arrives split along the sequence (Shard(1)) and is all-gathered on
    entry, their row-parallel output is reduce-scattered back to Shard(1) instead of all-reduced
    (torchtitan's plan, torchtitan/models/llama3/infra/parallelize.py apply_tp: PrepareModuleInput
    Shard(1) -> Replicate, RowwiseParallel(output_layouts=Shard(1))). Latent attention's whole-width
    down-projections take plain tensors, so its gathered input is handed over as one (the backward then
    all-reduces and slices instead of reduce-scattering)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    out = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()

    def gather_input(module: nn.Module, args: int, local: bool = False) -> None:
        if sequence_parallel:
            rest = (None,) * (args - 1)  # kv cache, position offset, mask, documents: not tensors to lay out
            parallelize_module(module, tp_mesh, PrepareModuleInput(
                input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest),
                use_local_output=local))

    for block in (getattr(parent, name) for parent, name in block_slots(model)):
        if not block.is_moe:
            gather_input(block.ffn, 1)
            parallelize_module(block.ffn, tp_mesh, {"gate_up_proj": ColwiseParallel(), "down_proj": out})
    for module in model.modules():
        if isinstance(module, Attention):
            gather_input(module, 5)
            parallelize_module(module, tp_mesh, {"qkv_proj": ColwiseParallel(), "o_proj": out})
            module.split_sizes = [size // tp for size in module.split_sizes]  # this rank's heads
            module.tp_group = tp_mesh.get_group()  # a per-head qk_norm weight's gradient: summed over it
            if module.sinks is not None:  # attend() takes this rank's heads' sinks (to_local)
                module.sinks = nn.Parameter(distribute_tensor(module.sinks, tp_mesh, [Shard(0)]))
        elif isinstance(module, MLAttention):
            gather_input(module, 5, local=True)
            queries = "q_proj" if hasattr(module, "q_proj") else "q_b_proj"
            parallelize_module(module, tp_mesh, {queries: ColwiseParallel(), "kv_b_proj": ColwiseParallel(),
                                                 "o_proj": out})
            module.tp_group = tp_mesh.get_group()
    return model
