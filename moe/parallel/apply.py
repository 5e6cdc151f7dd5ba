"""Parallelism applied to a built model, torchtitan style: the model itself never mentions ranks.

Order when combining: `apply_ep` (shards experts, installs the all-to-all dispatcher),
`apply_token_shard` (EP folded with TP), then `apply_load_balance_group`, `apply_ac`, then
`apply_compile`. Every function edits the model in
place and returns it. State-dict keys do not change, so a checkpoint written with one policy
loads under another. Values are validated before (moe.config.validate).
"""
from __future__ import annotations

import functools
from collections import deque

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe.errors import ConfigError
from moe.model.moe import MoELayer
from moe.parallel.comm import group_sum
from moe.parallel.expert_exchange import AllToAllDispatcher

WRAPPED = "_checkpoint_wrapped_module"  # torch's name (torch.distributed.algorithms._checkpoint)


class CheckpointWrapper(nn.Module):
    """Recompute the wrapped module's forward during backward instead of keeping its activations.

    Non-reentrant `torch.utils.checkpoint` (RNG state restored, so router jitter replays the
    same). Skipped when no gradient is being recorded (eval, generation with a KV cache).
    State-dict keys are the wrapped module's own. The child is named as torch's own checkpoint
    wrapper names it (`_checkpoint_wrapped_module`), which torch.distributed.checkpoint's state-dict
    helpers strip from parameter names, so optimizer-state names match model keys in a sharded
    checkpoint whatever the policy (torch/distributed/checkpoint/state_dict.py `_get_fqns`).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        setattr(self, WRAPPED, module)
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    @torch.compiler.disable  # the checkpoint boundary stays eager; apply_compile compiles inside it
    def forward(self, *args, **kwargs):
        if not (torch.is_grad_enabled() and self.training):
            return self._modules[WRAPPED](*args, **kwargs)
        return checkpoint(self._modules[WRAPPED], *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[WRAPPED], name)


def _strip_prefix(module, state_dict, prefix, local_metadata):
    inner = f"{prefix}{WRAPPED}."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_prefix(module, state_dict, prefix, *_):
    inner = f"{prefix}{WRAPPED}."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def block_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every decoder block, as `getattr(parent, attribute)`: model.layers' (named by
    their index in the whole model), then each multi-token-prediction depth's (moe.model.mtp, `block`), so a
    policy that wraps, shards or compiles blocks reaches all of them."""
    slots = [(model.layers, name) for name, _ in model.layers.named_children()]
    return slots + [(depth, "block") for depth in getattr(model, "mtp", None) or ()]


def apply_ac(model: nn.Module, policy: str, every_n: int = 1) -> nn.Module:
    """Activation checkpointing on the decoder blocks (`model.layers` and the multi-token-prediction depths'
    blocks, by their layer index).

    none: nothing. full: every block. every_n: blocks i with (i + 1) % every_n == 0 (the
    N-th, 2N-th, ... block). moe_only: blocks whose FFN is an MoELayer. selective: the core
    attention (softmax(qk)v) of every block and the experts' MLPs of every MoE layer (and its
    shared expert), the parts whose activations are large for their compute, as Megatron-Core's
    selective recompute of core attention and its MoE-selective recompute of the expert MLPs: the
    router, the capacity cut and the dispatch (the all-to-all under EP) run once, so recompute
    never repeats a collective nor meets a near-tie that routes differently the second time.
    Projections and dense FFNs keep their activations.
    """
    for parent, name in block_slots(model):
        block = getattr(parent, name)
        i = block.layer_idx  # the layer's index in the whole model (num_layers + d for depth d's)
        if isinstance(block, CheckpointWrapper) or isinstance(block.attn.core, CheckpointWrapper):
            raise ConfigError("parallel.activation_checkpointing", policy,
                              "apply activation checkpointing once, on a freshly built model",
                              "is applied twice")
        if policy == "selective":
            block.attn.core = CheckpointWrapper(block.attn.core)
            if block.is_moe:
                block.ffn.experts = CheckpointWrapper(block.ffn.experts)
                if block.ffn.shared_expert is not None:
                    block.ffn.shared_expert = CheckpointWrapper(block.ffn.shared_expert)
        elif (policy == "full" or (policy == "every_n" and (i + 1) % every_n == 0)
              or (policy == "moe_only" and block.is_moe)):
            setattr(parent, name, CheckpointWrapper(block))
            if block.is_moe and hasattr(block.ffn.dispatcher, "replay"):  # recomputed: reuse its host values
                block.ffn.dispatcher.replay = deque()
    return model


