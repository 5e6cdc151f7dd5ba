"""Hugging Face interop: `to_hf(model)` and `from_hf(model_or_dir)`, weights and config.

A GQA model is a MixtralForCausalLM (this file); an MLA model (model.attention=mla) is a
DeepseekV3ForCausalLM (moe/model/hf_deepseek.py). The functions below dispatch on the model's
attention (export) or the checkpoint's model_type (import).

Layouts (transformers 5.x, read from `models/mixtral/modeling_mixtral.py`):
  ours `layers.N.attn.qkv_proj.weight`  = rows [q | k | v]  <->  `self_attn.{q,k,v}_proj.weight`
  ours `experts.gate_up [E, H, 2F]`     = transpose(1, 2)   <->  `mlp.experts.gate_up_proj [E, 2F, H]`
       (gate columns first, then up; HF chunks the output the same way: w1 rows then w3 rows)
  ours `experts.down [E, F, H]`         = transpose(1, 2)   <->  `mlp.experts.down_proj [E, H, F]`
  ours `ffn.router.weight [E, H]`                           <->  `mlp.gate.weight [E, H]`
transformers 4.x (the Trainium environment pins 4.52.4) keeps one module per expert instead:
`block_sparse_moe.experts.J.w1/w2/w3.weight` and `block_sparse_moe.gate.weight`, which is also
what `save_pretrained` writes in both versions. `_per_expert` converts 5.x's to those keys, and
moe.model.hf_tensors maps them to ours (also for reading the files lazily), so one path serves
both versions; the layout is read from the HF model's own state_dict keys.

Mixtral always renormalises the top-k weights and never drops tokens, so an imported model
gets a dropless `MoEOptConfig` (capacity_factor=None, eval_capacity_factor=None,
normalize_top_k=True): that is what makes its logits match transformers'. Options Mixtral
cannot express (ALiBi, dense layers, a shared expert, un-normalised top-k) refuse export
with a ConfigError instead of writing a model that would behave differently.
Known difference kept: HF's jitter (`router_jitter_noise`) also scales the expert input;
ours (`jitter_eps`) scales the router input only. Both are training-only.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moe.config.derived import head_dim_of
from moe.config.schema import ModelConfig, MoEOptConfig, normalizes
from moe.errors import ConfigError
from moe.model import hf_deepseek
from moe.model.hf_tensors import value_reader
from moe.model.model import MoETransformer

IMPORTABLE = ("mixtral", "deepseek_v3")  # model_type of the checkpoints from_hf reads


def check_exportable(cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
    """Raise ConfigError for any option the model's transformers class (Mixtral or DeepSeek-V3) cannot
    reproduce."""
    if cfg.attention == "mla":
        hf_deepseek.check_exportable(cfg, moe_opt)
    else:
        _check_mixtral(cfg, moe_opt)


def _check_mixtral(cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
    if cfg.position_encoding != "rope":
        raise ConfigError("model.position_encoding", cfg.position_encoding,
                          "train with position_encoding=rope to export to Mixtral",
                          "cannot be expressed by Mixtral (RoPE only)")
    if cfg.moe_layer_frequency != 1:
        raise ConfigError("model.moe_layer_frequency", cfg.moe_layer_frequency,
                          "use moe_layer_frequency=1 (every layer MoE) to export to Mixtral",
                          "makes dense layers, which Mixtral cannot express")
    if cfg.first_k_dense_replace:
        raise ConfigError("model.first_k_dense_replace", cfg.first_k_dense_replace,
                          "use 0 (every layer MoE) to export to Mixtral (DeepSeek-V3 has it: attention=mla)",
                          "makes dense layers, which Mixtral cannot express")
    if cfg.shared_expert_intermediate_size:
        raise ConfigError("model.shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                          "use 0 (no shared expert) to export to Mixtral",
                          "adds a shared expert, which Mixtral cannot express")
    for key, default, what in (("score_function", "softmax", "scores experts with a sigmoid"),
                               ("num_groups", None, "limits each token to groups of experts"),
                               ("topk_scaling_factor", None, "scales the top-k weights")):
        value = getattr(moe_opt, key, default)
        if value != default:
            raise ConfigError(f"moe_opt.{key}", value, f"export a model trained with moe_opt.{key}={default}",
                              f"{what}, which Mixtral's softmax top-k router cannot express")
    if getattr(moe_opt, "enable_expert_bias", False):
        raise ConfigError("moe_opt.enable_expert_bias", True,
                          "export a model trained without the expert bias (moe_opt.enable_expert_bias=false)",
                          "selects experts with a learned bias, which Mixtral's router cannot express")
    if not normalizes(moe_opt.normalize_top_k, cfg.top_k):
        raise ConfigError("moe_opt.normalize_top_k", moe_opt.normalize_top_k,
                          "set moe_opt.normalize_top_k=true (Mixtral always renormalises the top-k weights)",
                          f"means raw router probabilities at top_k={cfg.top_k}; Mixtral cannot express that")


def hf_config_from_model_config(cfg: ModelConfig, moe_opt: MoEOptConfig):
    """MixtralConfig (GQA) or DeepseekV3Config (MLA) with the same architecture (check_exportable first)."""
    from transformers import MixtralConfig

    if cfg.attention == "mla":
        return hf_deepseek.hf_config_from_model_config(cfg, moe_opt)
    _check_mixtral(cfg, moe_opt)
    config = MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=head_dim_of(cfg), hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_range,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        sliding_window=cfg.sliding_window, num_experts_per_tok=cfg.top_k, num_local_experts=cfg.num_experts,
        router_aux_loss_coef=moe_opt.aux_loss_coeff, router_jitter_noise=moe_opt.jitter_eps,
        rope_theta=float(cfg.rope_theta),
    )
    # `rope_theta=` is 4.x's argument (4.52.4 configuration_mixtral.py:146); 5.x still accepts it and
    # moves it into rope_parameters (5.x configuration_utils.py:471, modeling_rope_utils.py:785). 5.x
    # then saves only rope_parameters, which 4.x ignores (falling back to theta 1e6), so keep
    # `rope_theta` as an attribute too: config.json then loads with the right theta in both versions.
    config.rope_theta = float(cfg.rope_theta)
    return config


def model_config_from_hf(hf_config) -> ModelConfig:
    """ModelConfig for a MixtralConfig (or a dense Mistral/Llama one, for upcycling) or a DeepseekV3Config;
    refuses what our decoder does not implement."""
    if getattr(hf_config, "model_type", None) == "deepseek_v3":
        return hf_deepseek.model_config_from_hf(hf_config)
    # 5.x: rope_parameters {rope_type, rope_theta}; 4.x: rope_theta and rope_scaling, None for plain RoPE,
    # else {"rope_type" or the older "type", ...} (4.52.4 modeling_mixtral.py:395)
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError("rope_parameters.rope_type", rope_type,
                          "only plain RoPE is implemented; use a checkpoint without RoPE scaling",
                          "is not supported")
    if hf_config.hidden_act != "silu":
        raise ConfigError("hidden_act", hf_config.hidden_act, "only SiLU (SwiGLU) experts are implemented",
                          "is not supported")
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ConfigError("attention_dropout", hf_config.attention_dropout,
                          "set attention_dropout=0 in config.json (our attention has no dropout)",
                          "is not supported")
    head_dim = getattr(hf_config, "head_dim", None)
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return ModelConfig(
        name=getattr(hf_config, "_name_or_path", "") or "mixtral",
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        head_dim=None if head_dim in (None, default_head_dim) else head_dim,
        max_position_embeddings=hf_config.max_position_embeddings, position_encoding="rope",
        rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 1.0e6))),
        sliding_window=hf_config.sliding_window, rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings), init_range=hf_config.initializer_range,
        num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
        moe_layer_frequency=1, shared_expert_intermediate_size=0,
    )


def moe_opt_from_hf(hf_config) -> MoEOptConfig:
    """Dropless routing as the checkpoint computes it: Mixtral's renormalised softmax top-k (aux coeff and
    jitter carried over), or DeepSeek-V3's (hf_deepseek.moe_opt_from_hf)."""
    if getattr(hf_config, "model_type", None) == "deepseek_v3":
        return hf_deepseek.moe_opt_from_hf(hf_config)
    return MoEOptConfig(
        name="mixtral_dropless", capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True,
        aux_loss_coeff=hf_config.router_aux_loss_coef, jitter_eps=hf_config.router_jitter_noise,
    )


