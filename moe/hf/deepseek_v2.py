"""DeepSeek-V2 and DeepSeek-V2-Lite (DeepseekV2ForCausalLM) <-> our MLA models: DeepSeek-V3's adapter
(moe.hf.deepseek_v3) with DeepSeek-V2's router.

Read from transformers 5.24 `models/deepseek_v2/modeling_deepseek_v2.py`. What V2 shares with V3, and reads
and writes through moe.hf.deepseek_v3's code: the MLA attention and its keys (q_proj when q_lora_rank is
null, as DeepSeek-V2-Lite; :311-326), the dense first layers, the experts (stacked in memory, per expert on
disk: conversion_mapping.py:55 maps deepseek_v2 as qwen2_moe, as deepseek_v3), the shared experts (always
built, :126-128: zero-wide when there are none), RoPE on interleaved pairs (`apply_rotary_emb` multiplies
the pairs (x0, x1), (x2, x3), ... as complex numbers, :259-272: DeepSeek-V3's rope_interleave=true, which
V2 always is) with YaRN's attention factor on both (:217) and its softmax-scale correction (:275-287, :346).
What differs, the router (DeepseekV2TopkRouter, :98-117): softmax scores in fp32, no expert bias, top-k
greedy or, with topk_method=group_limited_greedy, within the topk_group groups of best single score (ours:
moe_opt.group_score_experts=1 where top_k/group_top_k is not 1; DeepSeek-V2 236B routes top-6 within 3 of 8
groups); the weights times routed_scaling_factor and never renormalised (norm_topk_prob is not read).
Refused with a ConfigError besides DeepSeek-V3's refusals: an MLP bias, a topk_method other than those two,
norm_topk_prob=true (DeepSeek's own code renormalises then, transformers does not: the two disagree); on
export a sigmoid router, an expert bias, renormalised weights, groups scored otherwise than by their best.
"""
from __future__ import annotations

from dataclasses import replace

from moe.config.schema import ModelConfig, MoEOptConfig, normalizes
from moe.errors import ConfigError
from moe.hf.adapter import HFAdapter
from moe.hf.deepseek_v3 import DeepSeekV3, mla_config_kwargs
from moe.hf.sigmoid_router import check_group_score, group_score_experts
from moe.hf.tensors import config_value

TOPK_METHODS = ("greedy", "group_limited_greedy")  # DeepseekV2TopkRouter.forward's two branches
HF_GROUP_SCORE_TOP = 1  # a group's score: `.max(dim=-1)`, its best expert (modeling_deepseek_v2.py:105)


class DeepSeekV2(DeepSeekV3):
    model_types = ("deepseek_v2",)
    hf_class = "DeepseekV2ForCausalLM"
    family = "DeepSeek-V2"
    expert_bias_key = None

    # -- reading ----------------------------------------------------------------------------------
    def refusals(self, hf_config) -> tuple:
        method = config_value(hf_config, "topk_method", "greedy")
        norm = config_value(hf_config, "norm_topk_prob", False)
        mlp_bias = config_value(hf_config, "mlp_bias", False)
        return (*super().refusals(hf_config),
                ("mlp_bias", mlp_bias, bool(mlp_bias), "our MLPs and experts have no bias"),
                ("topk_method", method, method not in TOPK_METHODS, f"use one of {', '.join(TOPK_METHODS)}"),
                ("norm_topk_prob", norm, bool(norm), "set norm_topk_prob=false: transformers' DeepseekV2 "
                 "does not renormalise the top-k weights whatever it says, DeepSeek's own code does"))

    def model_config(self, hf_config) -> ModelConfig:
        return replace(super().model_config(hf_config), hf_family=self.model_types[0])

    def moe_opt(self, hf_config) -> MoEOptConfig:
        """Routing as the checkpoint computes it: softmax, its groups when group-limited, its scaling, the
        weights not renormalised, dropless; balancing by a sequence-wise loss (DeepSeek-V2-Lite's
        aux_loss_alpha 1e-3, seq_aux)."""
        grouped = config_value(hf_config, "topk_method", "greedy") == "group_limited_greedy"
        groups = (hf_config.n_group or 1) if grouped else 1
        scaling = hf_config.routed_scaling_factor
        return MoEOptConfig(
            name="deepseek_v2_dropless", capacity_factor=None, eval_capacity_factor=None,
            normalize_top_k=False, score_function="softmax", num_groups=groups if groups > 1 else None,
            group_top_k=hf_config.topk_group if groups > 1 else None,
            group_score_experts=group_score_experts(hf_config, groups, HF_GROUP_SCORE_TOP),
            topk_scaling_factor=None if scaling == 1.0 else scaling, enable_expert_bias=False,
            load_balancing_type="seq_aux_loss", aux_loss_coeff=1.0e-3, z_loss_coeff=0.0,
        )

    def loading_class(self, hf_config):
        """AutoModelForCausalLM: a DeepSeek-V2 checkpoint has no multi-token-prediction layers to skip."""
        return HFAdapter.loading_class(self, hf_config)

    def note(self, hf_config, keys) -> str | None:
        return None

    # -- writing ----------------------------------------------------------------------------------
    def check_router(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        """Routing DeepseekV2TopkRouter computes: softmax, no bias, weights as they are, groups by their
        best expert."""
        wrong = (("score_function", moe_opt.score_function, moe_opt.score_function != "softmax", "softmax",
                  "scores experts with a sigmoid; DeepSeek-V2's router uses a softmax"),
                 ("enable_expert_bias", moe_opt.enable_expert_bias, moe_opt.enable_expert_bias, "false",
                  "chooses experts with a learned bias, which DeepSeek-V2's router has not"),
                 ("normalize_top_k", moe_opt.normalize_top_k, normalizes(moe_opt.normalize_top_k, cfg.top_k),
                  "false", "renormalises the top-k weights; DeepSeek-V2's router never does"))
        for key, value, refused, want, problem in wrong:
            if refused:
                raise ConfigError(f"moe_opt.{key}", value,
                                  f"train with moe_opt.{key}={want} to export to DeepSeek-V2", problem)
        check_group_score(cfg, moe_opt, self.family, HF_GROUP_SCORE_TOP)

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import DeepseekV2Config

        self.check_exportable(cfg, moe_opt)
        grouped = moe_opt.num_groups is not None
        config = DeepseekV2Config(
            **mla_config_kwargs(cfg, moe_opt), topk_method=TOPK_METHODS[grouped],
            n_group=moe_opt.num_groups, topk_group=moe_opt.group_top_k, norm_topk_prob=False, mlp_bias=False,
        )
        config.rope_theta = float(cfg.rope_theta)  # 4.x reads rope_theta (see moe.hf.mixtral)
        return config
