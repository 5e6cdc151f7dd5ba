"""Mixtral (MixtralForCausalLM) <-> our GQA models, weights and config (the Llama family's, moe.hf.dense,
with Mixtral's router and experts).

Layouts (transformers 5.x, read from `models/mixtral/modeling_mixtral.py`):
  ours `layers.N.attn.qkv_proj.weight`  = rows [q | k | v]  <->  `self_attn.{q,k,v}_proj.weight`
  ours `ffn.experts` gate_up (H -> 2F)  = to_out_in         <->  `mlp.experts.gate_up_proj [E, 2F, H]`
       (gate outputs first, then up; HF chunks the output the same way: w1 rows then w3 rows)
  ours `ffn.experts` down (F -> H)      = to_out_in         <->  `mlp.experts.down_proj [E, H, F]`
  (our dim order is moe.model.expert_layout's; HF's stacks are [E, out, in], nn.Linear's)
  ours `ffn.router.weight [E, H]`                           <->  `mlp.gate.weight [E, H]`
transformers 4.x (the Trainium environment pins 4.52.4) keeps one module per expert instead:
`block_sparse_moe.experts.J.w1/w2/w3.weight` and `block_sparse_moe.gate.weight`, which is also
what `save_pretrained` writes in both versions (and the published Mixtral checkpoints use). Reading
goes through those per-expert keys (`per_expert` converts 5.x's in-memory ones), so one path serves
both versions and lazy reads of the files:

    ours layers.N.ffn.experts (gate_up)  H -> 2F           <- expert J: [w1 | w3] outputs  (w1, w3 [F, H])
    ours layers.N.ffn.experts (down)     F -> H            <- expert J: w2                 (w2 [H, F])
    ours layers.N.ffn.router.weight      [E, H]            <- block_sparse_moe.gate.weight

Mixtral always renormalises the top-k weights and never drops tokens, so an imported model gets a
dropless `MoEOptConfig` (capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True):
that is what makes its logits match transformers'. Options Mixtral cannot express (ALiBi, dense
layers, a shared expert, un-normalised top-k) refuse export with a ConfigError instead of writing
a model that would behave differently. Known difference kept: HF's jitter (`router_jitter_noise`)
also scales the expert input; ours (`jitter_eps`) scales the router input only. Both are
training-only.
"""
from __future__ import annotations

import torch

from moe.config.derived import head_dim_of
from moe.config.schema import ModelConfig, MoEOptConfig, normalizes
from moe.errors import ConfigError
from moe.hf.adapter import ExportAdapter, Read, check_plain_pieces, refuse_router_options
from moe.hf.dense import llama_block_state, llama_family_config, llama_top_level_state, llama_value
from moe.hf.rope import rope_parameters
from moe.hf.tensors import LAYER, STACKED_EXPERTS, Get, stacked_experts
from moe.model.expert_layout import OUT_IN

ROUTER = "block_sparse_moe.gate.weight"
EXPERT_WEIGHTS = ("w1.weight", "w3.weight", "w2.weight")  # gate, up, down


def mixtral_value(name: str, get: Get, num_experts: int, experts: range | None = None) -> torch.Tensor:
    """Our tensor `name` from a Mixtral checkpoint: the router and experts by Mixtral's keys, the rest by
    the Llama family's (moe.hf.dense.llama_value)."""
    match = LAYER.fullmatch(name)
    if match is not None:
        p, rest = f"model.layers.{match.group(1)}.", match.group(2)
        if rest == "ffn.router.weight":
            return get(p + ROUTER)
        if rest in STACKED_EXPERTS:
            prefixes = [_mixtral_expert(p, j) for j in (experts or range(num_experts))]
            return stacked_experts(rest, get, prefixes, EXPERT_WEIGHTS)
    return llama_value(name, get)


def _mixtral_expert(layer_prefix: str, j: int) -> str:
    return f"{layer_prefix}block_sparse_moe.experts.{j}."