def _unsharded(model: MoETransformer) -> None:
    for i, block in enumerate(model.layers):
        if not block.is_moe:
            continue
        local = block.ffn.experts.gate_up.shape[0]
        if local != model.cfg.num_experts:
            raise ConfigError(f"layers.{i}.ffn.experts", f"{local} of {model.cfg.num_experts} experts",
                              "export from an unsharded model (a checkpoint loaded without apply_ep)",
                              "holds only this rank's experts")


def to_hf(model: MoETransformer):
    """A transformers MixtralForCausalLM (GQA) or DeepseekV3ForCausalLM (MLA) with the same config and weights
    (same dtype)."""
    from transformers import DeepseekV3ForCausalLM, MixtralForCausalLM

    cfg, moe_opt = model.cfg, model.moe_opt
    hf_config = hf_config_from_model_config(cfg, moe_opt)
    _unsharded(model)
    ref = next(model.parameters())
    if cfg.attention == "mla":
        hf = DeepseekV3ForCausalLM(hf_config).to(dtype=ref.dtype)
        for module in hf.modules():  # fp32 whatever the model's dtype, as transformers loads it
            if hasattr(module, "e_score_correction_bias"):  # (_keep_in_fp32_modules_strict)
                module.e_score_correction_bias = module.e_score_correction_bias.float()
        sd = hf_deepseek.hf_state_dict(model)
        sd = sd if _is_stacked(hf.state_dict()) else hf_deepseek.per_expert(sd, cfg.num_layers)
    else:
        hf = MixtralForCausalLM(hf_config).to(dtype=ref.dtype)
        sd = _to_hf_state_dict(model)
        sd = sd if _is_stacked(hf.state_dict()) else _per_expert(sd, cfg.num_layers)
    hf.load_state_dict(sd, strict=True)
    return hf.eval()


