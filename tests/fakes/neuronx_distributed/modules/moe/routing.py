"""FAKE neuronx_distributed.modules.moe.routing.RouterTopK (v2.28.0 signature and maths, routing.py:26-210)."""

import torch
import torch.nn.functional as F
from torch import nn


class RouterTopK(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, sequence_parallel_enabled: bool = False,
                 sequence_dimension: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu"), bias: bool = False, tensor_model_parallel_group=None,
                 act_fn="softmax", apply_act_fn_over_topk: bool = False, jitter_eps: float = 0.0,
                 store_transposed_weights: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"Invalid top_k={top_k} for num_experts={num_experts}")
        if act_fn not in {"sigmoid", "softmax"}:
            raise ValueError("act_fn must be either 'sigmoid' or 'softmax'")
        self.num_experts, self.top_k, self.hidden_size, self.jitter_eps = num_experts, top_k, hidden_size, jitter_eps
        self.act_fn = act_fn
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_parallel_enabled and sequence_dimension is None else sequence_dimension
        self.linear_router = nn.Linear(hidden_size, num_experts, dtype=dtype, device=device, bias=bias)
        self.linear_router.weight.sequence_parallel_enabled = sequence_parallel_enabled

    def forward(self, hidden_states):
        hidden_states = hidden_states.to(dtype=self.linear_router.weight.dtype)
        if self.jitter_eps != 0.0 and self.training:  # in place, as routing.py:94-97
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        router_logits = self.linear_router(hidden_states).view(-1, self.num_experts)
        if self.act_fn == "sigmoid":  # apply_activation_fn, routing.py:116-126, in fp64
            expert_affinities = torch.sigmoid(router_logits.to(dtype=torch.float64))
        else:
            expert_affinities = F.softmax(router_logits, dim=1, dtype=torch.float64)
        _, expert_index = torch.topk(router_logits, self.top_k)
        return router_logits, expert_affinities.to(dtype=hidden_states.dtype), expert_index.detach().long()
