"""Dense Mistral/Llama -> MoE upcycling (Komatsuzaki et al. 2023, "Sparse Upcycling"): every expert
starts as a copy of the dense model's MLP, everything else is the dense model's.

Mixtral 8x7B itself started from Mistral 7B. With dropless routing and top-k weights that sum to 1
(renormalised, `normalize_top_k`), an upcycled layer computes sum_j w_j * MLP(x) = MLP(x), so the
upcycled model's logits equal the dense model's whatever the router picks; the router starts
from the usual seeded init (moe.model.init: near-uniform probabilities, so tokens spread over the
experts) and learns to specialise the copies. Optional Gaussian noise on the expert copies breaks
their symmetry (off by default: it also breaks the equality).

Fine-grained upcycling (`granularity` g > 1): the dense MLP's intermediate width F is cut into g
slices of F/g; expert c*g + j is slice j (of copy c), so num_experts/g copies of every slice exist.
SwiGLU is elementwise in the intermediate dimension, so the g slices together compute the dense MLP
exactly. The router rows of one copy's g experts start equal: their scores tie, and a top_k that is a
multiple of g picks whole copies (all g slices of each of the top_k/g best copies), whose
renormalised weights, times topk_scaling_factor = g, sum to 1 per slice: the logits again equal the
dense model's. Training then breaks the ties (each slice's router row gets its own gradient).

The Llama family's config and shared keys are here (`llama_family_config`, `llama_shaped_config`,
`llama_value`, and for export `llama_top_level_state`, `llama_block_state`; Mixtral and gpt-oss add their
routers and experts). The dense keys are Mistral's and Llama's (`mlp.gate_proj/up_proj/down_proj`);
`DenseUpcycle.reader` builds each of our tensors from them, from a state dict (`upcycle`) or from the
safetensors one tensor at a time (moe.hf.convert.tensor_source), as `model.upcycle_from_hf` reads them
on each rank.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.hf.adapter import HFAdapter, Read
from moe.hf.rope import rope_keys
from moe.hf.tensors import BLOCK_NORMS, TOP_LEVEL, Get, in_layer, load_local, top_level
from moe.model.expert_layout import EXPERT_LAYOUT, stored


def llama_family_config(hf_config, num_experts: int, top_k: int,
                        biased_attention: bool = False, biased_output: bool = True) -> ModelConfig:
    """Our ModelConfig for a Llama-shaped config (Mixtral, Mistral, Llama, Qwen-MoE, OLMoE, GLM-4.5) with
    these experts; refuses what our decoder does not implement. `biased_attention`: the family's
    attention_bias (q, k, v and o biased together: Qwen3-MoE, OLMoE; q, k and v only when not
    `biased_output`: GLM-4.5) is read as model.qkv_bias and o_bias; else refused (the family's export writes
    no attention bias)."""
    rope = rope_keys(hf_config, default_theta=1.0e6)  # plain, linear, llama3 or YaRN (moe.hf.rope)
    if hf_config.hidden_act != "silu":
        raise ConfigError("hidden_act", hf_config.hidden_act, "only SiLU (SwiGLU) experts are implemented",
                          "is not supported")
    if getattr(hf_config, "mlp_bias", False):  # Llama's option
        raise ConfigError("mlp_bias", True, "convert a checkpoint with mlp_bias=false (our MLPs have no "
                          "bias)", "is not supported")
    bias = bool(getattr(hf_config, "attention_bias", False))
    if bias and not biased_attention:
        raise ConfigError("attention_bias", True, "convert a checkpoint with attention_bias=false (a "
                          f"{hf_config.model_type} export writes no attention bias)", "is not supported")
    return llama_shaped_config(hf_config, num_experts, top_k, **rope, qkv_bias=bias,
                               o_bias=bias and biased_output)


def llama_shaped_config(hf_config, num_experts: int, top_k: int, **pieces) -> ModelConfig:
    """The ModelConfig fields every Llama-shaped family shares (sizes, heads, norms, window), plus `pieces`:
    the family's RoPE keys (moe.hf.rope.rope_keys, whose default theta is the family's own) and its own
    keys; refuses attention dropout."""
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ConfigError("attention_dropout", hf_config.attention_dropout,
                          "set attention_dropout=0 in config.json (our attention has no dropout)",
                          "is not supported")
    head_dim = getattr(hf_config, "head_dim", None)
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads  # HF's own default
    return ModelConfig(
        name=getattr(hf_config, "_name_or_path", "") or hf_config.model_type,
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        head_dim=None if head_dim in (None, default_head_dim) else head_dim,
        max_position_embeddings=hf_config.max_position_embeddings, position_encoding="rope",
        sliding_window=getattr(hf_config, "sliding_window", None), rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings), init_range=hf_config.initializer_range,
        num_experts=num_experts, top_k=top_k, moe_layer_frequency=1, shared_expert_intermediate_size=0,
        **pieces,
    )


LLAMA_IN_LAYER = {**BLOCK_NORMS, "attn.o_proj.weight": "self_attn.o_proj.weight"}


def llama_value(name: str, get: Get) -> torch.Tensor:
    """Our tensor `name` from a Llama-shaped checkpoint (Mistral, Llama, Mixtral): attention, norms and
    embeddings by the keys the family shares (the router and experts are each reader's own)."""
    if name in TOP_LEVEL:
        return top_level(name, get)
    p, rest = in_layer(name, "a Llama-shaped model")
    if rest in LLAMA_IN_LAYER:
        return get(p + LLAMA_IN_LAYER[rest])
    if rest == "attn.qkv_proj.weight":
        return torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
    raise KeyError(f"{name}: not a parameter of a Llama-shaped model")


def llama_top_level_state(model) -> dict[str, torch.Tensor]:
    """Our embeddings, final norm and LM head under the Llama family's keys."""
    return {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
            "lm_head.weight": model.lm_head.weight}


def llama_block_state(block, p: str) -> dict[str, torch.Tensor]:
    """A block's attention and norms under the Llama family's keys after `p` (model.layers.N.): our fused
    qkv_proj split into q, k and v (weights, and biases where model.qkv_bias), o_proj (and its bias)."""
    attn = block.attn
    sizes = attn.split_sizes
    sd = {p + "input_layernorm.weight": block.attn_norm.weight,
          p + "post_attention_layernorm.weight": block.ffn_norm.weight,
          p + "self_attn.o_proj.weight": attn.o_proj.weight}
    for kind in ("weight", "bias"):
        fused = getattr(attn.qkv_proj, kind)
        if fused is not None:
            parts = zip("qkv", fused.split(sizes), strict=True)
            sd |= {p + f"self_attn.{n}_proj.{kind}": t for n, t in parts}
    if attn.o_proj.bias is not None:
        sd[p + "self_attn.o_proj.bias"] = attn.o_proj.bias
    return sd


def check_granularity(granularity: int, num_experts: int, top_k: int, intermediate_size: int,
                      field: str = "granularity") -> None:
    """What fine-grained upcycling needs to start equal to the dense model."""
    if granularity < 1 or num_experts % granularity or top_k % granularity or intermediate_size % granularity:
        raise ConfigError(field, granularity,
                          f"use a g that divides num_experts={num_experts}, top_k={top_k} and the dense "
                          f"intermediate_size={intermediate_size} (g=1: every expert a whole copy)",
                          "cannot slice the dense MLP into whole copies")


def fine_grained_experts(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, experts: range,
                         granularity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (gate_up H -> 2F/g, down F/g -> H) for `experts`, in the stored layout: expert e is slice e % g of
    the dense MLP (w1, w3 [F, H], w2 [H, F]); g = 1 gives whole copies."""
    width = w1.shape[0] // granularity
    cut = [slice((e % granularity) * width, (e % granularity + 1) * width) for e in experts]
    layout = stored()
    gate_up = layout.join_gate_up(layout.stack_linear([w1[s] for s in cut]),
                                  layout.stack_linear([w3[s] for s in cut]))
    return gate_up, layout.stack_linear([w2[:, s] for s in cut]).contiguous()


def tied_router_rows(router_EH: torch.Tensor, granularity: int) -> torch.Tensor:
    """The router rows of each copy's g slice-experts made equal (the copy's first row), so top-k picks
    whole copies at the start."""
    return router_EH[::granularity].repeat_interleave(granularity, dim=0)


class DenseUpcycle(HFAdapter):
    """A dense checkpoint read as an MoE model of `num_experts` experts (of width F / granularity), `top_k`
    of them per token; routers from moe.model.init's values for `seed`, rows tied per copy."""

    model_types = ("mistral", "llama")

    def __init__(self, num_experts: int, top_k: int, granularity: int = 1, seed: int = 0,
                 granularity_field: str = "granularity"):
        self.num_experts, self.top_k, self.granularity, self.seed = num_experts, top_k, granularity, seed
        self.granularity_field = granularity_field  # as the caller spells it (model.upcycle_granularity)

    def model_config(self, hf_config) -> ModelConfig:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in self.model_types:
            raise ConfigError("model.upcycle_from_hf", model_type, "upcycle a Mistral or Llama checkpoint",
                              f"is not one of {self.model_types}")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, flag, False):
                raise ConfigError(flag, True, "upcycle a checkpoint without biases (Mistral, Llama 2/3)",
                                  "is not supported: our projections have no bias")
        cfg = llama_family_config(hf_config, self.num_experts, self.top_k)
        check_granularity(self.granularity, self.num_experts, self.top_k, cfg.intermediate_size,
                          self.granularity_field)
        return replace(cfg, intermediate_size=cfg.intermediate_size // self.granularity)

    def moe_opt(self, hf_config) -> MoEOptConfig:
        """Dropless, renormalised top-k (times topk_scaling_factor = granularity): logits equal the dense
        model's."""
        g = self.granularity
        return MoEOptConfig(name="upcycled_dropless", capacity_factor=None, eval_capacity_factor=None,
                            normalize_top_k=True, topk_scaling_factor=float(g) if g > 1 else None)

    def reader(self, model_cfg, hf_config) -> Read:
        from moe.model.init import init_stds, initial_values

        std, out_std = init_stds(model_cfg)
        router_shape = (model_cfg.num_experts, model_cfg.hidden_size)

        def read(name: str, get, experts: range | None = None) -> torch.Tensor:
            if name.endswith("ffn.router.weight"):
                values = initial_values(name, router_shape, self.seed, std, out_std)
                return tied_router_rows(values, self.granularity)
            if EXPERT_LAYOUT.is_expert_tensor(name):
                mlp = "model." + name.split(".ffn.")[0] + ".mlp."
                w1, w3, w2 = (get(mlp + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj"))
                gate_up, down = fine_grained_experts(w1, w3, w2, experts or range(self.num_experts),
                                                     self.granularity)
                return gate_up if EXPERT_LAYOUT.is_gate_up(name) else down
            return llama_value(name, get)  # attention, norms, embeddings

        return read


def upcycle(dense, num_experts: int, top_k: int, moe_opt: MoEOptConfig | None = None,
            noise_std: float = 0.0, seed: int = 0, granularity: int = 1):
    """A MoETransformer from a transformers Mistral/Llama model or save_pretrained directory.

    moe_opt defaults to dropless, renormalised top-k routing (times topk_scaling_factor = granularity),
    under which the logits equal the dense model's. noise_std > 0 adds N(0, noise_std * std(weight))
    to each expert. granularity g > 1: fine-grained experts, each a 1/g slice of the dense MLP.
    """
    from transformers import AutoModelForCausalLM

    from moe.model.model import MoETransformer

    dense = load_local(dense, AutoModelForCausalLM, "model.upcycle_from_hf")
    adapter = DenseUpcycle(num_experts, top_k, granularity, seed)
    cfg = adapter.model_config(dense.config)
    ref = next(dense.parameters())
    model = MoETransformer(cfg, moe_opt or adapter.moe_opt(dense.config), init_seed=seed).to(dtype=ref.dtype)
    sd, read = dense.state_dict(), adapter.reader(cfg, dense.config)
    values = {name: read(name, sd.__getitem__) for name in model.state_dict()}
    if noise_std > 0:
        gen = torch.Generator().manual_seed(seed)
        for name, value in values.items():
            if EXPERT_LAYOUT.is_expert_tensor(name):
                noise = torch.randn(value.shape, generator=gen, dtype=torch.float32)
                values[name] = value + (noise * noise_std * value.float().std()).to(value.dtype)
    model.load_state_dict({k: v.detach().clone().contiguous() for k, v in values.items()}, strict=True)
    return model


def read_dense_config(path: str | Path):
    """The transformers config of a dense directory (config.json), for model.upcycle_from_hf."""
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ConfigError("model.upcycle_from_hf", str(path), "point to a local directory written by "
                          "save_pretrained (config.json + safetensors)", "has no config.json")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)
