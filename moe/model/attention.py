"""Self-attention pieces shared by every attention kind: RoPE (its frequencies: moe/model/rope.py) and
ALiBi positions, the causal / sliding-window / padding masks, the KV cache, the SDPA core, and GQA
attention (`Attention`).

Multi-head latent attention (DeepSeek-V2/V3) builds on the same pieces in moe/model/mla.py.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.config.derived import head_dim_of, rotary_dim_of, window_of
from moe.config.schema import ModelConfig
from moe.model.documents import Documents, FlexDocumentMask
from moe.model.norm import RMSNorm, rms_norm
from moe.model.rope import attention_factor, inverse_frequencies, rope_cos_sin, rope_cos_sin_at

# ----------------------------------------------------------------------------- positions


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BhSD: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """x rotated by cos/sin over its first R dims (R = cos's width: all of D, or model.partial_rotary_factor's
    share), the rest passed through: transformers' apply_rotary_pos_emb (glm4_moe/modeling_glm4_moe.py:138-171
    at 5.24: `q[..., :rotary_dim]` rotated with rotate_half, `q[..., rotary_dim:]` concatenated after)."""
    rotary = cos_SR.shape[-1]
    if rotary == x_BhSD.shape[-1]:
        return x_BhSD * cos_SR + rotate_half(x_BhSD) * sin_SR
    x_rot, x_pass = x_BhSD[..., :rotary], x_BhSD[..., rotary:]
    return torch.cat([x_rot * cos_SR + rotate_half(x_rot) * sin_SR, x_pass], dim=-1)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Press et al. slopes: 2^(-8i/n) for a power-of-two n, interleaved extras otherwise."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float)


def attention_mask(q_start: int, q_len: int, k_start: int, k_len: int, window: int | None, device):
    """Boolean [Sq, Sk], True = may attend: causal, and within `window` positions incl. itself.

    Same rule as transformers' `sliding_window_causal_mask_function`:
    kv <= q and kv > q - window.
    """
    q_pos = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    k_pos = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


# ----------------------------------------------------------------------------- attention

# the last no-grad RoPE tables (CausalSelfAttention.rope):
# key -> (the config they were computed for, (cos, sin))
_SHARED_ROPE: dict = {}
# the last no-grad padding masks (CausalSelfAttention.visible): (the attention_mask_BS they hide, {key: mask})
_SHARED_PADDING: list = [None, {}]


def forget_shared_padding() -> None:
    """Let the last forward's shared padding masks go (a prefill's are [B, 1, S, S]): the model's forward
    calls it after its layers."""
    _SHARED_PADDING[:] = [None, {}]


class SumGradOver(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over `group` (Megatron's f operator): for a tensor
    every tensor-parallel rank reads for its own heads only."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class KVCache:
    """One layer's keys/values for generation: kv heads only (GQA), trimmed to the sliding window.

    `k`, `v` are [B, kv_heads, S, D]; `start` is the absolute position of `k[:, :, 0]`. A cache of one
    tensor (MLA's latent cache, moe.model.mla.LatentKVCache) appends with v=None and keeps `v` None.
    """

    def __init__(self, window: int | None = None):
        self.window = window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.start = 0

    @property
    def end(self) -> int:
        """Absolute position one past the last cached token (= tokens seen so far)."""
        return self.start + (0 if self.k is None else self.k.shape[2])

    @property
    def nbytes(self) -> int:
        """The bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def append(self, k: torch.Tensor, v: torch.Tensor | None, position: int):
        """Add new k/v at absolute `position`; return (all k, all v, their start) for this step."""
        if position != self.end:
            raise ValueError(
                f"position_offset={position} but the KV cache holds positions up to {self.end}: "
                f"pass position_offset={self.end} (the number of tokens already fed)"
            )
        if self.k is not None:
            k = torch.cat([self.k, k], dim=2)
            v = None if v is None else torch.cat([self.v, v], dim=2)
        start, total = self.start, k.shape[2]
        # The next query at position `end` needs only the window - 1 keys before it.
        keep = total if self.window is None else min(total, self.window - 1)
        self.k = k[:, :, total - keep:]
        self.v = None if v is None else v[:, :, total - keep:]
        self.start = start + total - keep
        return k, v, start


class CoreAttention(nn.Module):
    """softmax(q k^T * scale + mask) v: the part that keeps [S, S] activations, a module of its own so that
    selective activation checkpointing can recompute it alone (Megatron's and NxD's "selective").
    `scale`: None = 1/sqrt(head dim) (SDPA's own); MLA's YaRN correction sets another."""

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v, mask, is_causal: bool, enable_gqa: bool) -> torch.Tensor:
        if isinstance(mask, FlexDocumentMask):  # data.document_mask on CUDA: flex_attention's kernel
            return mask.attend(q, k, v, self.scale, enable_gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=enable_gqa, scale=self.scale)


