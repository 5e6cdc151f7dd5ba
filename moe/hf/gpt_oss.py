"""gpt-oss (GptOssForCausalLM) <-> our GQA models with gpt-oss's pieces, weights and config.

Read from transformers 5.24's `models/gpt_oss/modeling_gpt_oss.py` and `configuration_gpt_oss.py`:
  attention: q, k, v and o projections with biases (`attention_bias`, :272-283), one learned sink logit per
    head (`sinks`, :285; eager_attention_forward :243-251), sliding or full by `layer_types` (:264, :284)
    -> model.qkv_bias, o_bias, attention_sinks, attention_layer_types
  router: `mlp.router.weight [E, H]` and `.bias [E]`, top-k of the logits then a softmax over those k
    (:126-130) -> model.router_bias; softmax, top-k, renormalised (moe_opt.normalize_top_k=true) is the same
    weights: exp(l_i) / sum over the chosen k either way
  RoPE: `rope_parameters`, YaRN in the released configs and the class's default (factor 32 over 4096
    positions, beta_fast 32, beta_slow 1, truncate false: configuration_gpt_oss.py:89-97; theta 150000,
    :37) -> model.rope_type and the rope_* keys (moe.hf.rope), computed as ROPE_INIT_FUNCTIONS["yarn"]
    (modeling_gpt_oss.py:157-161) by moe/model/rope.py
  experts: `mlp.experts.gate_up_proj [E, H, 2F]` with gate and up *interleaved* along the out dim (gate the
    even columns, up the odd: `_apply_gate`, :83), `gate_up_proj_bias [E, 2F]` likewise, `down_proj
    [E, F, H]`, `down_proj_bias [E, H]` (:75-78); x @ W + b, nn.Linear's transpose (:108, :110), so HF's
    stacks are [E, in, out] -> our gate_up (gate first, then up: de-interleaved here, never in our
    storage), model.expert_proj_bias, expert_activation=clamped_swiglu (swiglu_alpha, swiglu_limit)
The files hold those in-memory keys as they are (transformers has no conversion mapping for gpt_oss), so
reading and writing go through the same keys in both directions; the stacked experts are sliced per
rank (moe.hf.tensors.expert_rows).

Refused: MXFP4-quantised experts (the released checkpoints; the error says how to dequantize them with
transformers first), a rope_type our RoPE does not compute (moe.hf.rope) and attention dropout.
"""
from __future__ import annotations

import torch

from moe.config.schema import ModelConfig, MoEOptConfig, normalizes
from moe.errors import ConfigError
from moe.hf.adapter import ExportAdapter, Read, check_plain_pieces
from moe.hf.dense import llama_block_state, llama_shaped_config, llama_top_level_state
from moe.hf.rope import rope_keys, rope_parameters
from moe.hf.tensors import BLOCK_NORMS, TOP_LEVEL, Get, config_value, expert_rows, in_layer, top_level
from moe.model.expert_layout import stored

ATTENTION = {"attn.o_proj.weight": "self_attn.o_proj.weight", "attn.o_proj.bias": "self_attn.o_proj.bias",
             "attn.sinks": "self_attn.sinks"}
ROUTER = {"ffn.router.weight": "mlp.router.weight", "ffn.router.bias": "mlp.router.bias"}
EXPERTS = "mlp.experts."
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta (configuration_gpt_oss.py:37)


def deinterleave(w: torch.Tensor) -> torch.Tensor:
    """gpt-oss's [.., g0 u0 g1 u1 ..] columns -> ours [.., gate | up] (the last dim)."""
    return torch.cat([w[..., ::2], w[..., 1::2]], dim=-1)


