"""What DeepSeek-V3 and GLM-4.5 share beyond attention: the sigmoid router with its expert bias and groups,
both ways (moe.hf.deepseek_v3, moe.hf.glm4_moe); and what DeepSeek-V2 shares with them too: the "first k
dense" layer pattern and the shared experts (moe.hf.deepseek_v2).

Routing (transformers 5.24 DeepseekV3TopkRouter, modeling_deepseek_v3.py; Glm4MoeTopkRouter,
modeling_glm4_moe.py:269-307, the same code): sigmoid scores, e_score_correction_bias added for the choice
only, groups scored by their best 2 biased scores (ours by moe_opt.group_score_experts, set to 2 where
top_k/group_top_k, Megatron-Core's count, is not 2), top-k weights renormalised when norm_topk_prob, times
routed_scaling_factor; never drops tokens.
Layers: the first `first_k_dense_replace` dense (intermediate_size wide), then every layer MoE with
n_routed_experts of moe_intermediate_size and n_shared_experts x moe_intermediate_size of shared expert.
"""
from __future__ import annotations

import torch

from moe.config.derived import dense_width
from moe.config.schema import ModelConfig, MoEOptConfig, group_scored_by, normalizes
from moe.errors import ConfigError

HF_GROUP_SCORE_TOP = 2  # the routers' `.topk(2, dim=-1)[0].sum(dim=-1)` per group
# MoE routing fields such a checkpoint fixes (moe_opt); the rest are training choices
ROUTING_KEYS = ("score_function", "num_groups", "group_top_k", "topk_scaling_factor", "normalize_top_k",
                "enable_expert_bias", "group_score_experts")


def layer_keys(hf_config) -> dict:
    """Our widths and MoE pattern: experts moe_intermediate_size wide, dense layers intermediate_size, the
    leading first_k_dense_replace dense, the shared experts n_shared_experts experts wide."""
    moe_width, dense = hf_config.moe_intermediate_size, hf_config.intermediate_size
    return dict(intermediate_size=moe_width, dense_intermediate_size=None if dense == moe_width else dense,
                num_experts=hf_config.n_routed_experts, top_k=hf_config.num_experts_per_tok,
                moe_layer_frequency=1, first_k_dense_replace=hf_config.first_k_dense_replace or 0,
                shared_expert_intermediate_size=(hf_config.n_shared_experts or 0) * moe_width)


def group_score_experts(hf_config, groups: int, family_top: int) -> int | None:
    """moe_opt.group_score_experts for a checkpoint whose router scores a group by its best `family_top`:
    null where top_k/group_top_k is already that count (or there are no groups)."""
    if groups <= 1 or hf_config.num_experts_per_tok // hf_config.topk_group == family_top:
        return None
    return family_top


def sigmoid_moe_opt(hf_config) -> MoEOptConfig:
    """Routing as the checkpoint computes it: sigmoid, its groups, its scaling, dropless, the expert bias on
    (its values come with the weights); balancing as DeepSeek-V3 trained (moe_opt=deepseek_v3)."""
    groups, scaling = hf_config.n_group or 1, hf_config.routed_scaling_factor
    return MoEOptConfig(
        name=f"{hf_config.model_type}_dropless", capacity_factor=None, eval_capacity_factor=None,
        normalize_top_k=bool(hf_config.norm_topk_prob), score_function="sigmoid",
        num_groups=groups if groups > 1 else None,
        group_top_k=hf_config.topk_group if groups > 1 else None,
        group_score_experts=group_score_experts(hf_config, groups, HF_GROUP_SCORE_TOP),
        topk_scaling_factor=None if scaling == 1.0 else scaling,
        enable_expert_bias=True, bias_update_rate=1.0e-3, load_balancing_type="seq_aux_loss",
        aux_loss_coeff=1.0e-4, z_loss_coeff=0.0,
    )


def check_layer_pattern(cfg: ModelConfig, family: str) -> None:
    """Refuse the layers such a family cannot express: interleaved dense layers, a sliding window, a shared
    expert not a whole number of experts wide."""
    if cfg.moe_layer_frequency != 1:
        raise ConfigError("model.moe_layer_frequency", cfg.moe_layer_frequency,
                          "use moe_layer_frequency=1 (model.first_k_dense_replace for leading dense layers)",
                          f"interleaves dense and MoE layers, which {family} cannot express")
    if cfg.sliding_window is not None:
        raise ConfigError("model.sliding_window", cfg.sliding_window, f"train with sliding_window=null to "
                          f"export to {family}", f"has no {family} equivalent (full attention only)")
    if cfg.shared_expert_intermediate_size % cfg.intermediate_size:
        raise ConfigError("model.shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                          f"use a multiple of model.intermediate_size={cfg.intermediate_size} "
                          f"({family}'s shared experts are n_shared_experts experts wide)",
                          "is not a whole number of experts")


