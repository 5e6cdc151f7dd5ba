"""Our model with neuronx-distributed's parallel layers swapped in, built on the meta device and
materialised shard by shard from the same initial values every backend uses.

`build_model` is NxD's `model_fn`: it runs under NxD's meta-device context
(trainer/trainer.py:159-168 with model_init_config meta_device_init, as NxD's Mixtral recipe,
examples/training/mixtral/mixtral_pretrain/run_mixtral_pretrain_ptl.py:142-151), so no rank ever
holds more than its own shard. NxD then gives every module of the local pipeline stage empty CPU
parameters of the local shard's shape and calls `param_init_fn(module, device)`
(utils/model_utils.py:220-229, :335-356), which fills them with this rank's piece of the full value
(moe.model.init for a fresh run, a Mixtral directory for model.init_from_hf; moe/backends/neuron/
nxd_checkpoint.py says which piece). The full value of a stacked expert tensor is drawn one expert at a
time, so the transient host memory is one expert, not the layer.

Layers (neuronx-distributed v2.28.0, src/neuronx_distributed/parallel_layers/layers.py:205, :588,
:847): vocabulary-parallel embedding and LM head; the fused qkv as one ColumnParallelLinear whose
rank holds its own heads' [q | k | v] rows (so tp divides num_kv_heads: there is no KV replication
here); o_proj and the dense down_proj as RowParallelLinear; the dense gate_up as a stride-2
ColumnParallelLinear ([gate | up] per rank); MoE layers as NxD's MoE (nxd_moe_layer.py). With sequence
parallelism activations are sequence-first ([S / tp, B, H], causal_lm.SEQUENCE_DIM) and norm weights are
marked
`sequence_parallel_enabled`, whose gradients NxD's optimizer all-reduces over TP
(parallel_layers/grads.py:330-346, trainer/optimizer.py:124-128).
"""
from __future__ import annotations

import functools

import torch
from neuronx_distributed.parallel_layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    parallel_state,
)
from neuronx_distributed.parallel_layers.layers import SPMDRank, set_tensor_model_parallel_attributes
from torch import nn

from moe.backends.neuron.causal_lm import SEQUENCE_DIM, NxDCausalLM, StageBlock
from moe.backends.neuron.nxd_checkpoint import NXD_LAYOUT, local_shard, our_name, split_of
from moe.backends.neuron.nxd_moe_layer import NxDMoELayer
from moe.config.schema import ModelConfig, MoEOptConfig
from moe.model.expert_layout import EXPERT_LAYOUT, stored
from moe.model.init import init_stds, initial_values
from moe.model.model import MoETransformer, alibi_slopes

NAMES = "_moe_param_names"  # module attribute: parameter key -> our name, for param_init_fn


def build_model(model: ModelConfig, moe_opt: MoEOptConfig, seed: int, sequence_parallel: bool) -> NxDCausalLM:
    """NxD's model_fn: our model (meta), its layers swapped for NxD's, under the training forward."""
    transformer = MoETransformer(model, moe_opt, init_seed=seed, block_cls=StageBlock)
    swap_layers(transformer, model, moe_opt, sequence_parallel)
    causal_lm = NxDCausalLM(transformer, sequence_parallel)
    for name, module in causal_lm.named_modules():
        setattr(module, NAMES, {key: our_name(f"{name}.{key}") for key, p in module._parameters.items()
                                if p is not None})
    return causal_lm