def interleave(w: torch.Tensor) -> torch.Tensor:
    """Ours [.., gate | up] -> gpt-oss's interleaved columns (the last dim)."""
    gate, up = w.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def gpt_oss_value(name: str, get: Get, experts: range | None = None) -> torch.Tensor:
    """Our tensor `name` from gpt-oss's keys; `experts` a range of experts (all: None)."""
    if name in TOP_LEVEL:
        return top_level(name, get)
    p, rest = in_layer(name, "a gpt-oss model")
    for table in (BLOCK_NORMS, ATTENTION, ROUTER):
        if rest in table:
            return get(p + table[rest])
    if rest in ("attn.qkv_proj.weight", "attn.qkv_proj.bias"):
        kind = rest.rsplit(".", 1)[1]
        return torch.cat([get(p + f"self_attn.{n}_proj.{kind}") for n in "qkv"])
    e = p + EXPERTS
    layout = stored()
    gate_up, down = layout.suffixes
    if rest == gate_up:  # [E, H, 2F] = [E, in, out], interleaved
        return layout.from_in_out(deinterleave(expert_rows(get, e + "gate_up_proj", experts))).contiguous()
    if rest == down:  # [E, F, H] = [E, in, out]
        return layout.from_in_out(expert_rows(get, e + "down_proj", experts)).contiguous()
    if rest == "ffn.experts.gate_up_bias":
        return deinterleave(expert_rows(get, e + "gate_up_proj_bias", experts))
    if rest == "ffn.experts.down_bias":
        return expert_rows(get, e + "down_proj_bias", experts)
    raise KeyError(f"{name}: not a parameter of a gpt-oss model")