def check_group_score(cfg: ModelConfig, moe_opt: MoEOptConfig, family: str, family_top: int) -> None:
    """Groups scored as the family's router scores them (the sum of its best `family_top`)."""
    scored_by = group_scored_by(moe_opt, cfg.top_k)
    if scored_by not in (None, family_top):
        raise ConfigError("moe_opt.group_score_experts", moe_opt.group_score_experts,
                          f"set moe_opt.group_score_experts={family_top} (or num_groups=null)",
                          f"scores each group by its best {scored_by} experts; {family}'s router by its best "
                          f"{family_top}")


def check_sigmoid_router(cfg: ModelConfig, moe_opt: MoEOptConfig, family: str) -> None:
    """Routing DeepseekV3TopkRouter and Glm4MoeTopkRouter compute: sigmoid scores, groups by their best 2."""
    if moe_opt.score_function != "sigmoid":
        raise ConfigError("moe_opt.score_function", moe_opt.score_function,
                          "train with moe_opt.score_function=sigmoid (moe_opt=deepseek_v3) to export it",
                          f"is not {family}'s router, which scores experts with a sigmoid")
    check_group_score(cfg, moe_opt, family, HF_GROUP_SCORE_TOP)


def check_sigmoid_exportable(cfg: ModelConfig, moe_opt: MoEOptConfig, family: str) -> None:
    """The layers and the router of a DeepSeek-V3-style family (check_layer_pattern, check_sigmoid_router)."""
    check_layer_pattern(cfg, family)
    check_sigmoid_router(cfg, moe_opt, family)


def layer_config_kwargs(cfg: ModelConfig, moe_opt: MoEOptConfig) -> dict:
    """The transformers config arguments of the layers, experts and scaling: DeepseekV2Config,
    DeepseekV3Config and Glm4MoeConfig alike."""
    return dict(
        intermediate_size=dense_width(cfg), moe_intermediate_size=cfg.intermediate_size,
        n_shared_experts=cfg.shared_expert_intermediate_size // cfg.intermediate_size,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
        routed_scaling_factor=float(moe_opt.topk_scaling_factor or 1.0),
        first_k_dense_replace=cfg.first_k_dense_replace,
    )


def sigmoid_router_kwargs(cfg: ModelConfig, moe_opt: MoEOptConfig) -> dict:
    """The transformers config arguments of the sigmoid router's groups and renormalisation."""
    return dict(n_group=moe_opt.num_groups or 1, topk_group=moe_opt.group_top_k or 1,
                norm_topk_prob=normalizes(moe_opt.normalize_top_k, cfg.top_k))


def sigmoid_config_kwargs(cfg: ModelConfig, moe_opt: MoEOptConfig) -> dict:
    """layer_config_kwargs and sigmoid_router_kwargs (DeepseekV3Config, Glm4MoeConfig)."""
    return layer_config_kwargs(cfg, moe_opt) | sigmoid_router_kwargs(cfg, moe_opt)


def missing_moe_pieces(ours: dict, q: str, p: str, cfg: ModelConfig,
                       expert_bias: bool = True) -> dict[str, torch.Tensor]:
    """What the transformers class always has in MoE layer `p` (its prefix; ours `q`) that a model of ours
    may lack: a zero expert bias when trained without one (the choice is then by the scores; `expert_bias`:
    the family's router has one) and a zero-width shared expert when it has none."""
    sd = {}
    if expert_bias and q + "ffn.router.expert_bias" not in ours:
        sd[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(cfg.num_experts)
    if q + "ffn.shared_expert.down_proj.weight" not in ours:
        H = cfg.hidden_size
        sd |= {p + "mlp.shared_experts.gate_proj.weight": torch.zeros(0, H),
               p + "mlp.shared_experts.up_proj.weight": torch.zeros(0, H),
               p + "mlp.shared_experts.down_proj.weight": torch.zeros(H, 0)}
    return sd


def expert_bias_in_fp32(hf_model) -> None:
    """The expert bias in fp32 whatever the model's dtype, as transformers loads it
    (_keep_in_fp32_modules_strict)."""
    for module in hf_model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias = module.e_score_correction_bias.float()
