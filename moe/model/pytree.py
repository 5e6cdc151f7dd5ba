"""Output dataclasses as pytree nodes, so that code which walks a module's output with `tree_flatten` finds
the tensors inside them.

FSDP2 registers its pre-backward hooks (which gather a resharded unit's weights again for its backward) on
the tensors of each unit's output: torch 2.13 walks dataclasses itself (torch/distributed/fsdp/
_common_utils.py collect_grad_tensors), torch <= 2.11 only `tree_flatten`s the output
(_fully_shard/_fsdp_state.py _register_pre_backward_hook), where an unregistered dataclass is one leaf.
DDP's unused-parameter search flattens outputs the same way.
"""
from __future__ import annotations

from torch.utils import _pytree


def pytree_dataclass(cls):
    """Register a dataclass as a pytree node whose children are its fields, in order (a class decorator);
    torch's own registration (torch/utils/_pytree.py register_dataclass, in every torch admitted)."""
    _pytree.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    return cls
