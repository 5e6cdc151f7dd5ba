"""The one dense MLP: SwiGLU, used for dense layers and for an MoE layer's shared expert.

`gate_up_proj` holds the gate rows then the up rows (one matmul), `down_proj` maps back:
down(silu(gate(x)) * up(x)). The experts compute the same function with stacked weights
(moe.model.moe.Experts).

Checkpoints written before the shared expert was a SwiGLU name its weights `shared_expert.gate_up`
and `shared_expert.down`; `upgraded` renames them wherever a checkpoint is read (the formats in
moe/checkpoint/), so those checkpoints still load.
"""
from __future__ import annotations

import torch
from torch import nn

from moe.model.routing import swiglu

# old state_dict suffix -> today's
RENAMED = {"shared_expert.gate_up.weight": "shared_expert.gate_up_proj.weight",
           "shared_expert.down.weight": "shared_expert.down_proj.weight"}


class SwiGLU(nn.Module):
    """Dense FFN: down(silu(gate(x)) * up(x)); gate and up fused in one gate_up_proj ([gate | up] rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x)))


def current_name(key: str) -> str:
    """A state_dict key under today's names (unchanged unless it is one of RENAMED's)."""
    for old, new in RENAMED.items():
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def upgraded(state: dict) -> dict:
    """`state` with keys renamed by current_name (the same dict when none needs it)."""
    if not any(key.endswith(tuple(RENAMED)) for key in state):
        return state
    return {current_name(key): value for key, value in state.items()}
