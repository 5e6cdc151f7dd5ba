"""FAKE neuronx_distributed.modules.moe.model.MoE (v2.28.0 signature, model.py:87-301) at TP = EP = 1."""

import torch
from torch import nn


class MoE(nn.Module):
    def __init__(self, router, expert_mlps, shared_experts=None, rmsnorm: torch.nn.Module | None = None,
                 sequence_parallel_enabled: bool = False, sequence_dimension: int | None = None,
                 return_router_logits: bool = False, return_expert_index: bool = False,
                 token_shuffle_group_size: int = 1, token_shuffle_seed=None, tensor_model_parallel_group=None,
                 init_tkg_module: bool = False, tkg_config=None):
        super().__init__()
        assert (router.num_experts, router.top_k) == (expert_mlps.num_experts, expert_mlps.top_k)
        if router.sequence_parallel_enabled:  # model.py:109-113
            assert sequence_parallel_enabled, "a router in SP needs the MoE in SP"
            assert router.sequence_dimension == (0 if sequence_dimension is None else sequence_dimension)
        self.router, self.expert_mlps = router, expert_mlps
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension
        self.return_router_logits, self.return_expert_index = return_router_logits, return_expert_index

    def forward(self, hidden_states, padding_mask=None, is_speculative_decoding=False, residual=None):
        if not self.training and self.router.sequence_parallel_enabled != self.expert_mlps.sequence_parallel_enabled:
            raise RuntimeError("router and ExpertMLPs disagree on sequence parallelism: eval gathers the wrong "
                               "sizes (expert_mlps_v2.py:503-511)")
        router_logits, expert_affinities, expert_index = self.router(hidden_states)
        shape = hidden_states.shape
        seq_len = shape[self.sequence_dimension]  # model.py:196
        output = self.expert_mlps(hidden_states.reshape(-1, shape[-1]), expert_affinities, expert_index, seq_len)
        result = (output.view(shape),)
        if self.return_router_logits:
            result += (router_logits,)
        if self.return_expert_index:
            result += (expert_index,)
        return result