def clear_replays(model: nn.Module) -> None:
    """Forget host values kept for recomputation that never came (a forward without its backward)."""
    for layer in moe_layers(model):
        if getattr(layer.dispatcher, "replay", None):
            layer.dispatcher.replay.clear()


def apply_ep(model: nn.Module, ep_group) -> nn.Module:
    """Expert parallelism over `ep_group`: each MoELayer keeps experts [r*E/ep, (r+1)*E/ep) of rank r,
    routes over all E, sends rows to their expert's rank with an `AllToAllDispatcher`, and sums its
    routing statistics over the group (so the losses are those of one process routing all its tokens)."""
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for layer in moe_layers(model):
        local = layer.num_experts // ep
        layer.experts.shard(rank * local, local)
        layer.dispatcher = AllToAllDispatcher(ep_group)
        if layer.stats_sum is None:
            layer.stats_sum = functools.partial(group_sum, group=ep_group)
    return model


def apply_token_shard(model: nn.Module, tp_group, sequence_parallel: bool = False) -> nn.Module:
    """Each MoE layer routes its share of the tokens of `tp_group` (moe.parallel.token_shard): no expert
    multiplies a token on two TP ranks. Without sequence parallelism it splits them before routing and
    gathers its outputs back; with it, the model splits every sequence after the embeddings."""
    from moe.parallel.token_shard import SequenceParallelTokenShard, SequenceShard, TPTokenShard

    shard = SequenceParallelTokenShard if sequence_parallel else TPTokenShard
    for layer in moe_layers(model):
        layer.token_shard = shard(tp_group)
    if sequence_parallel:
        model.sequence_shard = SequenceShard(tp_group)
    return model


def apply_load_balance_group(model: nn.Module, group) -> nn.Module:
    """Routing statistics (load balance, z-loss, drops) over every rank of `group`, e.g. all data-parallel
    ranks: Megatron's global-batch balancing, where N ranks give the loss of one process holding all N
    micro-batches (moe_opt.aux_loss_group=dp)."""
    for layer in moe_layers(model):
        layer.stats_sum = functools.partial(group_sum, group=group)
    return model


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def apply_compile(model: nn.Module) -> nn.Module:
    """torch.compile each block in place (`Module.compile`, so parameter names stay unchanged).

    A block's MoE layer is a break in its block's graph and compiles its own regions instead
    (`MoELayer.compile_regions`, fullgraph): the routing and dispatch before the experts, the combine and
    routing statistics after them, and the SwiGLU between the experts' grouped GEMMs. The experts stay eager
    (under FSDP2 they are their own unit, and fp32 `torch._grouped_mm` has no traceable kernel); so do the
    routing and combine under expert parallelism, a token split over TP or a statistics all-reduce (their
    collectives and host-read sizes; the SwiGLU still compiles). Anything inside a CheckpointWrapper stays
    eager (torch recomputes checkpointed code with dynamo disabled, so a compiled forward would not match its
    recomputation): with `selective` AC the rest of each block is compiled.
    """
    eager = 0
    blocks = [getattr(parent, name) for parent, name in block_slots(model)]
    for block in blocks:
        if isinstance(block, CheckpointWrapper):
            eager += 1
            continue
        for layer in moe_layers(block):
            layer.forward = torch.compiler.disable(layer.forward)
            layer.compile_regions()
        block.compile()
    if eager:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"model.compile=true compiles nothing in the {eager} of {len(blocks)} blocks "
                       "that activation checkpointing wraps whole (parallel.activation_checkpointing=full, "
                       "every_n or moe_only): they run eager. parallel.activation_checkpointing=selective "
                       "compiles each block's projections and norms and its MoE layer's routing and combine; "
                       "the experts' grouped GEMMs stay eager either way.")
    return model