class CausalSelfAttention(nn.Module):
    """What every attention kind shares once it has q, k, v [B, heads, S, D]: RoPE, the KV cache, the
    causal / sliding-window / padding / ALiBi mask, and the SDPA core. Subclasses set
    `position_encoding`, `sliding_window`, (GQA) `num_heads != num_kv_heads` and, for RoPE, call
    `init_rope(cfg, rotated dims)`."""

    position_encoding = "rope"
    sliding_window: int | None = None

    def init_rope(self, cfg: ModelConfig, dim: int) -> None:
        """RoPE over `dim` dims with cfg's rope_type; the frequencies are recomputed on each call's device
        (a few [dim/2] operations: nothing to move, cast or re-create after the meta device)."""
        self.rope_cfg, self.rope_dim = cfg, dim
        self.rope_scale = attention_factor(cfg)

    def rope(self, position_offset: int, length: int, device, dtype, documents: Documents | None = None):
        """cos/sin [S, rope_dim] for positions position_offset.. (the same rows the full sequence gets);
        with `documents`, [B, 1, S, rope_dim] for each token's position in its document.

        Without autograd (generation, evaluation) the layers of one forward share one computation: the last
        such call's tables are kept (`_SHARED_ROPE`, one entry) and reused by a call with the same config
        object, dims, positions, device and dtype, as transformers computes them once per forward."""
        if documents is not None or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self._rope(position_offset, length, device, dtype, documents)
        key = (id(self.rope_cfg), self.rope_dim, self.rope_scale, position_offset, length, device, dtype)
        kept = _SHARED_ROPE.get(key)
        if kept is not None and kept[0] is self.rope_cfg:  # (the entry holds the config: its id stays its)
            return kept[1]
        cos_sin = self._rope(position_offset, length, device, dtype, None)
        _SHARED_ROPE.clear()
        _SHARED_ROPE[key] = (self.rope_cfg, cos_sin)
        return cos_sin

    def _rope(self, position_offset: int, length: int, device, dtype, documents: Documents | None):
        inv_freq = inverse_frequencies(self.rope_cfg, self.rope_dim, device)
        if documents is not None:
            cos, sin = rope_cos_sin_at(documents.positions_BS, inv_freq, self.rope_scale, dtype)
            return cos[:, None], sin[:, None]  # [B, 1, S, D]: each token's own position
        return rope_cos_sin(position_offset, length, inv_freq, self.rope_scale, dtype)

    def attend(self, q, k, v, kv_cache: KVCache | None, position_offset: int,
               attention_mask_BS: torch.Tensor | None, enable_gqa: bool = False,
               documents: Documents | None = None) -> torch.Tensor:
        """softmax(q k^T * core.scale + mask) v over this call's and the cached keys -> [B, heads, S, Dv]."""
        if documents is not None:
            return self._attend_documents(q, k, v, kv_cache, position_offset, attention_mask_BS, enable_gqa,
                                          documents)
        S = q.shape[2]
        k_start = position_offset
        if kv_cache is not None:
            k, v, k_start = kv_cache.append(k, v, position_offset)
        mask, is_causal = self.visible(position_offset, S, k_start, k.shape[2], attention_mask_BS, q.dtype,
                                       q.device)
        if getattr(self, "sinks", None) is not None:  # [heads]: model.attention_sinks (GQA)
            k, v, mask = self._with_sinks(k, v, mask, position_offset, S, k_start, q.dtype)
            is_causal = False
        return self.core(q, k, v, mask, is_causal, enable_gqa)

    def visible(self, q_start: int, q_len: int, k_start: int, k_len: int,
                attention_mask_BS: torch.Tensor | None, dtype, device):
        """(attn_mask, is_causal) for SDPA: which keys each query sees (causal, this layer's window, ALiBi's
        bias) with left padding's pad keys hidden; (None, True/False) where SDPA's own fast path does."""
        shareable = not (torch.is_grad_enabled() or torch.compiler.is_compiling())  # as `rope`'s tables
        if attention_mask_BS is not None and self.position_encoding == "rope" and shareable:
            return self._shared_padding_mask(q_start, q_len, k_start, k_len, attention_mask_BS, dtype, device)
        mask, is_causal = self._mask(q_start, q_len, k_start, k_len, dtype, device)
        if attention_mask_BS is not None:
            mask = self._hide_padding(mask, attention_mask_BS, q_start, q_len, k_start, k_len)
            is_causal = False
        return mask, is_causal

    def _shared_padding_mask(self, q_start, q_len, k_start, k_len, attention_mask_BS, dtype, device):
        """RoPE layers' padded mask without autograd (generation's every step), built once per forward for all
        layers with the same window: it depends on the positions, the window and `attention_mask_BS` only
        (ALiBi's adds each layer's slopes). Kept while the same attention_mask_BS object comes back (a
        forward's layers); a new one (the next step's) starts over. Saves about ten small ops a layer."""
        if _SHARED_PADDING[0] is not attention_mask_BS:
            _SHARED_PADDING[:] = [attention_mask_BS, {}]
        key = (q_start, q_len, k_start, k_len, self.sliding_window, dtype, device)
        kept = _SHARED_PADDING[1].get(key)
        if kept is None:
            mask, _ = self._mask(q_start, q_len, k_start, k_len, dtype, device)
            kept = self._hide_padding(mask, attention_mask_BS, q_start, q_len, k_start, k_len)
            _SHARED_PADDING[1][key] = kept
        return kept, False

    def _attend_documents(self, q, k, v, kv_cache, position_offset, attention_mask_BS, enable_gqa,
                          documents: Documents) -> torch.Tensor:
        """Block-causal attention (moe.model.documents): a token sees its own document's earlier tokens,
        within this layer's window; training only (no cache, no padding mask)."""
        if kv_cache is not None or attention_mask_BS is not None or position_offset:
            raise ValueError("documents is for training forwards: no kv_cache, attention_mask_BS or "
                             "position_offset with it")
        slopes = self.alibi_slopes if self.position_encoding == "alibi" else None
        sinks = getattr(self, "sinks", None)
        if documents.use_flex and sinks is None:
            mask = FlexDocumentMask(documents, self.sliding_window, slopes)
            return self.core(q, k, v, mask, False, enable_gqa)
        allowed = documents.allowed(self.sliding_window)  # [B, 1, S, S]
        mask = allowed
        if slopes is not None:  # ALiBi's bias [h, S, S] over the document mask -> [B, h, S, S]
            S = q.shape[2]
            bias, _ = self._mask(0, S, 0, S, q.dtype, q.device)
            mask = bias.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            k, v, mask = self._with_sinks(k, v, mask, 0, q.shape[2], 0, q.dtype)
        return self.core(q, k, v, mask, False, enable_gqa)

    def _with_sinks(self, k, v, mask, q_start, q_len, k_start, dtype):
        """Attention sinks (gpt-oss) as one more key: its key and value are zero and the mask adds head h's
        sink logit to its score, so softmax(scores | sink) drops the sink's share of every row and adds
        nothing to the output. That is transformers' eager_attention_forward for gpt_oss
        (models/gpt_oss/modeling_gpt_oss.py:243-251: the sinks concatenated to the logits, the softmax
        taken, the sink's column dropped), in one SDPA call, with any cache and window."""
        if mask is None:
            mask = attention_mask(q_start, q_len, k_start, k.shape[2], self.sliding_window, k.device)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=k.device).masked_fill(~mask, float("-inf"))
        mask = mask.to(dtype)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        sinks = self.sinks  # under TP a DTensor split by head: this rank's heads are its local part
        sinks = sinks.to_local() if hasattr(sinks, "to_local") else sinks
        heads = sinks.shape[0]
        mask = mask.expand(mask.shape[0], heads, q_len, k.shape[2])
        sink = sinks.to(dtype).view(1, heads, 1, 1).expand(mask.shape[0], heads, q_len, 1)
        zero_k = k.new_zeros(*k.shape[:2], 1, k.shape[3])
        zero_v = v.new_zeros(*v.shape[:2], 1, v.shape[3])
        return torch.cat([k, zero_k], dim=2), torch.cat([v, zero_v], dim=2), torch.cat([mask, sink], dim=-1)

    def _mask(self, q_start, q_len, k_start, k_len, dtype, device):
        """(attn_mask, is_causal) for SDPA; the plain causal case uses SDPA's own fast path."""
        fresh = k_start == q_start and k_len == q_len  # no cached history
        window_matters = self.sliding_window is not None and self.sliding_window < q_start + q_len - k_start
        if self.position_encoding == "rope" and not window_matters:
            if fresh:
                return None, q_len > 1
            if q_len == 1:
                return None, False  # one new token sees every cached key
        allowed = attention_mask(q_start, q_len, k_start, k_len, self.sliding_window, device)
        if self.position_encoding == "rope":
            return allowed, False
        # ALiBi: bias = -slope * distance, -inf where not allowed.
        q_pos = torch.arange(q_start, q_start + q_len, device=device)[:, None]
        k_pos = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        bias = self.alibi_slopes[:, None, None] * (k_pos - q_pos).float()[None]
        return bias.masked_fill(~allowed, float("-inf")).to(dtype), False

    def _hide_padding(self, mask, attention_mask_BS, q_start, q_len, k_start, k_len):
        """Add left padding to `mask`: pad keys hidden; a pad query still sees itself (else NaN rows)."""
        device = attention_mask_BS.device
        if mask is None:
            mask = attention_mask(q_start, q_len, k_start, k_len, self.sliding_window, device)
        real_B11K = attention_mask_BS[:, k_start:k_start + k_len].bool()[:, None, None, :]
        q_pos = torch.arange(q_start, q_start + q_len, device=device)[:, None]
        k_pos = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        keep_B1QK = real_B11K | (k_pos == q_pos)
        if mask.dtype == torch.bool:
            return mask & keep_B1QK
        return mask.masked_fill(~keep_B1QK, float("-inf"))  # ALiBi bias [h, Q, K] -> [B, h, Q, K]


