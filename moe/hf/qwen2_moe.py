"""Qwen2-MoE (Qwen2MoeForCausalLM) <-> our GQA models with q/k/v biases and a gated shared expert.

transformers 5.24 `models/qwen2_moe/modeling_qwen2_moe.py`: Qwen3-MoE's layers (moe.hf.qwen3_moe) without
the QK-norm, with biases on q/k/v when qkv_bias (:222-225; o_proj never; ours model.qkv_bias) and a shared
expert of shared_expert_intermediate_size added to the experts' output times
sigmoid(shared_expert_gate(x)) (:337-350; ours model.shared_expert_gate). Its sliding window covers only
the layers layer_types marks (configuration_qwen2_moe.py:113-120), which ours cannot express: refused.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.hf.adapter import refuse_unless
from moe.hf.dense import llama_family_config
from moe.hf.qwen3_moe import qwen_config_kwargs, qwen_layers
from moe.hf.sparse_moe import SparseMoeFamily


class Qwen2Moe(SparseMoeFamily):
    model_types = ("qwen2_moe",)
    hf_class = "Qwen2MoeForCausalLM"
    family = "Qwen2-MoE"

    def model_config(self, hf_config) -> ModelConfig:
        if "sliding_attention" in (hf_config.layer_types or ()):
            raise ConfigError("use_sliding_window", True, "convert a checkpoint with "
                              "use_sliding_window=false (ours puts one window on every layer or none)",
                              "windows only the layers layer_types marks; not supported")
        cfg = llama_family_config(hf_config, hf_config.num_experts, hf_config.num_experts_per_tok)
        shared = hf_config.shared_expert_intermediate_size
        # sliding_window: 0 when unused (configuration_qwen2_moe.py:112)
        return replace(cfg, **qwen_layers(hf_config), sliding_window=None, qkv_bias=bool(hf_config.qkv_bias),
                       shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
                       hf_family=self.model_types[0])

    def check_family(self, cfg: ModelConfig) -> None:
        refuse_unless(cfg, self.family, sliding_window=None)
        if cfg.shared_expert_intermediate_size:  # its shared expert is always gated
            refuse_unless(cfg, self.family, shared_expert_gate=True)

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import Qwen2MoeConfig

        self.check_exportable(cfg, moe_opt)
        return self.with_rope_theta(Qwen2MoeConfig(
            **qwen_config_kwargs(cfg, moe_opt, self.norm_topk_prob(cfg, moe_opt)),
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=cfg.qkv_bias,
            use_sliding_window=False), cfg)

    def state_dict(self, model) -> dict[str, torch.Tensor]:
        """Ours under 5.x's keys; without a shared expert, Qwen2-MoE's (always built) is zero-wide."""
        sd = super().state_dict(model)
        H = model.model_config.hidden_size
        for i, block in enumerate(model.layers):
            p = f"model.layers.{i}.mlp."
            if block.is_moe and block.ffn.shared_expert is None:
                sd |= {p + "shared_expert.gate_proj.weight": torch.zeros(0, H),
                       p + "shared_expert.up_proj.weight": torch.zeros(0, H),
                       p + "shared_expert.down_proj.weight": torch.zeros(H, 0),
                       p + "shared_expert_gate.weight": torch.zeros(1, H)}
        return sd
