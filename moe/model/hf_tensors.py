"""Our parameters from Mixtral's weights, one tensor (one expert) at a time.

Keys are those of Mixtral's files, which `save_pretrained` writes in transformers 4 and 5 alike
and the published Mixtral checkpoints use (per expert: `block_sparse_moe.experts.J.w1/w2/w3.weight`,
`block_sparse_moe.gate.weight`). `our_value(name, get, cfg)` builds our tensor `name` from
`get(key)`, whatever holds the keys: a state dict (moe.model.hf.from_hf) or a safetensors
directory read lazily (`hf_tensor_source`), so a rank that needs one expert of one layer reads
only that, never the whole model (trn1's param_init_fn, moe/backends/neuron/layers.py).

    ours layers.N.attn.qkv_proj.weight   rows [q | k | v]  <- self_attn.{q,k,v}_proj.weight
    ours layers.N.ffn.experts.gate_up    [E, H, 2F]        <- expert J: [w1.T | w3.T]  (w1, w3 [F, H])
    ours layers.N.ffn.experts.down       [E, F, H]         <- expert J: w2.T           (w2 [H, F])
    ours layers.N.ffn.router.weight      [E, H]            <- block_sparse_moe.gate.weight
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

TOP_LEVEL = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
IN_LAYER = {"attn.o_proj.weight": "self_attn.o_proj.weight", "attn_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "ffn.router.weight": "block_sparse_moe.gate.weight"}
LAYER = re.compile(r"layers\.(\d+)\.(.+)")
STACKED_EXPERTS = ("ffn.experts.gate_up", "ffn.experts.down")  # ours, built by stacked_experts

Get = Callable[[str], torch.Tensor]


def our_value(name: str, get: Get, num_experts: int, experts: range | None = None) -> torch.Tensor:
    """Our tensor `name`; for a stacked expert tensor, experts `experts` (default all) in order."""
    if name in TOP_LEVEL:
        if name == "lm_head.weight" and not _has(get, TOP_LEVEL[name]):
            return get(TOP_LEVEL["embed_tokens.weight"])  # tied embeddings
        return get(TOP_LEVEL[name])
    match = LAYER.fullmatch(name)
    if match is None:
        raise KeyError(f"{name}: not a Mixtral parameter")
    p, rest = f"model.layers.{match.group(1)}.", match.group(2)
    if rest in IN_LAYER:
        return get(p + IN_LAYER[rest])
    if rest == "attn.qkv_proj.weight":
        return torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
    if rest in STACKED_EXPERTS:
        expert = [f"{p}block_sparse_moe.experts.{j}." for j in (experts or range(num_experts))]
        return stacked_experts(rest, get, expert, ("w1.weight", "w3.weight", "w2.weight"))
    raise KeyError(f"{name}: not a Mixtral parameter")


def stacked_experts(rest: str, get: Get, expert_prefixes: list[str],
                    names: tuple[str, str, str]) -> torch.Tensor:
    """Our `ffn.experts.gate_up` [E, H, 2F] ([gate.T | up.T]) or `ffn.experts.down` [E, F, H] (down.T)
    from per-expert gate and up [F, H] and down [H, F] weights, `names` under each expert's prefix."""
    gate, up, down = names
    if rest == "ffn.experts.gate_up":
        return torch.stack([torch.cat([get(e + gate).T, get(e + up).T], dim=1) for e in expert_prefixes])
    return torch.stack([get(e + down).T for e in expert_prefixes])


def _has(get: Get, key: str) -> bool:
    try:
        get(key)
    except KeyError:
        return False
    return True


class SafetensorsDir:
    """`get(key)` over a save_pretrained directory's safetensors (one file or an index), read lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            with safe_open(self.path / "model.safetensors", framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), "model.safetensors")
        self._open: dict[str, object] = {}

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self.file_of:
            raise KeyError(key)
        name = self.file_of[key]
        if name not in self._open:
            self._open[name] = safe_open(self.path / name, framework="pt")
        return self._open[name].get_tensor(key)


def value_reader(model_type: str | None, rope_interleave: bool, model_cfg):
    """`read(name, get, experts=None)` -> our tensor from a checkpoint's per-expert keys: `our_value` for
    Mixtral's, moe.model.hf_deepseek.deepseek_value for DeepSeek-V3's (`rope_interleave`: its layout)."""
    if model_type == "deepseek_v3":
        from moe.model.hf_deepseek import deepseek_value

        return lambda name, get, experts=None: deepseek_value(name, get, model_cfg, rope_interleave, experts)
    return lambda name, get, experts=None: our_value(name, get, model_cfg.num_experts, experts)


def hf_tensor_source(path: str | Path, model_cfg):
    """`source(name, shape, first_expert)` -> our tensor from DIR's files, as moe.backends.neuron.layers
    .init_from reads values: full tensors, or experts [first_expert, first_expert + shape[0]).
    A Mixtral directory's keys as above, a DeepSeek-V3 one's through moe.model.hf_deepseek (config.json
    says which)."""
    files = SafetensorsDir(path)
    hf_config = json.loads((Path(path) / "config.json").read_text())
    read = value_reader(hf_config.get("model_type"), hf_config.get("rope_interleave", True), model_cfg)

    def source(name: str, shape, first_expert: int | None) -> torch.Tensor:
        experts = None if first_expert is None else range(first_expert, first_expert + shape[0])
        value = read(name, files.get, experts)
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{path}: {name} is {tuple(value.shape)}, the model expects {tuple(shape)}")
        return value

    return source
