"""How big a model is, from its config alone: parameter counts by where they live, and training FLOPs.

The one place these are computed: MFU (moe/train), the dry-run planner and the simulation
(moe/tools) all read them, so a 46.7B-parameter model is sized without building it.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe.config.derived import attention_dims, dense_width, head_dim_of, is_moe_layer, num_blocks, window_of


def attention_params(m) -> int:
    """One layer's attention weights, its two block norms included (and GQA's biases, sinks and QK-norm)."""
    H = m.hidden_size
    if m.attention == "mla":
        qk_dim, v_dim = attention_dims(m)
        q = H * m.num_heads * qk_dim if m.q_lora_rank is None else \
            H * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * qk_dim
        kv = H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
            + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + v_dim)
        return q + kv + m.num_heads * v_dim * H + 2 * H
    head_dim = head_dim_of(m)
    q, kv = m.num_heads * head_dim, m.num_kv_heads * head_dim
    qkv_out = q + 2 * kv
    qk_norm = {"none": 0, "per_head": 2 * head_dim, "full": q + kv}[m.qk_norm]
    extras = qkv_out * m.qkv_bias + H * m.o_bias + m.num_heads * m.attention_sinks + qk_norm
    return H * qkv_out + q * H + 2 * H + extras


@dataclass
class ParamBreakdown:
    """Parameter counts by where they live; `experts` is the routed experts of all MoE layers."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int
    attention: int  # q/k/v (MLA: latents and their norms; GQA: biases, QK-norms) + o + the 2 block RMSNorms
    routers: int
    shared_experts: int
    dense_mlp: int  # SwiGLU of the non-MoE layers
    experts: int
    active_experts: int  # top_k of num_experts routed experts per MoE layer
    num_moe_layers: int  # the multi-token-prediction blocks' among them
    mtp: int = 0  # each multi-token-prediction depth's own: eh_proj and its three norms (its block above)

    @property
    def total(self) -> int:
        return self.non_expert + self.experts

    @property
    def non_expert(self) -> int:
        return (self.embedding + self.lm_head + self.final_norm + self.attention + self.routers
                + self.shared_experts + self.dense_mlp + self.mtp)

    @property
    def active(self) -> int:
        """What one token uses: everything but the routed experts, plus top_k of them per MoE layer."""
        return self.non_expert + self.active_experts


def param_breakdown(m) -> ParamBreakdown:
    """Exact parameter counts of the MoETransformer a ModelConfig builds (unsharded), the blocks of its
    multi-token-prediction depths counted with the layers (DeepSeek-V3: 671B, and 11.6B for its depth)."""
    H, F, E = m.hidden_size, m.intermediate_size, m.num_experts
    blocks = num_blocks(m)
    n_moe = sum(is_moe_layer(i, m) for i in range(blocks))
    n_dense = blocks - n_moe
    per_expert = H * 2 * F + F * H  # gate_up H -> 2F, down F -> H, in any dim order (moe.model.expert_layout)
    per_expert += (2 * F + H) * m.expert_proj_bias
    return ParamBreakdown(
        embedding=m.vocab_size * H,
        lm_head=0 if m.tie_word_embeddings else m.vocab_size * H,
        final_norm=H,
        attention=blocks * attention_params(m),
        routers=n_moe * E * (H + m.router_bias),
        shared_experts=n_moe * (3 * H * m.shared_expert_intermediate_size + H * m.shared_expert_gate),
        dense_mlp=n_dense * 3 * H * dense_width(m),
        experts=n_moe * E * per_expert,
        active_experts=n_moe * m.top_k * per_expert,
        num_moe_layers=n_moe,
        mtp=m.mtp_layers * (2 * H * H + 3 * H),
    )


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B style.

    6 * N_active + 6 * L * num_heads * (qk_dim + v_dim) * S_ctx (GQA: 12 * L * num_heads * head_dim *
    S_ctx), where N_active excludes the input embedding table (a lookup, no matmul; the lm_head
    counts, tied or not) and S_ctx = min(seq_len, the layer's window), summed over the layers. Like PaLM,
    the attention term is not halved for causality. Each multi-token-prediction depth adds its block (in
    N_active) and one more pass through the shared LM head.
    """
    active = param_breakdown(m).active
    n = active - (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size)
    n += m.mtp_layers * m.vocab_size * m.hidden_size  # the shared head again, per depth
    windows = (window_of(m, i) for i in range(num_blocks(m)))
    ctx = sum(seq_len if w is None else min(seq_len, w) for w in windows)  # over the layers
    qk_dim, v_dim = attention_dims(m)  # q k^T and the weighted sum of v, forward and backward: 6 * each
    return 6.0 * n + 6.0 * m.num_heads * (qk_dim + v_dim) * ctx
