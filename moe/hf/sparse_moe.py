"""What transformers 5.x's softmax top-k MoE families share (Qwen2-MoE, Qwen3-MoE, OLMoE): one layout of
keys, one reader and writer, one set of refusals; each family's file adds its config and what only it has.

Layout (models/qwen3_moe/modeling_qwen3_moe.py, qwen2_moe/modeling_qwen2_moe.py, olmoe/modeling_olmoe.py
at transformers 5.24):
  ours attn.qkv_proj.weight/.bias = rows [q | k | v]     <->  self_attn.{q,k,v}_proj.weight/.bias
  ours attn.o_proj.weight/.bias                          <->  self_attn.o_proj.weight/.bias
  ours attn.q_norm / k_norm                              <->  self_attn.q_norm / k_norm
  ours ffn.router.weight [E, H]                          <->  mlp.gate.weight (a `*TopKRouter`'s weight)
  ours ffn.experts (gate_up, down)                       <->  mlp.experts.gate_up_proj [E, 2F, H] (gate
       rows then up rows: `.chunk(2, dim=-1)`, modeling_qwen3_moe.py:241) and down_proj [E, H, F] in
       memory; mlp.experts.J.{gate,up,down}_proj.weight on disk (conversion_mapping.py:67, :75: the
       qwen2_moe converter, which save_pretrained reverses) and in transformers 4.x
  ours ffn.gate_up_proj, ffn.down_proj (dense layers)    <->  mlp.{gate,up,down}_proj
  ours ffn.shared_expert.*, ffn.shared_expert_gate       <->  mlp.shared_expert.*, mlp.shared_expert_gate
Routing (`*TopKRouter.forward`, modeling_qwen3_moe.py:259-270): softmax over every expert in fp32, top-k,
renormalised when norm_topk_prob; never drops tokens. An import is dropless with the checkpoint's
norm_topk_prob and its router_aux_loss_coef.
"""
from __future__ import annotations

from abc import abstractmethod

import torch

from moe.config.derived import head_dim_of
from moe.config.schema import ModelConfig, MoEOptConfig, normalizes
from moe.errors import ConfigError
from moe.hf.adapter import ExportAdapter, Read, check_plain_pieces, refuse_router_options, refuse_unless
from moe.hf.tensors import (
    BLOCK_NORMS,
    LAYER,
    STACKED_EXPERTS,
    TOP_LEVEL,
    Get,
    in_layer,
    stacked_experts,
    top_level,
)
from moe.model.expert_layout import OUT_IN

# ours (within a layer) -> transformers', one tensor each
SINGLE = {**BLOCK_NORMS, "attn.o_proj.weight": "self_attn.o_proj.weight",
          "attn.o_proj.bias": "self_attn.o_proj.bias",
          "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
          "ffn.router.weight": "mlp.gate.weight", "ffn.down_proj.weight": "mlp.down_proj.weight",
          "ffn.shared_expert.down_proj.weight": "mlp.shared_expert.down_proj.weight",
          "ffn.shared_expert_gate.weight": "mlp.shared_expert_gate.weight"}
# ours -> transformers' pieces, in our rows' order
FUSED = {"attn.qkv_proj.weight": tuple(f"self_attn.{n}_proj.weight" for n in "qkv"),
         "attn.qkv_proj.bias": tuple(f"self_attn.{n}_proj.bias" for n in "qkv"),
         "ffn.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
         "ffn.shared_expert.gate_up_proj.weight": ("mlp.shared_expert.gate_proj.weight",
                                                   "mlp.shared_expert.up_proj.weight")}
EXPERT_WEIGHTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def expert_prefix(layer_prefix: str, j: int) -> str:
    return f"{layer_prefix}mlp.experts.{j}."


def sparse_moe_value(name: str, get: Get, num_experts: int, experts: range | None = None,
                     single: dict = SINGLE, fused: dict = FUSED) -> torch.Tensor:
    """Our tensor `name` from the per-expert keys of the files (and of transformers 4.x); `single` and
    `fused`: the family's names beside the experts (GLM-4.5's differ: moe.hf.glm4_moe)."""
    if name in TOP_LEVEL:
        return top_level(name, get)
    p, rest = in_layer(name, "this model")
    if rest in single:
        return get(p + single[rest])
    if rest in fused:
        return torch.cat([get(p + key) for key in fused[rest]])
    if rest in STACKED_EXPERTS:
        prefixes = [expert_prefix(p, j) for j in (experts or range(num_experts))]
        return stacked_experts(rest, get, prefixes, EXPERT_WEIGHTS)
    raise KeyError(f"{name}: not a parameter of this model")


