"""DeepSeek-V3 (DeepseekV3ForCausalLM) <-> our MLA models, weights and config.

Read from transformers 5.x `models/deepseek_v3/modeling_deepseek_v3.py` (and 4.x, the Trainium
environment's 4.52.4, which keeps one module per expert):
  attention (MLA)  ours attn.q_proj | q_a_proj, q_a_norm, q_b_proj   <-> self_attn.q_proj | q_a_proj,
                   q_a_layernorm, q_b_proj; attn.kv_a_proj, kv_a_norm, kv_b_proj, o_proj <->
                   self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
  dense layers     ours ffn.gate_up_proj rows [gate | up], ffn.down_proj <-> mlp.{gate,up,down}_proj
                   (the first `first_k_dense_replace` layers; their width is HF's intermediate_size)
  MoE layers       ours ffn.router.weight, ffn.router.expert_bias <-> mlp.gate.weight,
                   mlp.gate.e_score_correction_bias; experts as Mixtral's but named mlp.experts.J.
                   {gate,up,down}_proj (on disk in both versions; 5.x stacks them in memory as
                   mlp.experts.gate_up_proj [E, 2F, H] and down_proj [E, H, F]); ffn.shared_expert
                   <-> mlp.shared_experts (width n_shared_experts x moe_intermediate_size)
Routing (DeepseekV3TopkRouter), the layer pattern and the shared experts, which GLM-4.5 shares (and
DeepSeek-V2 the layers): moe.hf.sigmoid_router. Multi-token-prediction layers are skipped on import with a
note (moe.hf.mtp).
RoPE: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`,
true by default); ours rotates halves, so the rope rows of the queries and of kv_a_proj are
permuted on the way in and out, and exports keep DeepSeek's interleaved layout, which serving
engines assume.
Refused with a ConfigError: what DeepSeek-V3 cannot express on export (GQA, softmax scores, an
MoE layer pattern other than "first k dense", groups scored other than by 2, a shared expert not
a whole number of experts wide, a sliding window) and what we do not implement on import (RoPE
scaling other than linear, llama3 and YaRN, attention biases or dropout, an activation other than
SiLU). YaRN, as the released DeepSeek-V3 uses it (factor 40, mscale_all_dim 1), also scales the
attention's softmax (moe/model/rope.py `mla_softmax_scale`).
"""
from __future__ import annotations

import torch

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.hf import mtp
from moe.hf.adapter import ExportAdapter, Read, check_plain_pieces
from moe.hf.rope import rope_keys, rope_parameters
from moe.hf.sigmoid_router import (
    ROUTING_KEYS,
    check_layer_pattern,
    check_sigmoid_router,
    expert_bias_in_fp32,
    layer_config_kwargs,
    layer_keys,
    missing_moe_pieces,
    sigmoid_moe_opt,
    sigmoid_router_kwargs,
)
from moe.hf.sparse_moe import per_expert_keys
from moe.hf.tensors import (
    BLOCK_NORMS,
    STACKED_EXPERTS,
    TOP_LEVEL,
    Get,
    config_value,
    in_layer,
    stacked_experts,
    top_level,
)
from moe.model.expert_layout import EXPERT_LAYOUT

ATTENTION = {"attn.q_proj.weight": "self_attn.q_proj.weight",
             "attn.q_a_proj.weight": "self_attn.q_a_proj.weight",
             "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
             "attn.q_b_proj.weight": "self_attn.q_b_proj.weight",
             "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
             "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
             "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
             "attn.o_proj.weight": "self_attn.o_proj.weight"}
ROPE_ROWS = {"attn.q_proj.weight": True, "attn.q_b_proj.weight": True, "attn.kv_a_proj.weight": False}
FFN = {"ffn.down_proj.weight": "mlp.down_proj.weight", "ffn.router.weight": "mlp.gate.weight",
       "ffn.router.expert_bias": "mlp.gate.e_score_correction_bias",
       "ffn.shared_expert.down_proj.weight": "mlp.shared_experts.down_proj.weight"}