class Mixtral(ExportAdapter):
    model_types = ("mixtral",)
    hf_class = "MixtralForCausalLM"
    router_key = ROUTER
    routing_keys = ("score_function", "num_groups", "enable_expert_bias")  # which experts a token picks

    # -- reading ----------------------------------------------------------------------------------
    def model_config(self, hf_config) -> ModelConfig:
        return llama_family_config(hf_config, hf_config.num_local_experts, hf_config.num_experts_per_tok)

    def moe_opt(self, hf_config) -> MoEOptConfig:
        """Dropless, renormalised softmax top-k (aux coeff and jitter carried over)."""
        return MoEOptConfig(
            name="mixtral_dropless", capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True,
            aux_loss_coeff=hf_config.router_aux_loss_coef, jitter_eps=hf_config.router_jitter_noise,
        )

    def reader(self, model_cfg, hf_config) -> Read:
        return lambda name, get, experts=None: mixtral_value(name, get, model_cfg.num_experts, experts)

    # -- writing ----------------------------------------------------------------------------------
    def check_exportable(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        check_plain_pieces(cfg, "Mixtral", self.model_types[0])
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
                              "use 0 (every layer MoE) to export to Mixtral (DeepSeek-V3 has it: "
                              "attention=mla)",
                              "makes dense layers, which Mixtral cannot express")
        if cfg.shared_expert_intermediate_size:
            raise ConfigError("model.shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                              "use 0 (no shared expert) to export to Mixtral",
                              "adds a shared expert, which Mixtral cannot express")
        refuse_router_options(moe_opt, "Mixtral")
        if not normalizes(moe_opt.normalize_top_k, cfg.top_k):
            raise ConfigError("moe_opt.normalize_top_k", moe_opt.normalize_top_k,
                              "set moe_opt.normalize_top_k=true (Mixtral always renormalises the top-k "
                              "weights)", f"means raw router probabilities at top_k={cfg.top_k}; Mixtral "
                              "cannot express that")

    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        from transformers import MixtralConfig

        self.check_exportable(cfg, moe_opt)
        config = MixtralConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=head_dim_of(cfg), hidden_act="silu",
            max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.init_range,
            rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
            sliding_window=cfg.sliding_window, num_experts_per_tok=cfg.top_k,
            num_local_experts=cfg.num_experts,
            router_aux_loss_coef=moe_opt.aux_loss_coeff, router_jitter_noise=moe_opt.jitter_eps,
            rope_theta=float(cfg.rope_theta), rope_parameters=rope_parameters(cfg),
        )
        # `rope_theta=` is 4.x's argument (4.52.4 configuration_mixtral.py:146); 5.x reads rope_parameters
        # (its scaling too: moe.hf.rope). 5.x saves only rope_parameters, which 4.x ignores (falling back to
        # theta 1e6), so keep `rope_theta` as an attribute too: config.json then loads with the right theta
        # in both versions.
        config.rope_theta = float(cfg.rope_theta)
        return config

    def state_dict(self, model) -> dict[str, torch.Tensor]:
        sd = llama_top_level_state(model)
        for i, block in enumerate(model.layers):
            p = f"model.layers.{i}."
            sd |= llama_block_state(block, p) | {p + "mlp.gate.weight": block.ffn.router.weight}
            experts = block.ffn.experts
            sd |= {p + "mlp.experts.gate_up_proj": experts.layout.to_out_in(experts.gate_up),
                   p + "mlp.experts.down_proj": experts.layout.to_out_in(experts.down)}
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    def per_expert(self, sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        """Stacked keys -> per-expert keys: gate_up_proj [E, 2F, H] = w1 rows then w3 rows per expert.
        5.x stacks the experts in memory (modeling_mixtral.py:56, `MixtralExperts`) and converts itself
        when it loads or saves (conversion_mapping.py:1270, "mixtral"); 4.x keeps them per expert in
        memory (4.52.4 modeling_mixtral.py:64 `MixtralBlockSparseTop2MLP` w1/w2/w3, :102-104 gate and
        experts, :317 `block_sparse_moe`)."""
        sd = dict(sd)
        for i in range(num_layers):
            p = f"model.layers.{i}."
            w1, w3 = OUT_IN.split_gate_up(sd.pop(p + "mlp.experts.gate_up_proj"))
            w2 = sd.pop(p + "mlp.experts.down_proj")
            sd[p + "block_sparse_moe.gate.weight"] = sd.pop(p + "mlp.gate.weight")
            for j in range(w2.shape[0]):
                e = _mixtral_expert(p, j)
                sd |= {e + "w1.weight": w1[j], e + "w3.weight": w3[j], e + "w2.weight": w2[j]}
        return sd