def split_sizes(cfg: ModelConfig, rest: str, rows: int) -> list[int]:
    """How our fused tensor `rest`'s rows split into transformers' pieces."""
    if rest.startswith("attn.qkv_proj"):
        kv = cfg.num_kv_heads * head_dim_of(cfg)
        return [cfg.num_heads * head_dim_of(cfg), kv, kv]
    return [rows // 2, rows // 2]


def sparse_moe_state_dict(model, single: dict = SINGLE, fused: dict = FUSED) -> dict[str, torch.Tensor]:
    """Our weights under transformers 5.x's keys (experts stacked [E, out, in]); `single`, `fused` as
    sparse_moe_value's. Multi-token-prediction depths (mtp.*) are a family's extra_state_dict's."""
    cfg = model.model_config
    sd = {}
    for name, value in model.state_dict().items():
        if name.startswith("mtp."):
            continue
        if name in TOP_LEVEL:
            sd[TOP_LEVEL[name]] = value
            continue
        match = LAYER.fullmatch(name)
        i, rest = int(match.group(1)), match.group(2)
        sd |= layer_tensors(cfg, f"model.layers.{i}.", rest, value, model.layers[i], single, fused)
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def layer_tensors(cfg: ModelConfig, p: str, rest: str, value: torch.Tensor, block, single: dict,
                  fused: dict) -> dict[str, torch.Tensor]:
    """Our layer tensor `rest` (of `block`) under transformers 5.x's keys at the checkpoint's layer prefix
    `p`."""
    if rest in single:
        return {p + single[rest]: value}
    if rest in fused:
        pieces = value.split(split_sizes(cfg, rest, value.shape[0]))
        return {p + key: piece for key, piece in zip(fused[rest], pieces, strict=True)}
    if rest in STACKED_EXPERTS:
        layout = block.ffn.experts.layout
        hf_name = "gate_up_proj" if layout.is_gate_up(rest) else "down_proj"
        return {f"{p}mlp.experts.{hf_name}": layout.to_out_in(value)}
    raise KeyError(f"{p}{rest}: no transformers key for it")


def per_expert_keys(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """transformers 5.x's stacked `mlp.experts.gate_up_proj` [E, 2F, H] and `down_proj` [E, H, F] -> the
    per-expert `mlp.experts.J.{gate,up,down}_proj.weight` of the files (and of 4.x)."""
    sd = dict(sd)
    for i in range(num_layers):
        e = f"model.layers.{i}.mlp.experts."
        if e + "gate_up_proj" not in sd:
            continue
        gate, up = OUT_IN.split_gate_up(sd.pop(e + "gate_up_proj"))
        down = sd.pop(e + "down_proj")
        for j in range(down.shape[0]):
            sd |= {f"{e}{j}.gate_proj.weight": gate[j], f"{e}{j}.up_proj.weight": up[j],
                   f"{e}{j}.down_proj.weight": down[j]}
    return sd


class SparseMoeFamily(ExportAdapter):
    """A family with transformers' softmax top-k router; subclasses give the config both ways and what
    only they can express (`check_family`)."""

    family: str  # as messages name it
    router_key = SINGLE["ffn.router.weight"]
    routing_keys = ("score_function", "num_groups", "enable_expert_bias", "normalize_top_k")

    @abstractmethod
    def model_config(self, hf_config) -> ModelConfig:
        ...

    @abstractmethod
    def check_family(self, cfg: ModelConfig) -> None:
        """Refuse the model keys this family cannot express."""

    def moe_opt(self, hf_config) -> MoEOptConfig:
        """Dropless softmax top-k, renormalised as norm_topk_prob says; the aux loss coefficient carried
        over."""
        return MoEOptConfig(name=f"{self.model_types[0]}_dropless", capacity_factor=None,
                            eval_capacity_factor=None, normalize_top_k=bool(hf_config.norm_topk_prob),
                            aux_loss_coeff=hf_config.router_aux_loss_coef)

    def reader(self, model_cfg, hf_config) -> Read:
        return lambda name, get, experts=None: sparse_moe_value(name, get, model_cfg.num_experts, experts)

    def check_exportable(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        refuse_unless(cfg, self.family, attention="gqa", position_encoding="rope")
        check_plain_pieces(cfg, self.family, self.model_types[0])
        self.check_family(cfg)
        refuse_router_options(moe_opt, self.family)

    def norm_topk_prob(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> bool:
        return normalizes(moe_opt.normalize_top_k, cfg.top_k)

    @staticmethod
    def with_rope_theta(config, cfg: ModelConfig):
        """`config` with `rope_theta` kept as an attribute too, which transformers 4.x reads (5.x reads
        rope_parameters; as moe.hf.mixtral does)."""
        config.rope_theta = float(cfg.rope_theta)
        return config

    def state_dict(self, model) -> dict[str, torch.Tensor]:
        return sparse_moe_state_dict(model)

    def per_expert(self, sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        return per_expert_keys(sd, num_layers)


def refuse_split_attention_bias(cfg: ModelConfig, family: str) -> None:
    """Qwen3-MoE's and OLMoE's attention_bias is one switch for q, k, v and o: model.qkv_bias and o_bias
    must agree."""
    if cfg.qkv_bias != cfg.o_bias:
        want = str(cfg.qkv_bias).lower()
        raise ConfigError("model.o_bias", cfg.o_bias, f"set model.o_bias={want} (as model.qkv_bias) to "
                          f"export to {family}", f"differs from model.qkv_bias={want}: {family}'s "
                          "attention_bias biases q, k, v and o together")


def mlp_only_layers(cfg: ModelConfig) -> list[int]:
    """Qwen's mlp_only_layers for our dense pattern: the leading dense layers and model.dense_layers (the
    frequency rule is decoder_sparse_step, which transformers applies the same way)."""
    return sorted(set(range(cfg.first_k_dense_replace)) | set(cfg.dense_layers or ()))