FUSED = {"ffn.gate_up_proj.weight": "mlp.", "ffn.shared_expert.gate_up_proj.weight": "mlp.shared_experts."}
EXPERT_WEIGHTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def mla_config_kwargs(cfg: ModelConfig, moe_opt: MoEOptConfig) -> dict:
    """The keys DeepseekV2Config and DeepseekV3Config share, for our MLA model: attention, sizes and the
    layers (moe.hf.sigmoid_router.layer_config_kwargs); the router's keys are each family's own."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        **layer_config_kwargs(cfg, moe_opt),
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_range,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=rope_parameters(cfg), attention_bias=False, attention_dropout=0.0)


def deinterleave_order(rope_dim: int) -> torch.Tensor:
    """Rows of DeepSeek's interleaved pairs in our rotate-half order: [0, 2, 4, ..., 1, 3, 5, ...]
    (transformers' apply_rotary_pos_emb_interleave computes exactly this reordering)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _rope_rows(weight: torch.Tensor, cfg: ModelConfig, order: torch.Tensor, per_head: bool) -> torch.Tensor:
    """Reorder the rope rows of a query weight (per head [nope | rope]) or of kv_a_proj ([latent | rope])."""
    if per_head:
        nope = cfg.qk_nope_head_dim
        w = weight.reshape(cfg.num_heads, nope + cfg.qk_rope_head_dim, -1)
        return torch.cat([w[:, :nope], w[:, nope:][:, order]], dim=1).flatten(0, 1)
    return torch.cat([weight[:cfg.kv_lora_rank], weight[cfg.kv_lora_rank:][order]])


def layer_state_dict(ours: dict[str, torch.Tensor], cfg: ModelConfig, block, q: str, p: str,
                     expert_bias: bool) -> dict[str, torch.Tensor]:
    """One decoder layer's weights (ours under prefix `q`, `block` the module) under 5.x's keys at prefix `p`
    (experts stacked), rope rows interleaved; `expert_bias`: the family's router has one (V3, not V2)."""
    interleave = torch.argsort(deinterleave_order(cfg.qk_rope_head_dim))
    sd = {p + key: ours[q + rest] for rest, key in BLOCK_NORMS.items()}
    for rest, key in ATTENTION.items():
        if q + rest in ours:
            value = ours[q + rest]
            if rest in ROPE_ROWS:
                value = _rope_rows(value, cfg, interleave, ROPE_ROWS[rest])
            sd[p + key] = value
    for rest, key in FFN.items():
        if q + rest in ours:
            sd[p + key] = ours[q + rest]
    for rest, prefix in FUSED.items():
        if q + rest in ours:
            gate, up = ours[q + rest].chunk(2)
            sd |= {p + prefix + "gate_proj.weight": gate, p + prefix + "up_proj.weight": up}
    if any(q + suffix in ours for suffix in EXPERT_LAYOUT.suffixes):
        sd |= missing_moe_pieces(ours, q, p, cfg, expert_bias=expert_bias)
        layout = block.ffn.experts.layout
        gate_up, down = (layout.to_out_in(ours[q + suffix]) for suffix in layout.suffixes)
        sd |= {p + "mlp.experts.gate_up_proj": gate_up, p + "mlp.experts.down_proj": down}
    return sd


def deepseek_value(name: str, get: Get, cfg: ModelConfig, interleaved: bool,
                   experts: range | None = None) -> torch.Tensor:
    """Our tensor `name` from DeepSeek-V3's per-expert keys; `interleaved`: the checkpoint's
    rope_interleave. A multi-token-prediction depth's (mtp.{d}.*) from layer num_layers + d (moe.hf.mtp)."""
    if name in TOP_LEVEL:
        return top_level(name, get)
    if name.startswith("mtp."):
        return mtp.read_depth(name, get, cfg.num_layers,
                              lambda layer: deepseek_value(layer, get, cfg, interleaved, experts))
    p, rest = in_layer(name, "a DeepSeek-V3 model")
    if rest in BLOCK_NORMS:
        return get(p + BLOCK_NORMS[rest])
    if rest in ATTENTION:
        value = get(p + ATTENTION[rest])
        if interleaved and rest in ROPE_ROWS:
            value = _rope_rows(value, cfg, deinterleave_order(cfg.qk_rope_head_dim), ROPE_ROWS[rest])
        return value
    if rest in FFN:
        return get(p + FFN[rest])
    if rest in FUSED:
        return torch.cat([get(p + FUSED[rest] + "gate_proj.weight"), get(p + FUSED[rest] + "up_proj.weight")])
    if rest in STACKED_EXPERTS:
        prefixes = [f"{p}mlp.experts.{j}." for j in (experts or range(cfg.num_experts))]
        return stacked_experts(rest, get, prefixes, EXPERT_WEIGHTS)
    raise KeyError(f"{name}: not a parameter of a DeepSeek-V3 model")


class DeepSeekV3(ExportAdapter):
    model_types = ("deepseek_v3",)
    hf_class = "DeepseekV3ForCausalLM"
    family = "DeepSeek-V3"
    router_key = FFN["ffn.router.weight"]
    expert_bias_key = FFN["ffn.router.expert_bias"]  # DeepSeek-V2's router has none (moe.hf.deepseek_v2)
    routing_keys = ROUTING_KEYS  # what a DeepSeek-V3 checkpoint's router fixes (moe.hf.sigmoid_router)

    # -- reading ----------------------------------------------------------------------------------
    def refusals(self, hf_config) -> tuple:
        """(field, value, refused, fix) for each piece of the checkpoint our MLA decoder does not compute."""
        bias = getattr(hf_config, "attention_bias", False)
        dropout = getattr(hf_config, "attention_dropout", 0.0)
        return (("hidden_act", hf_config.hidden_act, hf_config.hidden_act != "silu",
                 "only SiLU (SwiGLU) MLPs are implemented"),
                ("attention_bias", bias, bool(bias), "our MLA projections have no bias"),
                ("attention_dropout", dropout, bool(dropout), "set attention_dropout=0 in config.json"))

    def model_config(self, hf_config) -> ModelConfig:
        rope = rope_keys(hf_config, default_theta=1.0e4)  # plain, linear, llama3 or YaRN (moe.hf.rope)
        for field, value, refused, fix in self.refusals(hf_config):
            if refused:
                raise ConfigError(field, value, fix, "is not supported")
        return ModelConfig(
            name=getattr(hf_config, "_name_or_path", "") or self.model_types[0],
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers, num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_attention_heads, head_dim=None,
            max_position_embeddings=hf_config.max_position_embeddings, position_encoding="rope", **rope,
            sliding_window=None,
            rms_norm_eps=hf_config.rms_norm_eps, tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            init_range=hf_config.initializer_range, **layer_keys(hf_config),
            attention="mla", q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
        )

    def moe_opt(self, hf_config) -> MoEOptConfig:
        return sigmoid_moe_opt(hf_config)

    def loading_class(self, hf_config):
        """DeepseekV3ForCausalLM, skipping the checkpoint's multi-token-prediction layers on load
        (moe.hf.mtp): moe.hf.convert.from_hf reads them from the files itself."""
        from transformers import DeepseekV3ForCausalLM

        return mtp.skipping_mtp(DeepseekV3ForCausalLM, hf_config)

    def mtp_depths(self, hf_config, keys) -> int:
        """The multi-token-prediction depths a directory holds (moe.hf.mtp.held)."""
        return mtp.held(hf_config, keys)

    def reader(self, model_cfg, hf_config) -> Read:
        interleaved = bool(config_value(hf_config, "rope_interleave", True))
        return lambda name, get, experts=None: deepseek_value(name, get, model_cfg, interleaved, experts)

    # -- writing ----------------------------------------------------------------------------------
    def check_exportable(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        check_plain_pieces(cfg, self.family, self.model_types[0])
        check_layer_pattern(cfg, self.family)
        self.check_router(cfg, moe_opt)

    def check_router(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        check_sigmoid_router(cfg, moe_opt, self.family)

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import DeepseekV3Config

        self.check_exportable(cfg, moe_opt)
        config = DeepseekV3Config(
            **mla_config_kwargs(cfg, moe_opt), **sigmoid_router_kwargs(cfg, moe_opt), rope_interleave=True,
            num_nextn_predict_layers=cfg.mtp_layers,  # the depths the export writes (extra_state_dict)
        )
        config.rope_theta = float(cfg.rope_theta)  # 4.x reads rope_theta (see moe.hf.mixtral)
        return config

    def prepare(self, hf_model) -> None:
        expert_bias_in_fp32(hf_model)

    def state_dict(self, model) -> dict[str, torch.Tensor]:
        """Our weights under 5.x's keys (experts stacked: mlp.experts.gate_up_proj [E, 2F, H], down_proj
        [E, H, F]), rope rows interleaved (an export)."""
        cfg = model.model_config
        ours = model.state_dict()
        # tied: the LM head is the embedding again, as transformers holds it
        sd = {"model.embed_tokens.weight": ours["embed_tokens.weight"],
              "model.norm.weight": ours["norm.weight"], "lm_head.weight": ours["lm_head.weight"]}
        for i in range(cfg.num_layers):
            sd |= layer_state_dict(ours, cfg, model.layers[i], f"layers.{i}.", f"model.layers.{i}.",
                                   expert_bias=self.expert_bias_key is not None)
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    def extra_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The multi-token-prediction depths (moe.hf.mtp), which DeepseekV3ForCausalLM does not hold, as the
        released directory holds its layer 61."""
        cfg, expert_bias = model.model_config, self.expert_bias_key is not None
        return mtp.depths_state_dict(model, lambda ours, block, q, p: layer_state_dict(
            ours, cfg, block, q, p, expert_bias=expert_bias))

    def per_expert(self, sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        """transformers 5.x's stacked expert tensors -> the per-expert keys of the files (and of 4.x)."""
        return per_expert_keys(sd, num_layers)
