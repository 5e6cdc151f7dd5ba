"""GLM-4.5 (Glm4MoeForCausalLM, model_type glm4_moe) <-> our GQA models with partial RoPE, weights and config.

transformers 5.24 `models/glm4_moe/modeling_glm4_moe.py`:
  attention  Llama's GQA with heads of head_dim (:181), biases on q, k and v when attention_bias, never on
             o_proj (:188-197; ours model.qkv_bias, o_bias false), an RMSNorm per head on q and k before
             RoPE when use_qk_norm (:198-201, :219-221; ours model.qk_norm=per_head), RoPE on the first
             int(head_dim x partial_rotary_factor) dims of each head only (apply_rotary_pos_emb :138-171,
             the rotary embedding's width :75-77; ours model.partial_rotary_factor). Glm4MoeConfig defaults
             the factor to 0.5 when config.json has none (configuration_glm4_moe.py:122), so an export
             always writes it.
  layers     the first first_k_dense_replace dense (intermediate_size), the rest MoE (:402-405): DeepSeek-V3's
             sigmoid router with e_score_correction_bias and groups, routed_scaling_factor, norm_topk_prob
             (Glm4MoeTopkRouter :269-307), n_routed_experts of moe_intermediate_size and n_shared_experts of
             shared expert (:371-385): moe.hf.sigmoid_router, shared with DeepSeek-V3.
  keys       Qwen-MoE's (moe.hf.sparse_moe) but the shared expert under mlp.shared_experts and the expert
             bias mlp.gate.e_score_correction_bias.
  MTP        the checkpoints' multi-token-prediction layers (num_nextn_predict_layers, after the main ones:
             GLM-4.5-Air's layer 46) in DeepSeek-V3's layout (enorm, hnorm, eh_proj, shared_head, a decoder
             layer of GLM's keys; moe.hf.mtp), read beside the transformers model (it skips them,
             modeling_glm4_moe.py:461) and written beside its files (model.mtp_layers).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from moe.config.derived import head_dim_of
from moe.config.schema import ModelConfig, MoEOptConfig
from moe.hf import mtp
from moe.hf.adapter import Read, check_plain_pieces, refuse_unless
from moe.hf.dense import llama_family_config
from moe.hf.rope import rope_parameters
from moe.hf.sigmoid_router import (
    ROUTING_KEYS,
    check_sigmoid_exportable,
    expert_bias_in_fp32,
    layer_keys,
    missing_moe_pieces,
    sigmoid_config_kwargs,
    sigmoid_moe_opt,
)
from moe.hf.sparse_moe import (
    FUSED,
    SINGLE,
    SparseMoeFamily,
    layer_tensors,
    sparse_moe_state_dict,
    sparse_moe_value,
)

SHARED = {"ffn.shared_expert.down_proj.weight": "mlp.shared_experts.down_proj.weight",
          "ffn.router.expert_bias": "mlp.gate.e_score_correction_bias"}
GLM_SINGLE = {k: v for k, v in SINGLE.items() if not k.startswith("ffn.shared_expert")} | SHARED
GLM_FUSED = FUSED | {"ffn.shared_expert.gate_up_proj.weight": ("mlp.shared_experts.gate_proj.weight",
                                                               "mlp.shared_experts.up_proj.weight")}


class Glm4Moe(SparseMoeFamily):
    model_types = ("glm4_moe",)
    hf_class = "Glm4MoeForCausalLM"
    family = "GLM-4.5"
    routing_keys = ROUTING_KEYS

    # -- reading ----------------------------------------------------------------------------------
    def model_config(self, hf_config) -> ModelConfig:
        cfg = llama_family_config(hf_config, hf_config.n_routed_experts, hf_config.num_experts_per_tok,
                                  biased_attention=True, biased_output=False)
        return replace(cfg, **layer_keys(hf_config), qk_norm="per_head" if hf_config.use_qk_norm else "none",
                       hf_family=self.model_types[0])

    def moe_opt(self, hf_config) -> MoEOptConfig:
        return sigmoid_moe_opt(hf_config)

    def loading_class(self, hf_config):
        """Glm4MoeForCausalLM, skipping the checkpoint's multi-token-prediction layers on load (moe.hf.mtp):
        moe.hf.convert.from_hf reads them from the files itself."""
        from transformers import Glm4MoeForCausalLM

        return mtp.skipping_mtp(Glm4MoeForCausalLM, hf_config)

    def mtp_depths(self, hf_config, keys) -> int:
        return mtp.held(hf_config, keys)

    def reader(self, model_cfg, hf_config) -> Read:
        def value(name, get, experts=None):
            if name.startswith("mtp."):  # a depth: its own tensors, and its block as layer num_layers + d
                return mtp.read_depth(name, get, model_cfg.num_layers,
                                      lambda layer: value(layer, get, experts))
            return sparse_moe_value(name, get, model_cfg.num_experts, experts, GLM_SINGLE, GLM_FUSED)
        return value

    # -- writing ----------------------------------------------------------------------------------
    def check_family(self, cfg: ModelConfig) -> None:
        if cfg.qk_norm == "full":  # use_qk_norm is per head
            refuse_unless(cfg, self.family, qk_norm="per_head")

    def check_exportable(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        refuse_unless(cfg, self.family, attention="gqa", position_encoding="rope")
        check_plain_pieces(cfg, self.family, self.model_types[0])
        self.check_family(cfg)
        check_sigmoid_exportable(cfg, moe_opt, self.family)

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import Glm4MoeConfig

        self.check_exportable(cfg, moe_opt)
        rope = rope_parameters(cfg) | {"partial_rotary_factor": float(cfg.partial_rotary_factor)}
        return self.with_rope_theta(Glm4MoeConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            head_dim=head_dim_of(cfg), hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
            initializer_range=cfg.init_range, rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope,
            attention_bias=cfg.qkv_bias, attention_dropout=0.0, use_qk_norm=cfg.qk_norm == "per_head",
            **sigmoid_config_kwargs(cfg, moe_opt),
            num_nextn_predict_layers=cfg.mtp_layers,  # the depths the export writes (extra_state_dict)
        ), cfg)

    def prepare(self, hf_model) -> None:
        """The router's weight and expert bias in fp32 whatever the model's dtype, as transformers loads
        them (_keep_in_fp32_modules_strict, modeling_glm4_moe.py:460)."""
        expert_bias_in_fp32(hf_model)
        for module in hf_model.modules():
            if type(module).__name__ == "Glm4MoeTopkRouter":
                module.weight = torch.nn.Parameter(module.weight.float())

    def state_dict(self, model) -> dict[str, torch.Tensor]:
        """Ours under 5.x's keys, with the expert bias and shared expert Glm4MoeMoE always has (zero when
        ours has none)."""
        sd = sparse_moe_state_dict(model, GLM_SINGLE, GLM_FUSED)
        ours = model.state_dict()
        for i, block in enumerate(model.layers):
            if block.is_moe:
                sd |= missing_moe_pieces(ours, f"layers.{i}.", f"model.layers.{i}.", model.model_config)
        return sd

    def extra_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The multi-token-prediction depths (moe.hf.mtp), which Glm4MoeForCausalLM does not hold, as the
        released directory holds its layer 46."""
        cfg = model.model_config

        def write_layer(ours, block, q, p):
            sd = {}
            for name, value in ours.items():
                if name.startswith(q):
                    sd |= layer_tensors(cfg, p, name.removeprefix(q), value, block, GLM_SINGLE, GLM_FUSED)
            return sd | (missing_moe_pieces(ours, q, p, cfg) if block.is_moe else {})
        return mtp.depths_state_dict(model, write_layer)