def _to_hf_state_dict(model: MoETransformer) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    q_size = cfg.num_heads * head_dim_of(cfg)
    kv_size = cfg.num_kv_heads * head_dim_of(cfg)
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = block.attn.qkv_proj.weight.split([q_size, kv_size, kv_size], dim=0)
        sd |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
               p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": block.attn.o_proj.weight,
               p + "input_layernorm.weight": block.attn_norm.weight,
               p + "post_attention_layernorm.weight": block.ffn_norm.weight,
               p + "mlp.gate.weight": block.ffn.router.weight,
               p + "mlp.experts.gate_up_proj": block.ffn.experts.gate_up.transpose(1, 2),
               p + "mlp.experts.down_proj": block.ffn.experts.down.transpose(1, 2)}
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def load_local(model_or_dir, model_cls, field: str):
    """A transformers model as given, or `model_cls.from_pretrained` of a local save_pretrained directory
    (no hub access)."""
    if not isinstance(model_or_dir, (str, Path)):
        return model_or_dir
    path = Path(model_or_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(field, str(path), "point to a directory written by save_pretrained "
                          "(config.json + weights); hub names are not downloaded", "has no config.json")
    return model_cls.from_pretrained(str(path), local_files_only=True)


def from_hf(model_or_dir: str | Path | object, moe_opt: MoEOptConfig | None = None) -> MoETransformer:
    """MoETransformer from a MixtralForCausalLM or DeepseekV3ForCausalLM, or a local directory of one
    (no hub access).

    moe_opt defaults to `moe_opt_from_hf(config)`: dropless, so logits match transformers.
    """
    from transformers import AutoModelForCausalLM

    hf = load_local(model_or_dir, AutoModelForCausalLM, "init_from_hf")
    model_type = getattr(hf.config, "model_type", None)
    if model_type not in IMPORTABLE:
        raise ConfigError("model_type", model_type, "convert a Mixtral (MixtralForCausalLM) or DeepSeek-V3 "
                          "(DeepseekV3ForCausalLM) checkpoint; upcycle a dense one with moe.hf.upcycle",
                          "is not mixtral or deepseek_v3")
    cfg = model_config_from_hf(hf.config)
    moe_opt = moe_opt if moe_opt is not None else moe_opt_from_hf(hf.config)
    ref = next(hf.parameters())
    model = MoETransformer(cfg, moe_opt).to(dtype=ref.dtype)
    hf_sd = hf.state_dict()
    if _is_stacked(hf_sd):  # 5.x in memory -> the per-expert keys of the files and of 4.x
        to_per_expert = hf_deepseek.per_expert if model_type == "deepseek_v3" else _per_expert
        hf_sd = to_per_expert(hf_sd, cfg.num_layers)
    read = value_reader(model_type, bool(getattr(hf.config, "rope_interleave", True)), cfg)
    ours = {name: read(name, hf_sd.__getitem__) for name in model.state_dict()}
    model.load_state_dict({k: v.detach().clone().contiguous() for k, v in ours.items()}, strict=True)
    return model


# -- transformers 4.x: one module per expert ------------------------------------------------------
# 5.x stacks the experts in memory (modeling_mixtral.py:56, `MixtralExperts`) and converts to and
# from the per-expert keys itself when it loads or saves (conversion_mapping.py:1270, "mixtral").
# 4.x keeps them per expert in memory (4.52.4 modeling_mixtral.py:64 `MixtralBlockSparseTop2MLP`
# w1/w2/w3, :102-104 gate and experts, :317 `block_sparse_moe`), so we do that conversion for it.


def _is_stacked(hf_sd: dict[str, torch.Tensor]) -> bool:
    """Whether a Mixtral/DeepSeek-V3 state_dict uses 5.x's stacked experts (else 4.x's per-expert)."""
    return any(key.endswith(".mlp.experts.gate_up_proj") for key in hf_sd)


def _per_expert(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Stacked keys -> per-expert keys: gate_up_proj [E, 2F, H] = w1 rows then w3 rows per expert."""
    sd = dict(sd)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w1, w3 = sd.pop(p + "mlp.experts.gate_up_proj").chunk(2, dim=1)
        w2 = sd.pop(p + "mlp.experts.down_proj")
        sd[p + "block_sparse_moe.gate.weight"] = sd.pop(p + "mlp.gate.weight")
        for j in range(w2.shape[0]):
            e = f"{p}block_sparse_moe.experts.{j}."
            sd |= {e + "w1.weight": w1[j], e + "w3.weight": w3[j], e + "w2.weight": w2[j]}
    return sd
