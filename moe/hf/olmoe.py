"""OLMoE (OlmoeForCausalLM) <-> our GQA models with a full-width QK-norm, weights and config.

transformers 5.24 `models/olmoe/modeling_olmoe.py`: Llama attention with q_norm over the whole q projection
(hidden_size wide) and k_norm over the whole k projection before the head split (:222-225, :239-240; ours
model.qk_norm=full), optional clipping of q/k/v (clip_qkv, :243-246: refused), biases on q, k, v and o when
attention_bias (:210-221; ours model.qkv_bias and o_bias, which the export needs equal); every layer MoE,
experts intermediate_size wide (:286, :360); no sliding window (:468). Keys, routing and the refusals every
softmax top-k family shares: moe.hf.sparse_moe.
"""
from __future__ import annotations

from dataclasses import replace

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.hf.adapter import refuse_unless
from moe.hf.dense import llama_family_config
from moe.hf.rope import rope_parameters
from moe.hf.sparse_moe import SparseMoeFamily, refuse_split_attention_bias


class Olmoe(SparseMoeFamily):
    model_types = ("olmoe",)
    hf_class = "OlmoeForCausalLM"
    family = "OLMoE"

    def model_config(self, hf_config) -> ModelConfig:
        if hf_config.clip_qkv is not None:
            raise ConfigError("clip_qkv", hf_config.clip_qkv, "convert a checkpoint with clip_qkv=null (ours "
                              "does not clamp q, k and v)", "is not supported")
        cfg = llama_family_config(hf_config, hf_config.num_experts, hf_config.num_experts_per_tok,
                                  biased_attention=True)
        return replace(cfg, qk_norm="full", hf_family=self.model_types[0])

    def check_family(self, cfg: ModelConfig) -> None:
        refuse_unless(cfg, self.family, qk_norm="full", sliding_window=None, moe_layer_frequency=1,
                      first_k_dense_replace=0, shared_expert_intermediate_size=0)
        refuse_split_attention_bias(cfg, self.family)
        if cfg.head_dim not in (None, cfg.hidden_size // cfg.num_heads):  # q_norm is hidden_size wide (:222)
            refuse_unless(cfg, self.family, head_dim=None)

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import OlmoeConfig

        self.check_exportable(cfg, moe_opt)
        return self.with_rope_theta(OlmoeConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, hidden_act="silu",
            max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_range,
            rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
            rope_parameters=rope_parameters(cfg),
            attention_bias=cfg.qkv_bias, attention_dropout=0.0, clip_qkv=None, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k, norm_topk_prob=self.norm_topk_prob(cfg, moe_opt),
            router_aux_loss_coef=moe_opt.aux_loss_coeff,
            # OLMoE's tokenizer's ids otherwise (1, 50279); export_hf sets the tokenizer's
            pad_token_id=None, eos_token_id=None,
        ), cfg)
