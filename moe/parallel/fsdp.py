"""FSDP2 (`torch.distributed.fsdp.fully_shard`) of a model, torchtitan's recipe for MoE
(torchtitan/models/llama4/infra/parallelize.py, apply_fsdp).

Each block is one FSDP unit on the dense mesh (its weights all-gathered before its forward,
gradients reduce-scattered after its backward); the root unit holds the embeddings, the final
norm and the LM head. A MoE block's experts are a unit of their own on the expert mesh (the ranks
that hold the same experts, efsdp), sharded on dim 1 (hidden or intermediate size: a rank may hold
a single expert, fewer rows than the shard group has ranks), and their gradient is divided by dp,
not by the expert mesh's size: each expert's gradient already sums the tokens of every rank that
sent it some (every TP rank sends its own share of the tokens, moe.parallel.token_shard), as
torchtitan sets the divide factor.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from moe.model.moe import Experts
from moe.parallel.apply import WRAPPED, block_slots


def _inner(module: nn.Module) -> nn.Module:
    return module._modules.get(WRAPPED, module)


def apply_fsdp(model: nn.Module, meshes, expert_divide_factor: int, reshard_after_forward: bool,
               mp_policy=None, sum_only: bool = False, offload_experts: bool = False) -> nn.Module:
    """fully_shard every block (and its experts), then the root; `meshes` is moe.parallel.dims.Meshes.
    sum_only: reduce with SUM and divide apart (gloo has neither AVG nor PREMUL_SUM, which NCCL uses); not on
    an experts unit with one rank in its shard group where torch copies instead (2.13), which would divide
    twice (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: the one-rank copy divides by the factor
    at :629, forced sums set the post-divide to the factor at :867, applied again at :686).
    offload_experts: the experts' units keep their shards, gradients and (so) AdamW states in host memory
    (CPUOffloadPolicy: each forward and backward copies the shard in before the all-gather, each
    reduce-scatter's gradient out; the optimizer steps them on the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    options = {"reshard_after_forward": reshard_after_forward,
               "mp_policy": mp_policy or MixedPrecisionPolicy()}
    expert_options = dict(options)
    if offload_experts:  # in for their block's forward and backward only, whatever parallel.zero_stage says
        expert_options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        expert_options["reshard_after_forward"] = True
    for parent, name in block_slots(model):
        block = getattr(parent, name)
        inner = _inner(block)
        if inner.is_moe:
            experts = inner.ffn.experts
            fully_shard(experts, mesh=meshes.experts, shard_placement_fn=lambda _: Shard(1), **expert_options)
            experts.set_gradient_divide_factor(expert_divide_factor)
        # a multi-token-prediction depth is one unit with its block (its norms and eh_proj around it)
        fully_shard(parent if name == "block" else block, mesh=meshes.dense, **options)
    # The root (embeddings, final norm, LM head) keeps its weights from forward to backward, torch's default
    # for a root (torchtitan leaves it so): its backward starts right after forward, so freeing them gains
    # no memory, and torch <= 2.11 hooks the re-gather on `tree_flatten(output)` only (moe.model.pytree).
    fully_shard(model, mesh=meshes.dense, **{**options, "reshard_after_forward": False})
    if sum_only:
        # the shard dim is the last one, HSDP or not
        experts_alone = meshes.experts.size(-1) == 1 and _one_rank_copy_divides()
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                if not (experts_alone and isinstance(_inner(module), Experts)):
                    module.set_force_sum_reduction_for_comms(True)
    return model


def _one_rank_copy_divides() -> bool:
    """Whether this torch's FSDP2 copies a one-rank shard group's gradient instead of reduce-scattering it,
    dividing the copy by the factor (torch 2.13 _fsdp_collectives.py:618-630). torch 2.9 reduce-scatters
    with the op even on one rank: there a forced sum is the only way gloo runs it (no PREMUL_SUM), and
    divides once."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return "world_size > 1" in inspect.getsource(_fsdp_collectives.foreach_reduce)


@contextlib.contextmanager
def experts_held_back(model: nn.Module) -> Iterator[None]:
    """Every MoE layer's experts out of the module tree for the duration: what moves the model to its device
    leaves the experts that apply_fsdp(offload_experts=True) keeps in host memory where they are.

    Lightning's ModelParallelStrategy moves the whole model after configure_model
    (lightning/pytorch/strategies/model_parallel.py:180, model_to_device); on a GPU that move reaches the
    pinned expert shards and stops the run (H100, torch 2.11: "_apply(): Couldn't swap FSDPExperts.gate_up"),
    and were it to succeed the experts would no longer be offloaded. Each experts module is an FSDP unit of
    its own, so its parent's unit re-points only its own shards after the move (FSDPModule._apply)."""
    held = [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if isinstance(child, Experts)]
    for parent, name, _ in held:
        parent._modules[name] = None
    try:
        yield
    finally:
        for parent, name, child in held:
            parent._modules[name] = child

