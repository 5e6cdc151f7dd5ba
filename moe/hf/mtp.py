r"""Multi-token-prediction layers a checkpoint holds after its main ones (DeepSeek-V3, GLM-4.5): where they
are, a loading class that skips them, and the one line that says so.

transformers skips the released models' (modeling_deepseek_v3.py:552, `_keys_to_ignore_on_load_unexpected =
[r"model\.layers\.61.*"]`; modeling_glm4_moe.py:461, layers 46 and 92); ours at any checkpoint's depth.
"""
from __future__ import annotations

from moe.hf.tensors import config_value


def mtp_layers(hf_config) -> range:
    """model.layers.{num_hidden_layers + i}.* for i < num_nextn_predict_layers (DeepSeek-V3: 61)."""
    first = config_value(hf_config, "num_hidden_layers")
    return range(first, first + (config_value(hf_config, "num_nextn_predict_layers", 0) or 0))


def skipping_mtp(model_class, hf_config):
    """`model_class`, or a subclass of the same name that ignores this checkpoint's MTP layers on load:
    never read, and no unexpected-keys report."""
    skip = [rf"model\.layers\.{i}\..*" for i in mtp_layers(hf_config)]
    if not skip:
        return model_class
    patterns = [*(model_class._keys_to_ignore_on_load_unexpected or []), *skip]
    return type(model_class.__name__, (model_class,), {"_keys_to_ignore_on_load_unexpected": patterns})


def mtp_note(hf_config, keys, hf_class: str) -> str | None:
    """Names the multi-token-prediction layers the directory holds (`keys`), which the import skips."""
    held = [i for i in mtp_layers(hf_config) if any(k.startswith(f"model.layers.{i}.") for k in keys)]
    if not held:
        return None
    layers = ", ".join(f"model.layers.{i}.*" for i in held)
    return (f"holds {len(held)} multi-token-prediction layer(s) ({layers}; num_nextn_predict_layers="
            f"{config_value(hf_config, 'num_nextn_predict_layers')}): skipped, as transformers' "
            f"{hf_class} skips them (training MTP is not implemented); the main model's "
            f"{config_value(hf_config, 'num_hidden_layers')} layers are read")
