"""Hugging Face Mixtral interop: `to_hf(model)` and `from_hf(model_or_dir)`, weights and config.

Layouts (transformers 5.x, read from `models/mixtral/modeling_mixtral.py`):
  ours `layers.N.attn.qkv_proj.weight`  = rows [q | k | v]  <->  `self_attn.{q,k,v}_proj.weight`
  ours `experts.gate_up [E, H, 2F]`     = transpose(1, 2)   <->  `mlp.experts.gate_up_proj [E, 2F, H]`
       (gate columns first, then up; HF chunks the output the same way: w1 rows then w3 rows)
  ours `experts.down [E, F, H]`         = transpose(1, 2)   <->  `mlp.experts.down_proj [E, H, F]`
  ours `ffn.router.weight [E, H]`                           <->  `mlp.gate.weight [E, H]`

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

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.model.model import MoETransformer
from moe.model.size import head_dim_of


def _effective_normalize(moe_opt: MoEOptConfig, top_k: int) -> bool:
    return moe_opt.normalize_top_k if moe_opt.normalize_top_k is not None else top_k >= 2


def check_exportable(cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
    """Raise ConfigError for any option a MixtralForCausalLM cannot reproduce."""
    if cfg.position_encoding != "rope":
        raise ConfigError("model.position_encoding", cfg.position_encoding,
                          "train with position_encoding=rope to export to Mixtral",
                          "cannot be expressed by Mixtral (RoPE only)")
    if cfg.moe_layer_frequency != 1:
        raise ConfigError("model.moe_layer_frequency", cfg.moe_layer_frequency,
                          "use moe_layer_frequency=1 (every layer MoE) to export to Mixtral",
                          "makes dense layers, which Mixtral cannot express")
    if cfg.shared_expert_intermediate_size:
        raise ConfigError("model.shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                          "use 0 (no shared expert) to export to Mixtral",
                          "adds a shared expert, which Mixtral cannot express")
    if not _effective_normalize(moe_opt, cfg.top_k):
        raise ConfigError("moe_opt.normalize_top_k", moe_opt.normalize_top_k,
                          "set moe_opt.normalize_top_k=true (Mixtral always renormalises the top-k weights)",
                          f"means raw router probabilities at top_k={cfg.top_k}; Mixtral cannot express that")


def hf_config_from_model_config(cfg: ModelConfig, moe_opt: MoEOptConfig):
    """MixtralConfig with the same architecture (check_exportable first)."""
    from transformers import MixtralConfig

    check_exportable(cfg, moe_opt)
    return MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=head_dim_of(cfg), hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_range,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        sliding_window=cfg.sliding_window, num_experts_per_tok=cfg.top_k, num_local_experts=cfg.num_experts,
        router_aux_loss_coef=moe_opt.aux_loss_coeff, router_jitter_noise=moe_opt.jitter_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
    )


def model_config_from_hf(hf_config) -> ModelConfig:
    """ModelConfig for a MixtralConfig; refuses what our decoder does not implement."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError("rope_parameters.rope_type", rope.get("rope_type"),
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
    """Dropless, renormalised routing as Mixtral computes it; aux coeff and jitter carried over."""
    return MoEOptConfig(
        name="mixtral_dropless", capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True,
        aux_loss_coeff=hf_config.router_aux_loss_coef, jitter_eps=hf_config.router_jitter_noise,
    )


def _unsharded(model: MoETransformer) -> None:
    for i, block in enumerate(model.layers):
        local = block.ffn.experts.gate_up.shape[0]
        if local != model.cfg.num_experts:
            raise ConfigError(f"layers.{i}.ffn.experts", f"{local} of {model.cfg.num_experts} experts",
                              "export from an unsharded model (a checkpoint loaded without apply_ep)",
                              "holds only this rank's experts")


def to_hf(model: MoETransformer):
    """A transformers.MixtralForCausalLM with the same config and weights (same dtype)."""
    from transformers import MixtralForCausalLM

    cfg, moe_opt = model.cfg, model.moe_opt
    hf_config = hf_config_from_model_config(cfg, moe_opt)
    _unsharded(model)
    ref = next(model.parameters())
    hf = MixtralForCausalLM(hf_config).to(dtype=ref.dtype)
    hf.load_state_dict(_to_hf_state_dict(model), strict=True)
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


def from_hf(model_or_dir: str | Path | object, moe_opt: MoEOptConfig | None = None) -> MoETransformer:
    """MoETransformer from a MixtralForCausalLM or a local directory (no hub access).

    moe_opt defaults to `moe_opt_from_hf(config)`: dropless, so logits match transformers.
    """
    from transformers import MixtralForCausalLM

    if isinstance(model_or_dir, (str, Path)):
        path = Path(model_or_dir)
        if not (path / "config.json").is_file():
            raise ConfigError("init_from_hf", str(path), "point to a directory written by save_pretrained "
                              "(config.json + weights); hub names are not downloaded", "has no config.json")
        hf = MixtralForCausalLM.from_pretrained(str(path), local_files_only=True)
    else:
        hf = model_or_dir
    if getattr(hf.config, "model_type", None) != "mixtral":
        raise ConfigError("model_type", getattr(hf.config, "model_type", None),
                          "convert a Mixtral checkpoint (MixtralForCausalLM)", "is not mixtral")
    cfg = model_config_from_hf(hf.config)
    moe_opt = moe_opt if moe_opt is not None else moe_opt_from_hf(hf.config)
    ref = next(hf.parameters())
    model = MoETransformer(cfg, moe_opt).to(dtype=ref.dtype)
    model.load_state_dict(_from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return model


def _from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    embed = hf_sd["model.embed_tokens.weight"]
    sd = {"embed_tokens.weight": embed, "norm.weight": hf_sd["model.norm.weight"],
          "lm_head.weight": hf_sd.get("lm_head.weight", embed)}
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        qkv = torch.cat([hf_sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        sd |= {o + "attn.qkv_proj.weight": qkv,
               o + "attn.o_proj.weight": hf_sd[p + "self_attn.o_proj.weight"],
               o + "attn_norm.weight": hf_sd[p + "input_layernorm.weight"],
               o + "ffn_norm.weight": hf_sd[p + "post_attention_layernorm.weight"],
               o + "ffn.router.weight": hf_sd[p + "mlp.gate.weight"],
               o + "ffn.experts.gate_up": hf_sd[p + "mlp.experts.gate_up_proj"].transpose(1, 2),
               o + "ffn.experts.down": hf_sd[p + "mlp.experts.down_proj"].transpose(1, 2)}
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}

