"""Qwen3-MoE (Qwen3MoeForCausalLM) <-> our GQA models with a per-head QK-norm, weights and config.

transformers 5.24 `models/qwen3_moe/modeling_qwen3_moe.py`: Llama attention with q_norm/k_norm over each
head's dims before RoPE (:147-148, :163-164; ours model.qk_norm=per_head), q, k, v and o biased when
attention_bias (:135-146; ours model.qkv_bias and o_bias, which the export needs equal), a sliding window
on every layer when use_sliding_window (configuration_qwen3_moe.py:110, modeling_qwen3_moe.py:473); a layer
is MoE unless it is in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0 (:310-315): ours
moe_layer_frequency and dense_layers; dense layers are intermediate_size wide, experts
moe_intermediate_size. Keys, routing and the refusals every softmax top-k family shares: moe.hf.sparse_moe.
"""
from __future__ import annotations

from dataclasses import replace

from moe.config.derived import dense_width, head_dim_of
from moe.config.schema import ModelConfig, MoEOptConfig
from moe.hf.adapter import refuse_unless
from moe.hf.dense import llama_family_config
from moe.hf.rope import rope_parameters
from moe.hf.sparse_moe import SparseMoeFamily, mlp_only_layers, refuse_split_attention_bias


def qwen_layers(hf_config) -> dict:
    """Our widths and dense/MoE pattern for a Qwen-MoE config: decoder_sparse_step is our frequency (the
    same rule), mlp_only_layers our dense_layers."""
    moe_width, dense = hf_config.moe_intermediate_size, hf_config.intermediate_size
    return dict(intermediate_size=moe_width, dense_intermediate_size=None if dense == moe_width else dense,
                moe_layer_frequency=hf_config.decoder_sparse_step,
                dense_layers=sorted(hf_config.mlp_only_layers) or None)


def qwen_config_kwargs(cfg: ModelConfig, moe_opt: MoEOptConfig, norm_topk_prob: bool) -> dict:
    """The transformers config arguments Qwen2-MoE and Qwen3-MoE share."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=dense_width(cfg),
        moe_intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_range,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=rope_parameters(cfg),
        decoder_sparse_step=cfg.moe_layer_frequency, mlp_only_layers=mlp_only_layers(cfg),
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=norm_topk_prob,
        router_aux_loss_coef=moe_opt.aux_loss_coeff, attention_dropout=0.0,
        # head_dim: not a field of either config, but their attention reads it (modeling_qwen3_moe.py:129,
        # modeling_qwen2_moe.py:216) and the released checkpoints set it (Qwen3-30B-A3B: 128, where
        # hidden_size / heads is 64)
        head_dim=head_dim_of(cfg),
    )


class Qwen3Moe(SparseMoeFamily):
    model_types = ("qwen3_moe",)
    hf_class = "Qwen3MoeForCausalLM"
    family = "Qwen3-MoE"

    def model_config(self, hf_config) -> ModelConfig:
        cfg = llama_family_config(hf_config, hf_config.num_experts, hf_config.num_experts_per_tok,
                                  biased_attention=True)
        return replace(cfg, **qwen_layers(hf_config), qk_norm="per_head", hf_family=self.model_types[0])

    def check_family(self, cfg: ModelConfig) -> None:
        refuse_unless(cfg, self.family, qk_norm="per_head", shared_expert_intermediate_size=0)
        refuse_split_attention_bias(cfg, self.family)

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import Qwen3MoeConfig

        self.check_exportable(cfg, moe_opt)
        return self.with_rope_theta(Qwen3MoeConfig(
            **qwen_config_kwargs(cfg, moe_opt, self.norm_topk_prob(cfg, moe_opt)),
            attention_bias=cfg.qkv_bias,
            use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window), cfg)
