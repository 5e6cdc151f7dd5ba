"""FAKE neuronx_distributed.modules.moe.expert_mlps.ExpertMLPs at tensor and expert parallelism 1.

Signature of v2.28.0 (expert_mlps.py:53-102); the forward follows ExpertMLPsV2.forward
(expert_mlps_v2.py:1405-1497): capacity_factor None (or >= E/top_k, :267-269) runs every token
through every expert; <= 0 in training is the blockwise dropless path, which on a CPU falls back to
the same dense computation (:906-907); > 0 drops by position with capacity min(ceil(T*k*cf/E), T)
(:485-528); in eval a sequence of length 1 is token generation, every token through its experts with
no capacity (:1469-1484); a capacity factor <= 0 fails as the real one does (:1496-1497, :580), and an
ExpertMLPs whose sequence_parallel_enabled differs from the router's gathers the wrong sizes
(:503-511). Weights: mlp_op.gate_up_proj.weight [E, H, 2I] ([gate | up]), mlp_op.down_proj.weight
[E, I, H] (experts.py:93-145).
"""
import math
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import Parameter

from ...parallel_layers.layers import set_tensor_model_parallel_attributes

# the names the real signature's defaults use: GLUType (modules/moe/model_utils.py:20-25),
# DEFAULT_LNC_SIZE (model_utils.py:96, one NeuronCore per logical core on trn1), and neuronx-cc's
# BlockShardStrategy (expert_mlps.py:4), which only the blockwise NKI kernel reads
GLUType = Enum("GLUType", {"GLU": "glu", "SWIGLU": "swiglu"})
DEFAULT_LNC_SIZE = 1
BlockShardStrategy = Enum("BlockShardStrategy", ["HI_LO"])


class _ExpertLinear(nn.Module):
    def __init__(self, shape, partition_dim, stride, init_method, device, dtype):
        super().__init__()
        self.weight = Parameter(torch.empty(*shape, device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride, 1)
        if self.weight.device.type == "cpu":
            with torch.no_grad():
                for e in range(shape[0]):  # per expert (moe_parallel_layers.py:247-254)
                    init_method(self.weight[e])


class _Experts(nn.Module):
    def __init__(self, E, H, I, init_method, output_init_method, device, dtype):
        super().__init__()
        self.gate_up_proj = _ExpertLinear((E, H, 2 * I), 2, 2, init_method, device, dtype)
        self.down_proj = _ExpertLinear((E, I, H), 1, 1, output_init_method, device, dtype)

    def forward(self, x_TH):  # every token through every expert: [E, T, H]
        gate, up = torch.einsum("th,ehf->etf", x_TH, self.gate_up_proj.weight).chunk(2, dim=-1)
        return torch.einsum("etf,efh->eth", F.silu(gate) * up, self.down_proj.weight)


class ExpertMLPs(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 glu_mlp: bool, capacity_factor, sequence_parallel_enabled: bool = False, block_size=None,
                 normalize_top_k_affinities: bool = False, bias: bool = False, glu_type=GLUType.GLU,
                 hidden_act_scaling_factor: float = 1.0, hidden_act_bias: float = 0.0,
                 gate_clamp_upper_limit: float | None = None, gate_clamp_lower_limit: float | None = None,
                 up_clamp_upper_limit: float | None = None, up_clamp_lower_limit: float | None = None,
                 return_bias: bool = False, init_method=torch.nn.init.kaiming_uniform_,
                 output_layer_init_method=torch.nn.init.kaiming_uniform_, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu"), tensor_model_parallel_group=None,
                 expert_model_parallel_group=None, enable_spmd_rank: bool = False, blockwise_nki_autograd_cls=None,
                 use_torch_block_wise: bool = False, logical_nc_config=DEFAULT_LNC_SIZE, parallelize_token_to_block_mapping=True,
                 early_expert_affinity_modulation: bool = False, optimized_block_to_token_mapping: bool = True,
                 use_block_parallel: bool = False, always_augment_inputs_for_blockwise_matmul: bool = False,
                 block_sharding_strategy=BlockShardStrategy.HI_LO, skip_dma_token: bool = False, skip_dma_weight: bool = False,
                 tkg_tensor_model_parallel_group=None, tkg_expert_model_parallel_group=None,
                 cte_tensor_model_parallel_group=None, cte_expert_model_parallel_group=None, is_prefill=True,
                 enabled_hybrid_sharding=False, use_shard_on_intermediate_dynamic_while=False,
                 use_shard_on_block_dynamic_while=False, use_index_calc_kernel=False, expert_distribution=None):
        super().__init__()
        if return_bias:
            raise NotImplementedError("return_bias (expert_mlps_v2.py:95-96)")
        if normalize_top_k_affinities and top_k == 1:
            raise ValueError("normalize_top_k_affinities with top_k == 1 (expert_mlps_v2.py:270-271)")
        if hidden_act != "silu" or not glu_mlp:
            raise NotImplementedError("the fake implements SiLU GLU experts only")
        if capacity_factor is not None and capacity_factor >= num_experts / top_k:
            capacity_factor = None  # full capacity (expert_mlps_v2.py:267-269)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.normalize, self.sequence_parallel_enabled = normalize_top_k_affinities, sequence_parallel_enabled
        self.mlp_op = _Experts(num_experts, hidden_size, intermediate_size, init_method, output_layer_init_method,
                               device, dtype)

    def forward(self, hidden_states, expert_affinities, expert_index, seq_len, padding_mask=None,
                expert_affinities_masked_full=None):
        T, E = hidden_states.shape[0], self.num_experts
        mask_TE = torch.zeros(T, E, dtype=torch.long, device=hidden_states.device).scatter_(1, expert_index, 1)
        cf = self.capacity_factor
        if not self.training and cf is not None and cf <= 0:
            raise RuntimeError("cannot reshape tensor of 0 elements into shape [0, -1] (capacity 0 in eval)")
        if not self.training and seq_len == 1:
            cf = None  # token generation: no capacity
        if cf is not None and cf > 0:
            capacity = min(math.ceil(T * self.top_k * cf / E), T)
            mask_TE = mask_TE.masked_fill(torch.cumsum(mask_TE, dim=0) > capacity, 0)
        affinities_TE = expert_affinities * mask_TE
        if self.normalize:
            affinities_TE = F.normalize(affinities_TE, p=1.0, dim=1)
        out_ETH = self.mlp_op(hidden_states)
        return torch.einsum("eth,te->th", out_ETH, affinities_TE.to(out_ETH.dtype))