def swap_layers(transformer: MoETransformer, model: ModelConfig, moe_opt: MoEOptConfig, sp: bool) -> None:
    tp = parallel_state.get_tensor_model_parallel_size()
    H, V = model.hidden_size, model.vocab_size
    parallel = dict(bias=False, sequence_parallel_enabled=sp, sequence_dimension=SEQUENCE_DIM)
    transformer.embed_tokens = ParallelEmbedding(V, H)
    transformer.lm_head = ColumnParallelLinear(H, V, gather_output=False, **parallel)
    _mark_sequence_parallel(transformer.norm, sp)
    for block in transformer.layers:
        attn = block.attn
        q, kv, _ = attn.split_sizes
        attn.qkv_proj = ColumnParallelLinear(H, q + 2 * kv, gather_output=False,
                                             **{**parallel, "bias": model.qkv_bias})
        attn.o_proj = RowParallelLinear(q, H, input_is_parallel=True, **{**parallel, "bias": model.o_bias})
        _swap_head_parameters(attn, tp)
        attn.num_heads, attn.num_kv_heads = attn.num_heads // tp, attn.num_kv_heads // tp
        attn.split_sizes = [size // tp for size in attn.split_sizes]
        attn.sequence_first = sp  # causal_lm.SEQUENCE_DIM
        if model.position_encoding == "alibi":  # this rank's heads' slopes
            rank = parallel_state.get_tensor_model_parallel_rank()
            slopes = alibi_slopes(model.num_heads)[rank * attn.num_heads:(rank + 1) * attn.num_heads]
            attn.register_buffer("alibi_slopes", slopes, persistent=False)
        for norm in (block.attn_norm, block.ffn_norm):
            _mark_sequence_parallel(norm, sp)
        if block.is_moe:
            block.ffn = NxDMoELayer(model, moe_opt, sp, init_method=_unused_init)
        else:
            F = block.ffn.down_proj.in_features
            block.ffn.gate_up_proj = ColumnParallelLinear(H, 2 * F, gather_output=False, stride=2, **parallel)
            block.ffn.down_proj = RowParallelLinear(F, H, input_is_parallel=True, **parallel)


def _swap_head_parameters(attn: nn.Module, tp: int) -> None:
    """What our attention computes on this rank's heads (model.attention_sinks, model.qk_norm=per_head).

    The sinks [heads] become this rank's heads' [heads / tp], a tensor-parallel parameter as NxD marks its
    own (set_tensor_model_parallel_attributes, parallel_layers/utils.py:55): NxD's gradient norm then
    counts each rank's piece once (parallel_layers/grads.py:145-148), and no rank needs another's gradient.
    A per-head QK-norm weight is one weight every head reads: this rank's heads give part of its gradient,
    which NxD sums over TP only for parameters marked sequence parallel and only in a sequence-parallel
    run (trainer/optimizer.py:127-128, parallel_layers/grads.py:330-346), so the attention sums it itself
    over NxD's tensor-parallel group (moe.model.attention.SumGradOver, the all-reduce NxD's gradient norm
    makes over that group, grads.py:99-104)."""
    if attn.sinks is not None:
        attn.sinks = nn.Parameter(torch.empty(attn.num_heads // tp, device=attn.sinks.device))
        set_tensor_model_parallel_attributes(attn.sinks, True, dim=0, stride=1, num_partitions=tp)
    if attn.qk_norm == "per_head" and tp > 1:
        attn.tp_group = parallel_state.get_tensor_model_parallel_group()


def _mark_sequence_parallel(norm: nn.Module, sp: bool) -> None:
    norm.weight.sequence_parallel_enabled = sp


def _unused_init(weight: torch.Tensor) -> None:
    """NxD layers built on the meta device are never initialised by their init_method."""


def init_from(source, model: ModelConfig):
    """NxD's param_init_fn: fill a module's (empty, local-shard) parameters from `source`.

    `source(name, shape, first_expert)` gives the full value of our parameter `name` (for a stacked
    expert tensor, the experts [first_expert, first_expert + shape[0]), in our stored layout, which
    this turns into NXD_LAYOUT). A rank holds the experts of its expert-parallel rank (all of them
    at ep 1), each split over tensor-parallel ranks.
    """
    return functools.partial(_init_module, source=source, model=model)


@torch.no_grad()
def _init_module(module: nn.Module, device, *, source, model: ModelConfig) -> None:
    if isinstance(module, SPMDRank):
        _fill_spmd_rank(module)
        return
    names = getattr(module, NAMES, {})
    tp = parallel_state.get_tensor_model_parallel_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for key, param in module._parameters.items():
        if param is None:
            continue
        name = names[key]
        split = split_of(name, model)
        full_shape = list(param.shape)
        if split.dim is not None:
            full_shape[split.dim] *= tp
        if EXPERT_LAYOUT.is_expert_tensor(name):
            full_shape[0] = 1  # one expert at a time
            first = parallel_state.get_expert_model_parallel_rank() * param.shape[0]
            ours = NXD_LAYOUT.convert_shape(full_shape, stored())
            values = torch.cat([local_shard(stored().convert(source(name, ours, first + e), NXD_LAYOUT),
                                            split, rank, tp)
                                for e in range(param.shape[0])])
        else:
            values = local_shard(source(name, tuple(full_shape), None), split, rank, tp)
        param.copy_(values.to(param.dtype))


def _fill_spmd_rank(module) -> None:
    """What NxD's inference checkpoints carry for SPMDRank (create_spmd_ranks, modules/moe/
    expert_mlps_v2.py:1499-1527): this rank's global rank and, under expert parallelism, its experts
    (parallel_state.get_experts_for_expert_parallel_rank, parallel_layers/parallel_state.py:999)."""
    module.rank.fill_(torch.distributed.get_rank())
    if hasattr(module, "local_expert_indices"):
        ep = parallel_state.get_expert_model_parallel_size()
        experts = parallel_state.get_experts_for_expert_parallel_rank(
            parallel_state.get_expert_model_parallel_rank(), module.local_expert_indices.shape[1] * ep, ep)
        module.local_expert_indices.copy_(torch.tensor([experts], dtype=torch.int32))



def random_init(model: ModelConfig, seed: int):
    """moe.model.init's values for the run's seed: what every backend starts from."""
    std, out_std = init_stds(model)

    def source(name, shape, first_expert):
        return initial_values(name, shape, seed, std, out_std, first_expert=first_expert)

    return source
