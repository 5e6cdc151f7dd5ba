"""DeepSeek's layout of multi-token-prediction layers in a Hugging Face directory, for every family that keeps
it (DeepSeek-V3; GLM-4.5 keeps the same names).

Depth d (0-based) of a checkpoint with num_hidden_layers = L and num_nextn_predict_layers = N (d < N) is
`model.layers.{L + d}.*` in the safetensors files (the released DeepSeek-V3: layer 61; vLLM reads it so,
vllm/model_executor/models/deepseek_mtp.py `_rewrite_spec_layer_name`):

    enorm.weight, hnorm.weight, eh_proj.weight        <-> ours mtp.{d}.enorm, hnorm, eh_proj (moe.model.mtp)
    shared_head.norm.weight                           <-> ours mtp.{d}.norm
    the decoder layer's own tensors (self_attn.*,     <-> ours mtp.{d}.block.*, named as the family names
      mlp.*, input_layernorm, post_attention_layernorm)    layer L + d
    embed_tokens.weight, shared_head.head.weight      copies of the main embedding and LM head, which the
                                                      depths share: written on export as the released files
                                                      hold them, never read (ours are the main model's)

transformers builds no MTP layer (DeepseekV3ForCausalLM holds num_hidden_layers layers and skips the released
layer 61 on load: modeling_deepseek_v3.py:552 at 5.24), so these tensors are read from and written to the
files beside what the transformers model holds.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from moe.hf.sparse_moe import per_expert_keys
from moe.hf.tensors import TOP_LEVEL, Get, config_value

OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "norm.weight": "shared_head.norm.weight"}  # ours in mtp.{d} -> the checkpoint's in its layer
COPIES = {"embed_tokens.weight": TOP_LEVEL["embed_tokens.weight"],
          "shared_head.head.weight": TOP_LEVEL["lm_head.weight"]}  # in its layer -> the main model's key
DEPTH = re.compile(r"mtp\.(\d+)\.(.+)")
FILE = "model-mtp.safetensors"  # where an export writes them, beside what save_pretrained wrote


def layer_prefix(num_layers: int, depth: int) -> str:
    """The checkpoint's prefix of depth `depth`'s tensors."""
    return f"model.layers.{num_layers + depth}."


def declared(hf_config) -> int:
    """The depths config.json declares (num_nextn_predict_layers; transformers' DeepseekV3Config defaults it
    to 1 whether or not the files hold one)."""
    return int(config_value(hf_config, "num_nextn_predict_layers", 0) or 0)


def held(hf_config, keys: Iterable[str]) -> int:
    """The depths a directory holds: the declared ones whose eh_proj its files hold, counted from depth 0
    (a save_pretrained of transformers' model declares one and holds none)."""
    keys, num_layers = set(keys), config_value(hf_config, "num_hidden_layers")
    depth = 0
    while depth < declared(hf_config) and layer_prefix(num_layers, depth) + "eh_proj.weight" in keys:
        depth += 1
    return depth


def skipped_layers(hf_config) -> list[str]:
    """Regular expressions of every declared depth's keys: what loading the main model with transformers
    leaves unread (its `_keys_to_ignore_on_load_unexpected`)."""
    first = config_value(hf_config, "num_hidden_layers")
    return [rf"model\.layers\.{first + d}\..*" for d in range(declared(hf_config))]


def read_depth(name: str, get: Get, num_layers: int,
               read_layer: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Our tensor `name` (mtp.{d}.*) from the checkpoint: a depth's own tensors by their key, its block's
    through `read_layer` (the family's reader of `layers.{num_layers + d}.*`)."""
    match = DEPTH.fullmatch(name)
    if match is None:
        raise KeyError(f"{name}: not a multi-token-prediction tensor")
    depth, rest = int(match.group(1)), match.group(2)
    if rest.startswith("block."):
        return read_layer(f"layers.{num_layers + depth}.{rest.removeprefix('block.')}")
    if rest not in OWN:
        raise KeyError(f"{name}: not a parameter of a multi-token-prediction depth")
    return get(layer_prefix(num_layers, depth) + OWN[rest])


def depth_tensors(ours: dict[str, torch.Tensor], num_layers: int, depth: int,
                  block_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Depth `depth`'s tensors under the files' keys: its own from our state dict `ours`, its block's as the
    family writes layer num_layers + depth (`block_tensors`, already under the checkpoint's keys), and the
    copies of the main embedding and LM head the released files hold."""
    p, q = layer_prefix(num_layers, depth), f"mtp.{depth}."
    sd = {p + key: ours[q + rest] for rest, key in OWN.items()}
    main = {TOP_LEVEL[name]: ours[name] for name in ("embed_tokens.weight", "lm_head.weight")}
    sd |= {p + rest: main[key] for rest, key in COPIES.items()}
    return sd | block_tensors



def depths_state_dict(model, write_layer: Callable[[dict, object, str, str], dict]
                      ) -> dict[str, torch.Tensor]:
    """Every depth of `model` under the files' keys (experts one by one), as the released directories hold
    them: its own tensors and the embedding/head copies (depth_tensors), its block written by the family's
    `write_layer(ours, block, our_prefix, checkpoint_prefix)` (5.x keys, experts stacked)."""
    cfg, ours = model.model_config, model.state_dict()
    sd = {}
    for d, depth in enumerate(model.mtp):
        block = write_layer(ours, depth.block, f"mtp.{d}.block.", layer_prefix(cfg.num_layers, d))
        sd |= depth_tensors(ours, cfg.num_layers, d, block)
    sd = per_expert_keys(sd, cfg.num_layers + cfg.mtp_layers)
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}

def skipping_mtp(model_class, hf_config):
    """`model_class`, or a subclass of the same name that ignores this checkpoint's declared depths on load
    (transformers skips only the released models' own: modeling_deepseek_v3.py:552 layer 61,
    modeling_glm4_moe.py:461 layers 46 and 92): no unexpected-keys report."""
    skip = skipped_layers(hf_config)
    if not skip:
        return model_class
    patterns = [*(model_class._keys_to_ignore_on_load_unexpected or []), *skip]
    return type(model_class.__name__, (model_class,), {"_keys_to_ignore_on_load_unexpected": patterns})