class GptOss(ExportAdapter):
    model_types = ("gpt_oss",)
    hf_class = "GptOssForCausalLM"
    router_key = ROUTER["ffn.router.weight"]
    routing_keys = ("score_function", "num_groups", "enable_expert_bias", "normalize_top_k",
                    "topk_scaling_factor")

    # -- reading ----------------------------------------------------------------------------------
    def model_config(self, hf_config) -> ModelConfig:
        quant = config_value(hf_config, "quantization_config") or {}
        method = config_value(quant, "quant_method")
        if method is not None:
            raise ConfigError(
                "quantization_config.quant_method", str(method),
                "dequantize it with transformers first: GptOssForCausalLM.from_pretrained(DIR, "
                "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)"
                ".save_pretrained(OUT), then use OUT",
                "quantizes the experts; we read unquantized weights only")
        rope = rope_keys(hf_config, default_theta=DEFAULT_THETA)  # YaRN as released, or plain
        bias = bool(config_value(hf_config, "attention_bias", True))
        types = list(hf_config.layer_types)
        return llama_shaped_config(
            hf_config, hf_config.num_local_experts, hf_config.num_experts_per_tok,
            attention_layer_types=None if all(t == "sliding_attention" for t in types) else types,
            qkv_bias=bias, o_bias=bias, attention_sinks=True, router_bias=True, expert_proj_bias=True,
            expert_activation="clamped_swiglu", swiglu_alpha=float(hf_config.swiglu_alpha),
            swiglu_limit=float(hf_config.swiglu_limit), hf_family="gpt_oss", **rope)

    def moe_opt(self, hf_config) -> MoEOptConfig:
        """Dropless softmax top-k renormalised over the k (= gpt-oss's softmax over the top-k logits)."""
        return MoEOptConfig(name="gpt_oss_dropless", capacity_factor=None, eval_capacity_factor=None,
                            normalize_top_k=True, aux_loss_coeff=hf_config.router_aux_loss_coef,
                            jitter_eps=0.0)

    def reader(self, model_cfg, hf_config) -> Read:
        return lambda name, get, experts=None: gpt_oss_value(name, get, experts)

    # -- writing ----------------------------------------------------------------------------------
    def check_exportable(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        """What GptOssForCausalLM computes unconditionally (sinks, the clamped SwiGLU, one attention_bias for
        q, k, v and o, every layer MoE, the softmax top-k router) our model must compute too. Absent
        router or expert biases are written as zeros: the same model. Other families' pieces are refused
        (moe.hf.adapter.check_plain_pieces)."""
        check_plain_pieces(cfg, "gpt-oss", self.model_types[0])
        fixes = (("attention", "gqa", cfg.attention, "gpt-oss's attention is grouped-query"),
                 ("position_encoding", "rope", cfg.position_encoding, "gpt-oss uses RoPE"),
                 ("attention_sinks", True, cfg.attention_sinks, "every gpt-oss attention has sinks"),
                 ("expert_activation", "clamped_swiglu", cfg.expert_activation,
                  "gpt-oss's experts apply the clamped SwiGLU"),
                 ("o_bias", cfg.qkv_bias, cfg.o_bias,
                  "gpt-oss's attention_bias is one switch for q, k, v and o"),
                 ("moe_layer_frequency", 1, cfg.moe_layer_frequency, "every gpt-oss layer is MoE"),
                 ("first_k_dense_replace", 0, cfg.first_k_dense_replace, "every gpt-oss layer is MoE"),
                 ("shared_expert_intermediate_size", 0, cfg.shared_expert_intermediate_size,
                  "gpt-oss has no shared expert"))
        for key, want, have, why in fixes:
            if have != want:
                raise ConfigError(f"model.{key}", have, f"use model.{key}={want} to export to gpt-oss",
                                  f"differs from gpt-oss: {why}")
        for key, want, why in (("score_function", "softmax", "scores experts with a sigmoid"),
                               ("num_groups", None, "limits each token to groups of experts"),
                               ("topk_scaling_factor", None, "scales the top-k weights"),
                               ("enable_expert_bias", False, "selects experts with a balancing bias")):
            if getattr(moe_opt, key) != want:
                raise ConfigError(f"moe_opt.{key}", getattr(moe_opt, key),
                                  f"export a model trained with moe_opt.{key}={want}",
                                  f"{why}, which gpt-oss's router cannot express")
        if not normalizes(moe_opt.normalize_top_k, cfg.top_k):
            raise ConfigError("moe_opt.normalize_top_k", moe_opt.normalize_top_k,
                              "set moe_opt.normalize_top_k=true (gpt-oss's weights are a softmax over the "
                              "chosen k)", f"means raw router probabilities at top_k={cfg.top_k}")

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import GptOssConfig

        from moe.config.derived import head_dim_of, window_of

        self.check_exportable(cfg, moe_opt)
        types = ["full_attention" if window_of(cfg, i) is None else "sliding_attention"
                 for i in range(cfg.num_layers)]
        config = GptOssConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=head_dim_of(cfg),
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
            sliding_window=cfg.sliding_window, layer_types=types,
            max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_range,
            rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
            rope_parameters=rope_parameters(cfg),
            attention_bias=cfg.qkv_bias, attention_dropout=0.0, swiglu_alpha=float(cfg.swiglu_alpha),
            swiglu_limit=float(cfg.swiglu_limit), router_aux_loss_coef=moe_opt.aux_loss_coeff,
        )
        # 4.x configs read `rope_theta`, 5.x rope_parameters: config.json holds both (as Mixtral's
        # export does)
        config.rope_theta = float(cfg.rope_theta)
        return config

    def state_dict(self, model) -> dict[str, torch.Tensor]:
        """Our weights under gpt-oss's keys: experts [E, in, out] with gate and up interleaved, biases absent
        here written as zeros."""
        sd = llama_top_level_state(model)
        for i, block in enumerate(model.layers):
            p, e = f"model.layers.{i}.", f"model.layers.{i}.{EXPERTS}"
            router, experts = block.ffn.router, block.ffn.experts
            E, F2 = experts.num_experts, experts.layout.as_in_out(experts.gate_up).shape[-1]
            zeros = experts.gate_up.new_zeros
            sd |= llama_block_state(block, p) | {
                p + "self_attn.sinks": block.attn.sinks,
                p + "mlp.router.weight": router.weight,
                p + "mlp.router.bias": router.bias if router.bias is not None else zeros(E),
                e + "gate_up_proj": interleave(experts.layout.as_in_out(experts.gate_up)),
                e + "down_proj": experts.layout.as_in_out(experts.down),
                e + "gate_up_proj_bias": interleave(experts.gate_up_bias if experts.gate_up_bias is not None
                                                    else zeros(E, F2)),
                e + "down_proj_bias": experts.down_bias if experts.down_bias is not None
                else zeros(E, model.model_config.hidden_size)}
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    def per_expert(self, sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        """gpt-oss's files hold the stacked in-memory keys as they are: nothing to convert."""
        return dict(sd)