class Attention(CausalSelfAttention):
    """Causal GQA self-attention: one fused qkv_proj, SDPA, RoPE or ALiBi, optional sliding window (this
    layer's: model.attention_layer_types), biases (model.qkv_bias, o_bias) and sinks (attention_sinks).

    Activations are [B, S, H], or [S, B, H] with `sequence_first` (set by the trn1 backend under
    sequence parallelism: NxD's sequence-parallel layers gather and scatter dim 0 only).
    model.qkv_bias: qkv_proj has a bias (Qwen2-MoE's q/k/v biases,
    models/qwen2_moe/modeling_qwen2_moe.py:222-225 at transformers 5.24; o_proj none unless model.o_bias:
    gpt-oss, Qwen3-MoE's and OLMoE's attention_bias).
    model.qk_norm: `q_norm`/`k_norm` RMSNorms before RoPE, per_head over each head's dims with one weight
    for every head (Qwen3-MoE, modeling_qwen3_moe.py:147-148, 163-164) or full over the whole q and k
    projections before the head split (OLMoE, modeling_olmoe.py:222-225, 239-240).
    model.partial_rotary_factor: RoPE over the first dims of each head only (GLM-4.5; `apply_rope`).
    `tp_group` (set by moe.parallel.tensor_parallel.apply_tp): the ranks holding the other heads, over
    which a per-head norm weight's gradient is summed.
    """

    sequence_first = False
    tp_group = None

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = head_dim_of(cfg)
        self.position_encoding = cfg.position_encoding
        self.sliding_window = window_of(cfg, layer_idx)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        self.register_parameter("sinks", sinks)  # [heads], or None: attend() reads it either way
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "per_head"
            self.q_norm = RMSNorm(self.head_dim if per_head else q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else kv_size, cfg.rms_norm_eps)
        self.core = CoreAttention()
        self.init_rope(cfg, rotary_dim_of(cfg))  # head_dim, or model.partial_rotary_factor's share
        self.init_buffers()

    def init_buffers(self) -> None:
        """Computed buffers (ALiBi slopes), again after the model leaves the meta device."""
        if self.position_encoding == "alibi":
            device = self.qkv_proj.weight.device
            self.register_buffer("alibi_slopes", alibi_slopes(self.num_heads).to(device), persistent=False)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, position_offset: int = 0,
                attention_mask_BS: torch.Tensor | None = None, documents: Documents | None = None):
        qkv = self.qkv_proj(x)  # sequence-parallel layers gather the full sequence here
        parts = self.normed(*qkv.split(self.split_sizes, dim=-1))
        if self.sequence_first:
            S, B, _ = qkv.shape
            q, k, v = (t.view(S, B, -1, self.head_dim).permute(1, 2, 0, 3) for t in parts)
        else:
            B, S, _ = qkv.shape
            q, k, v = (t.view(B, S, -1, self.head_dim).transpose(1, 2) for t in parts)
        if self.position_encoding == "rope":
            cos, sin = self.rope(position_offset, S, x.device, q.dtype, documents)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v, kv_cache, position_offset, attention_mask_BS,
                        self.num_heads != self.num_kv_heads, documents)  # [B, heads, S, hd]
        if self.sequence_first:
            return self.o_proj(y.permute(2, 0, 1, 3).reshape(S, B, -1))
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))

    def normed(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k through model.qk_norm (unchanged when none); [..., width] in, [..., width] out."""
        if self.qk_norm == "none":
            return q, k, v
        if self.qk_norm == "full":  # over the whole projection: refused under TP (moe.backends.fsdp2.rules)
            return self.q_norm(q), self.k_norm(k), v
        q_w, k_w = self.q_norm.weight, self.k_norm.weight
        if self.tp_group is not None:  # one weight for all heads: this rank's give part of its gradient
            q_w, k_w = SumGradOver.apply(q_w, self.tp_group), SumGradOver.apply(k_w, self.tp_group)
        q = rms_norm(q.unflatten(-1, (-1, self.head_dim)), q_w, self.q_norm.eps).flatten(-2)
        k = rms_norm(k.unflatten(-1, (-1, self.head_dim)), k_w, self.k_norm.eps).flatten(-2)
        return q, k, v
