"""Multi-head latent attention (MLA): DeepSeek-V2 (arXiv:2405.04434 section 2.1) and DeepSeek-V3.

Keys and values come from one small latent per token, c_kv = norm(kv_a_proj(x)[:kv_lora_rank]),
expanded per head by kv_b_proj into a key part without position (qk_nope_head_dim) and the value
(v_head_dim). Position enters through a decoupled RoPE key of qk_rope_head_dim dims, the rest of
kv_a_proj's output, one head shared by every query head. Queries come from q_proj, or through a
latent of q_lora_rank (q_a_proj -> norm -> q_b_proj); each query head is [nope | rope] and the
scores are scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale(factor,
rope_mscale_all_dim)^2 when the RoPE is scaled (DeepSeek-V3's released config; moe/model/rope.py).

Parameter names follow transformers' DeepseekV3Attention (models/deepseek_v3/modeling_deepseek_v3.py,
`q_proj`, `q_a_proj`, `q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
`o_proj`) shortened to ours (`kv_a_proj`, `q_a_norm`, `kv_a_norm`); RoPE here rotates halves
(`rotate_half`), and moe.hf.deepseek_v3 permutes the rope rows to and from DeepSeek's
interleaved pairs. The KV cache holds the expanded per-head keys and values (as multi-head
attention would), not the latent: generation is exact, not memory-lean.

Values narrower than the query/key heads (DeepSeek-V3: 128 vs 192) are padded with zero columns
before SDPA and cut after, as transformers does for FlashAttention: torch's flash kernels (CPU and
CUDA) need one head dim for q, k and v, and its CPU fallback, the math kernel, keeps every [S, S]
score matrix (CUDA's memory-efficient kernel would take them unpadded: sdp_utils.cpp
check_head_dim_size_mem_efficient). The output is exact; the padding costs (qk - v) / v more
work in the value product only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe.config.derived import window_of
from moe.config.schema import ModelConfig
from moe.model.attention import CausalSelfAttention, CoreAttention, KVCache, SumGradOver, apply_rope
from moe.model.documents import Documents
from moe.model.norm import RMSNorm
from moe.model.rope import mla_softmax_scale

# The latents' RMSNorm epsilon: DeepSeek's (inference/model.py `RMSNorm(dim, eps=1e-6)`), which
# transformers' DeepseekV3RMSNorm defaults to for q_a_layernorm and kv_a_layernorm whatever rms_norm_eps is.
LATENT_NORM_EPS = 1e-6


class MLAttention(CausalSelfAttention):
    """Causal multi-head latent attention over [B, S, H] activations; RoPE only, optional sliding window.

    `tp_group` (set by moe.parallel.tensor_parallel.apply_tp): the tensor-parallel group whose ranks
    hold the other heads; the shared RoPE key's gradient is summed over it.
    """

    tp_group = None

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        H, heads = cfg.hidden_size, cfg.num_heads
        self.sliding_window = window_of(cfg, layer_idx)
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(H, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, H, bias=False)
        self.core = CoreAttention(mla_softmax_scale(cfg, qk_dim))
        self.init_rope(cfg, self.rope_dim)

    def queries(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_BSH)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BSH)))

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, position_offset: int = 0,
                attention_mask_BS: torch.Tensor | None = None, documents: Documents | None = None):
        B, S, _ = x.shape
        # -1 heads: this rank's under tensor parallelism (q_proj/q_b_proj and kv_b_proj column-parallel)
        q = self.queries(x).view(B, S, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.tp_group is not None:  # every rank's heads read it
            k_rope = SumGradOver.apply(k_rope, self.tp_group)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)

        cos, sin = self.rope(position_offset, S, x.device, q.dtype, documents)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope[:, None], cos, sin)  # k: one head
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if self.v_dim < q.shape[-1]:  # zero columns: q, k and v of one head dim, as fused SDPA kernels need
            v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        y = self.attend(q, k, v, kv_cache, position_offset, attention_mask_BS, documents=documents)
        y = y[..., :self.v_dim]
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))
