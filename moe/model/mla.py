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
interleaved pairs.

Generation caches the latent, as DeepSeek's inference/model.py (`attn_impl="absorb"`) and vLLM's MLA do:
per token the normed c_kv and the rotated shared RoPE key, kv_lora_rank + qk_rope_head_dim numbers for
every head together (`LatentKVCache`; DeepSeek-V3: 576 where the expanded keys and values are 128 x (192 +
128) = 40,960). The prefill (an empty cache) attends as training does, over keys and values expanded from
this call's latents: its S x S scores dominate there, and per query-key pair the expanded heads cost
qk + v = 320 multiply-adds where the latent costs 2 kv_lora_rank + rope = 1,088. Every later call (decode)
reads the cache without expanding it, W_UK and W_UV (kv_b_proj's key and value rows of each head) absorbed:
q_nope . (W_UK c) = (W_UK^T q_nope) . c, so each head's query moves into the latent space and scores the
cached [c | k_rope] directly, as one key head shared by every query head; the attention-weighted latent
then goes through W_UV to each head's value, then o_proj. A decode step reads kv_lora_rank + rope numbers
per cached token instead of heads x (qk + v), which is what bounds it. Training and an expanded cache
(`MoETransformer.new_kv_cache(latent=False)`, the reference) keep the per-head keys and values.

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
from moe.model.attention import (
    CausalSelfAttention,
    CoreAttention,
    KVCache,
    SumGradOver,
    apply_rope,
    attention_mask,
)
from moe.model.documents import Documents
from moe.model.norm import RMSNorm
from moe.model.rope import mla_softmax_scale

# The latents' RMSNorm epsilon: DeepSeek's (inference/model.py `RMSNorm(dim, eps=1e-6)`), which
# transformers' DeepseekV3RMSNorm defaults to for q_a_layernorm and kv_a_layernorm whatever rms_norm_eps is.
LATENT_NORM_EPS = 1e-6


class LatentKVCache(KVCache):
    """One MLA layer's generation cache: `k` is [B, 1, S, kv_lora_rank + qk_rope_head_dim], each token's
    normed latent c_kv then its rotated RoPE key; `v` stays None (the values are the latent's columns).
    transformers 5.24 caches the same two tensors (modeling_deepseek_v3.py:446-460) but expands them to
    every head's keys and values at each step (:464); MLAttention's decode reads them as they are."""


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
        # the same scale for the absorbed decode, whose query is kv_lora_rank + rope wide (SDPA's default
        # would be 1/sqrt of that): modeling_deepseek_v3.py:405
        self.softmax_scale = mla_softmax_scale(cfg, qk_dim) or qk_dim ** -0.5
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
        latent = self.kv_a_norm(latent)
        cos, sin = self.rope(position_offset, S, x.device, q.dtype, documents)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope[:, None], cos, sin)  # k: one head
        if isinstance(kv_cache, LatentKVCache) and documents is None:
            prefill = kv_cache.end == 0
            cached, _, k_start = kv_cache.append(torch.cat([latent[:, None], k_rope], dim=-1), None,
                                                 position_offset)
            if not prefill:
                y = self.absorbed(q_nope, q_rope, cached, position_offset, k_start, attention_mask_BS)
                return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))
            kv_cache = None  # the prefill attends over this call's keys, expanded
        y = self.expanded(q_nope, q_rope, latent, k_rope, kv_cache, position_offset, attention_mask_BS,
                          documents)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))

    def expanded(self, q_nope, q_rope, latent_BSC, k_rope_B1SR, kv_cache: KVCache | None,
                 position_offset: int, attention_mask_BS: torch.Tensor | None,
                 documents: Documents | None) -> torch.Tensor:
        """Attention over every head's keys and values from kv_b_proj (training, the prefill, an expanded
        cache) -> [B, heads, S, v_head_dim]."""
        B, S, _ = latent_BSC.shape
        kv = self.kv_b_proj(latent_BSC).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope_B1SR.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if self.v_dim < q.shape[-1]:  # zero columns: q, k and v of one head dim, as fused SDPA kernels need
            v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        y = self.attend(q, k, v, kv_cache, position_offset, attention_mask_BS, documents=documents)
        return y[..., :self.v_dim]

    def absorbed(self, q_nope, q_rope, cached_B1TC, q_start: int, k_start: int,
                 attention_mask_BS: torch.Tensor | None) -> torch.Tensor:
        """Attention over the cached [latent | k_rope] with W_UK absorbed into the query and W_UV applied
        to the attention-weighted latent (DeepSeek's inference/model.py, attn_impl="absorb")
        -> [B, heads, S, v_head_dim]. Every head's queries become rows of one head attending the one
        cached key head (an MQA over heads x S queries), so SDPA never repeats the cache per head."""
        B, heads, S, _ = q_nope.shape
        T = cached_B1TC.shape[2]
        weight = self.kv_b_proj.weight
        weight = weight.to_local() if hasattr(weight, "to_local") else weight  # TP: this rank's heads
        w_uk, w_uv = weight.view(heads, self.nope_dim + self.v_dim, self.kv_lora_rank).split(
            [self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhsn,hnc->bhsc", q_nope, w_uk)
        q = torch.cat([q_latent, q_rope], dim=-1).reshape(B, 1, heads * S, -1)
        mask, is_causal = self.visible(q_start, S, k_start, T, attention_mask_BS, q.dtype, q.device)
        if is_causal:  # SDPA's causal flag would read heads x S rows as positions
            mask = attention_mask(q_start, S, k_start, T, self.sliding_window, q.device)
        if mask is not None:  # [..., S, T] -> [b, 1, heads x S, T]: head h's rows see what its S queries see
            while mask.dim() < 4:
                mask = mask[None]
            mask = mask.expand(mask.shape[0], heads, S, T).reshape(mask.shape[0], 1, heads * S, T)
        # the values are the latent's columns; the rope columns ride along (one head dim for q, k and v)
        # and are cut after
        y = F.scaled_dot_product_attention(q, cached_B1TC, cached_B1TC, attn_mask=mask,
                                           scale=self.softmax_scale)
        y_latent = y[..., :self.kv_lora_rank].view(B, heads, S, self.kv_lora_rank)
        return torch.einsum("bhsc,hvc->bhsv", y_latent, w_uv)
