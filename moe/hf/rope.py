"""RoPE, its scaling and its partial width between a transformers config and our `model.rope_*` keys and
`model.partial_rotary_factor`, for every family.

transformers 5.x holds it in `rope_parameters` {rope_type, rope_theta, factor, ...}; 4.x in `rope_theta`
and `rope_scaling` (None for plain RoPE, else {"rope_type" or the older "type", factor, ...}; 4.52.4
modeling_mixtral.py:395). Both read the same way; an export writes 5.x's `rope_parameters` (and
`rope_theta` at the top level, which 4.x reads). 4.x ignores `rope_parameters`, so a scaled export loads
there with plain RoPE: use transformers 5 for those.
"""
from __future__ import annotations

from moe.config.choices import ROPE_TYPES
from moe.config.rules.architecture import ROPE_KEYS
from moe.errors import ConfigError
from moe.hf.tensors import config_value

# our key -> transformers' rope_parameters key, for the keys read as they are
HF_KEYS = {"rope_factor": "factor",
           "rope_original_max_position_embeddings": "original_max_position_embeddings",
           "rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow", "rope_mscale": "mscale",
           "rope_mscale_all_dim": "mscale_all_dim", "rope_attention_factor": "attention_factor",
           "rope_truncate": "truncate", "rope_low_freq_factor": "low_freq_factor",
           "rope_high_freq_factor": "high_freq_factor"}
EXACT_TYPES = {"rope_truncate": bool, "rope_original_max_position_embeddings": int}  # the rest are floats


def hf_rope(hf_config) -> dict:
    """The checkpoint's RoPE dict, whichever version wrote it ({} for plain RoPE under 4.x)."""
    return dict(config_value(hf_config, "rope_parameters") or config_value(hf_config, "rope_scaling") or {})


def partial_rotary_factor(hf_config) -> float:
    """The share of each head RoPE rotates: rope_parameters' partial_rotary_factor (where transformers 5 moves
    the top-level key, modeling_rope_utils.py:786-796 at 5.24), else 4.x's top-level key, else 1."""
    factor = hf_rope(hf_config).get("partial_rotary_factor")
    if factor is None:
        factor = config_value(hf_config, "partial_rotary_factor")
    return 1.0 if factor is None else factor


def rope_keys(hf_config, default_theta: float) -> dict:
    """Our model.rope_theta, rope_type and rope_* keys for a transformers config; refuses a rope_type we do
    not compute (dynamic, longrope, ...). A missing factor (YaRN) and original context (llama3, YaRN) take
    transformers' defaults: max_position_embeddings / original (modeling_rope_utils.py:427) and
    max_position_embeddings (`standardize_rope_params`, :843)."""
    rope = hf_rope(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError("rope_parameters.rope_type", rope_type,
                          f"use a checkpoint whose rope_type is one of {', '.join(ROPE_TYPES)}",
                          "is not supported")
    theta = rope.get("rope_theta") or config_value(hf_config, "rope_theta") or default_theta
    keys = {"rope_theta": float(theta), "rope_type": rope_type,
            "partial_rotary_factor": float(partial_rotary_factor(hf_config))}
    if rope_type == "default":
        return keys
    max_positions = config_value(hf_config, "max_position_embeddings")
    if rope_type in ("llama3", "yarn") and rope.get("original_max_position_embeddings") is None:
        rope["original_max_position_embeddings"] = max_positions
    if rope_type == "yarn" and rope.get("factor") is None:
        rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    for ours, theirs in HF_KEYS.items():
        if rope.get(theirs) is not None and (ours == "rope_factor" or ours in ROPE_KEYS[rope_type]):
            keys[ours] = rope[theirs]
    return {k: v if k == "rope_type" else EXACT_TYPES.get(k, float)(v) for k, v in keys.items()}


def rope_parameters(model) -> dict:
    """transformers 5.x's rope_parameters for our model config: its type, theta and the scaling keys that
    are set (unset ones keep transformers' defaults, which are ours)."""
    params = {"rope_type": model.rope_type, "rope_theta": float(model.rope_theta)}
    if model.partial_rotary_factor != 1.0:  # only glm4_moe exports it (moe.hf.adapter.FAMILY_PIECES)
        params["partial_rotary_factor"] = float(model.partial_rotary_factor)
    if model.rope_type == "default":
        return params
    params["factor"] = float(model.rope_factor)
    for ours in ROPE_KEYS[model.rope_type]:
        value = getattr(model, ours)
        if value is not None:
            params[HF_KEYS[ours]] = EXACT_TYPES.get(ours, float)(value)
    return params
