"""Parallelism applied to a built model, torchtitan style: the model itself never mentions ranks.

Order when combining: `apply_ep` (shards experts), then `apply_ac`, then `apply_compile`.
Every function edits the model in place and returns it. State-dict keys do not change, so a
checkpoint written with one policy loads under another.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe.errors import ConfigError
from moe.moe_layer import MoELayer

AC_POLICIES = ("none", "full", "every_n", "moe_only", "selective")


class CheckpointWrapper(nn.Module):
    """Recompute the wrapped module's forward during backward instead of keeping its activations.

    Non-reentrant `torch.utils.checkpoint` (RNG state restored, so router jitter replays the
    same). Skipped when no gradient is being recorded (eval, generation with a KV cache).
    State-dict keys are the wrapped module's own, without a `module.` prefix.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    @torch.compiler.disable  # the checkpoint boundary stays eager; apply_compile compiles inside it
    def forward(self, *args, **kwargs):
        if not (torch.is_grad_enabled() and self.training):
            return self.module(*args, **kwargs)
        return checkpoint(self.module, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _strip_prefix(module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(prefix + "module.")]:
        state_dict[prefix + key[len(prefix + "module."):]] = state_dict.pop(key)


def _add_prefix(module, state_dict, prefix, *_):
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "module.")]:
        state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)


def apply_ac(model: nn.Module, policy: str, every_n: int = 1) -> nn.Module:
    """Activation checkpointing on `model.layers`.

    none: nothing. full: every block. every_n: blocks i with (i + 1) % every_n == 0 (the
    N-th, 2N-th, ... block). moe_only: blocks whose FFN is an MoELayer. selective: only the
    FFN/MoE sub-module of every block (attention activations are kept).
    """
    if policy not in AC_POLICIES:
        raise ConfigError("parallel.activation_checkpointing", policy, f"use one of {', '.join(AC_POLICIES)}")
    if policy == "every_n" and every_n < 1:
        raise ConfigError("parallel.activation_checkpointing_every_n", every_n, "use a positive integer")
    for i, block in enumerate(model.layers):
        if isinstance(block, CheckpointWrapper) or isinstance(block.ffn, CheckpointWrapper):
            raise ConfigError("parallel.activation_checkpointing", policy,
                              "apply activation checkpointing once, on a freshly built model",
                              "is applied twice")
        if policy == "selective":
            block.ffn = CheckpointWrapper(block.ffn)
        elif (policy == "full" or (policy == "every_n" and (i + 1) % every_n == 0)
              or (policy == "moe_only" and block.is_moe)):
            model.layers[i] = CheckpointWrapper(block)
    return model


def apply_ep(model: nn.Module, ep_group) -> nn.Module:
    """Expert parallelism: each MoELayer keeps only this rank's slice of experts (dim 0)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.shard_experts(ep_group)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """torch.compile each block in place (`Module.compile`, so parameter names stay unchanged).

    Left eager: MoE layers (their dispatch has data-dependent shapes that would recompile, and
    fp32 `torch._grouped_mm` has no traceable kernel) and anything inside a CheckpointWrapper
    (torch recomputes checkpointed code with dynamo disabled, so a compiled forward would not
    match its recomputation). With `selective` AC the attention half of each block is compiled.
    """
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.forward = torch.compiler.disable(module.forward)
    for block in model.layers:
        if not isinstance(block, CheckpointWrapper):
            block.compile()
    return model
