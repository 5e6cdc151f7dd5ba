"""RoPE's inverse frequencies, its cos/sin factor and MLA's softmax-scale correction, for every
`model.rope_type`: plain (default), linear, llama3 and YaRN.

Computed exactly as transformers 5.24 computes them (modeling_rope_utils.py, `ROPE_INIT_FUNCTIONS`:
`_compute_linear_scaling_rope_parameters` :134, `_compute_llama3_parameters` :581, `_compute_yarn_parameters`
:346), the same float32 operations in the same order, so an imported checkpoint sees the positions it
was trained with. GQA attention, MLA and KV-cache generation all read `rope_cos_sin`: a decode step at
`position_offset` gets the rows of the full sequence's cos/sin for those positions.
"""
from __future__ import annotations

import math

import torch

# Defaults transformers applies when a YaRN key is absent (modeling_rope_utils.py:444-445, :475).
YARN_BETA_FAST, YARN_BETA_SLOW, YARN_TRUNCATE = 32, 1, True


def _plain(theta: float, dim: int, device) -> torch.Tensor:
    """1 / theta^(2i/dim) (modeling_rope_utils.py:185)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (theta ** exponents)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1): transformers'
    `get_mscale` (modeling_rope_utils.py:430) and DeepSeek-V3's `yarn_get_mscale`
    (modeling_deepseek_v3.py:262)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _llama3(m, dim: int, device) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth ramp between
    (modeling_rope_utils.py:640-661)."""
    inv_freq = _plain(m.rope_theta, dim, device)
    factor, low, high = m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor
    old_context_len = m.rope_original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn(m, dim: int, device) -> torch.Tensor:
    """YaRN (arXiv:2309.00071): dims that turn fewer than beta_slow times over the original context
    are interpolated (divided by factor), those that turn more than beta_fast times kept, a linear ramp
    between (modeling_rope_utils.py:442-484)."""
    base, factor = m.rope_theta, m.rope_factor
    original = m.rope_original_max_position_embeddings
    beta_fast = m.rope_beta_fast or YARN_BETA_FAST
    beta_slow = m.rope_beta_slow or YARN_BETA_SLOW
    truncate = YARN_TRUNCATE if m.rope_truncate is None else m.rope_truncate

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pairs = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = torch.clamp((pairs - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return (inv_freq_interpolation * (1 - extrapolation_factor)
            + inv_freq_extrapolation * extrapolation_factor)


def inverse_frequencies(m, dim: int, device=None) -> torch.Tensor:
    """float32 [dim / 2]: the rotation speed of each pair of the `dim` rotated dims, for model config m's
    rope_type (transformers' ROPE_INIT_FUNCTIONS[rope_type](config)[0])."""
    if m.rope_type == "yarn":
        return _yarn(m, dim, device)
    if m.rope_type == "llama3":
        return _llama3(m, dim, device)
    inv_freq = _plain(m.rope_theta, dim, device)
    if m.rope_type == "linear":
        inv_freq /= m.rope_factor
    return inv_freq


def attention_factor(m) -> float:
    """What cos and sin are multiplied by (transformers' `attention_scaling`): YaRN's
    rope_attention_factor, else mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim) when
    both are set (DeepSeek-V3), else mscale(factor); 1 for the other types (modeling_rope_utils.py:436-440).
    """
    if m.rope_type != "yarn":
        return 1.0
    if m.rope_attention_factor is not None:
        return float(m.rope_attention_factor)
    if m.rope_mscale and m.rope_mscale_all_dim:
        factor = m.rope_factor
        return float(yarn_mscale(factor, m.rope_mscale) / yarn_mscale(factor, m.rope_mscale_all_dim))
    return yarn_mscale(m.rope_factor)


def mla_softmax_scale(m, qk_head_dim: int) -> float | None:
    """MLA's attention scale: 1/sqrt(qk_head_dim), times mscale(factor, rope_mscale_all_dim)^2 when a
    scaled RoPE sets rope_mscale_all_dim (DeepSeek-V3's `yarn_apply_mscale`, modeling_deepseek_v3.py:268,
    applied at :405); None (SDPA's own 1/sqrt(head dim), the same value) without it."""
    if m.rope_type == "default" or not m.rope_mscale_all_dim:
        return None
    mscale = yarn_mscale(m.rope_factor, m.rope_mscale_all_dim)
    return qk_head_dim ** (-0.5) * mscale * mscale


def rope_cos_sin(start: int, length: int, inv_freq: torch.Tensor, scale: float, dtype):
    """cos/sin [S, D] for positions start..start+S-1, times `scale` (attention_factor), in `dtype`."""
    positions = torch.arange(start, start + length, device=inv_freq.device)
    return rope_cos_sin_at(positions, inv_freq, scale, dtype)


def rope_cos_sin_at(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype):
    """cos/sin [..., D] for the given positions (any shape: a row's, or each token's own in packed
    documents, moe.model.documents), times `scale` (attention_factor), in `dtype`; computed in float32 as
    transformers' rotary embeddings (modeling_deepseek_v3.py:95-101)."""
    pos = positions.to(device=inv_freq.device, dtype=torch.float)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)
