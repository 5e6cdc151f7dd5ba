"""The decoder: embeddings -> blocks (attention + MoE or dense SwiGLU) -> norm -> logits.

Reads top to bottom, nanoGPT style. The model never mentions ranks or hardware:
expert parallelism, activation checkpointing and compilation are applied afterwards by
`moe.parallel.apply`, and a backend may swap layers for parallel ones (moe/backends/neuron/).
Weight layout matches Hugging Face Mixtral up to two fusions (`qkv_proj` = [q | k | v] rows,
`gate_up_proj` = [gate | up] rows) so `moe.model.hf` converts by slicing, never by
re-deriving maths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.config.validate import validate_model
from moe.model.fused_ce import linear_cross_entropy
from moe.model.init import draw_base_seed, init_stds, initialize
from moe.model.loss import router_loss_sum
from moe.model.moe import Experts, MoELayer, Router, RoutingStats
from moe.model.size import is_moe_layer


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Mixtral does)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# ----------------------------------------------------------------------------- positions


def rope_cos_sin(start: int, length: int, head_dim: int, theta: float, device, dtype):
    """cos/sin [S, D] for positions start..start+S-1; inv_freq = 1/theta^(arange(0,D,2)/D), as HF."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    pos = torch.arange(start, start + length, dtype=torch.float, device=device)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BhSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    return x_BhSD * cos_SD + rotate_half(x_BhSD) * sin_SD


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


class KVCache:
    """One layer's keys/values for generation: kv heads only (GQA), trimmed to the sliding window.

    `k`, `v` are [B, kv_heads, S, D]; `start` is the absolute position of `k[:, :, 0]`.
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

    def append(self, k: torch.Tensor, v: torch.Tensor, position: int):
        """Add new k/v at absolute `position`; return (all k, all v, their start) for this step."""
        if position != self.end:
            raise ValueError(
                f"position_offset={position} but the KV cache holds positions up to {self.end}: "
                f"pass position_offset={self.end} (the number of tokens already fed)"
            )
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        start, total = self.start, k.shape[2]
        # The next query at position `end` needs only the window - 1 keys before it.
        keep = total if self.window is None else min(total, self.window - 1)
        self.k, self.v = k[:, :, total - keep:], v[:, :, total - keep:]
        self.start = start + total - keep
        return k, v, start


class CoreAttention(nn.Module):
    """softmax(q k^T + mask) v: the part that keeps [S, S] activations, a module of its own so that
    selective activation checkpointing can recompute it alone (Megatron's and NxD's "selective")."""

    def forward(self, q, k, v, mask, is_causal: bool, enable_gqa: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=enable_gqa)


class Attention(nn.Module):
    """Causal GQA self-attention: one fused qkv_proj, SDPA, RoPE or ALiBi, optional sliding window.

    Activations are [B, S, H], or [S, B, H] with `sequence_first` (set by the trn1 backend under
    sequence parallelism: NxD's sequence-parallel layers gather and scatter dim 0 only).
    """

    sequence_first = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
        self.position_encoding, self.rope_theta = cfg.position_encoding, cfg.rope_theta
        self.sliding_window = cfg.sliding_window
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.core = CoreAttention()
        self.init_buffers()

    def init_buffers(self) -> None:
        """Computed buffers (ALiBi slopes), again after the model leaves the meta device."""
        if self.position_encoding == "alibi":
            device = self.qkv_proj.weight.device
            self.register_buffer("alibi_slopes", alibi_slopes(self.num_heads).to(device), persistent=False)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, position_offset: int = 0,
                attention_mask_BS: torch.Tensor | None = None):
        qkv = self.qkv_proj(x)  # sequence-parallel layers gather the full sequence here
        parts = qkv.split(self.split_sizes, dim=-1)
        if self.sequence_first:
            S, B, _ = qkv.shape
            q, k, v = (t.view(S, B, -1, self.head_dim).permute(1, 2, 0, 3) for t in parts)
        else:
            B, S, _ = qkv.shape
            q, k, v = (t.view(B, S, -1, self.head_dim).transpose(1, 2) for t in parts)
        if self.position_encoding == "rope":
            cos, sin = rope_cos_sin(position_offset, S, self.head_dim, self.rope_theta, x.device, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_start = position_offset
        if kv_cache is not None:
            k, v, k_start = kv_cache.append(k, v, position_offset)

        mask, is_causal = self._mask(position_offset, S, k_start, k.shape[2], q.dtype, x.device)
        if attention_mask_BS is not None:
            mask = self._hide_padding(mask, attention_mask_BS, position_offset, S, k_start, k.shape[2])
            is_causal = False
        y = self.core(q, k, v, mask, is_causal, self.num_heads != self.num_kv_heads)  # [B, heads, S, hd]
        if self.sequence_first:
            return self.o_proj(y.permute(2, 0, 1, 3).reshape(S, B, -1))
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))

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


# ----------------------------------------------------------------------------- feed-forward


class SwiGLU(nn.Module):
    """Dense FFN: down(silu(gate(x)) * up(x)); gate and up fused in one gate_up_proj ([gate | up] rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is MoELayer or SwiGLU."""

    def __init__(self, cfg: ModelConfig, moe_opt: MoEOptConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = is_moe_layer(layer_idx, cfg.moe_layer_frequency)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_moe:
            self.ffn = MoELayer(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k, moe_opt,
                                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                                init_range=None)  # the model initialises every parameter at once
        else:
            self.ffn = SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size or cfg.intermediate_size)

    def forward(self, x_BSH, kv_cache: KVCache | None = None, position_offset: int = 0,
                attention_mask_BS: torch.Tensor | None = None, generating: bool = False):
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH), kv_cache, position_offset, attention_mask_BS)
        if self.is_moe:
            y_BSH, stats = self.ffn(self.ffn_norm(x_BSH), generating)
        else:
            y_BSH, stats = self.ffn(self.ffn_norm(x_BSH)), None
        return x_BSH + y_BSH, stats


# ----------------------------------------------------------------------------- the model


@dataclass
class ModelOutput:
    logits_BSV: torch.Tensor | None  # None when forward was given labels: the loss is lm_loss
    routing: list[RoutingStats]  # one per MoE layer, in layer order (empty when generating)
    router_loss: torch.Tensor | float  # what training adds to the LM loss (moe.model.loss.router_loss_sum)
    aux_loss: torch.Tensor  # mean over MoE layers, for logging (0 when none)
    z_loss: torch.Tensor
    kv_cache: list[KVCache] | None = None
    lm_loss: torch.Tensor | None = None  # forward(labels_BS=...): mean CE, from moe.model.fused_ce


class MoETransformer(nn.Module):
    """Decoder-only LM; layer i is MoE when (i + 1) % moe_layer_frequency == 0.

    Frequency 1: every layer MoE (Mixtral). Frequency 2: layers 1, 3, 5, ... (0-based) are MoE
    and the first layer is dense, i.e. every second layer as the 16-GPU MoE recipe.
    Init (moe.model.init): normal(0, init_range) for linear and embedding weights; output
    projections (o_proj, down_proj, expert down) use init_range / sqrt(2 * num_layers); norms are
    1. Each parameter (each expert) draws from its own generator seeded from `init_seed` and its
    name, so a model built on the meta device and materialised shard by shard gets the same values.
    """

    def __init__(self, model_cfg: ModelConfig, moe_opt: MoEOptConfig, init_seed: int | None = None,
                 block_cls: type[Block] | None = None):
        """init_seed: the base seed of every parameter's values (None: drawn from torch's generator);
        block_cls: a Block subclass a backend's training forward needs (moe/backends/neuron)."""
        super().__init__()
        validate_model(model_cfg, moe_opt)
        self.cfg, self.moe_opt = model_cfg, moe_opt
        self.embed_tokens = nn.Embedding(model_cfg.vocab_size, model_cfg.hidden_size)
        block_cls = block_cls or Block
        self.layers = nn.ModuleList([block_cls(model_cfg, moe_opt, i) for i in range(model_cfg.num_layers)])
        self.norm = RMSNorm(model_cfg.hidden_size, model_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(model_cfg.hidden_size, model_cfg.vocab_size, bias=False)
        if model_cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_seed = draw_base_seed() if init_seed is None else init_seed
        self.init_std = init_stds(model_cfg)
        initialize(self, self.init_seed, *self.init_std)

    @torch.no_grad()
    def materialize(self, device="cpu", source=None) -> None:
        """Give a model built on the meta device (and perhaps sharded since) real storage on `device`,
        only for what this process holds, and fill it: from `source(name, shape, first_expert)` (e.g.
        moe.model.hf_tensors.hf_tensor_source) or moe.model.init's values for `init_seed`, which equal
        what one process building the whole model would give these parameters. Call it before
        wrapping (activation checkpointing, compile): the values are keyed by parameter name.
        """
        self.to_empty(device=device)  # new Parameters: ties and expert marks are set again below
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, Experts):
                module.mark_expert(module.first_expert)
            elif isinstance(module, Attention | Router):
                module.init_buffers()
        if source is None:
            initialize(self, self.init_seed, *self.init_std)
            return
        for name, p in self.named_parameters():
            first = p.first_expert if getattr(p, "is_expert", False) else None
            p.copy_(source(name, tuple(p.shape), first))

    def new_kv_cache(self) -> list[KVCache]:
        """An empty per-layer cache to pass as `kv_cache` for generation."""
        return [KVCache(self.cfg.sliding_window) for _ in self.layers]

    def forward(self, input_ids_BS: torch.Tensor, kv_cache: list[KVCache] | None = None,
                position_offset: int = 0, attention_mask_BS: torch.Tensor | None = None,
                generating: bool = False, labels_BS: torch.Tensor | None = None) -> ModelOutput:
        """attention_mask_BS: optional [B, position_offset + S], 1 = real token, 0 = left padding, over
        every position fed so far (cached ones included). Pads take positions like tokens; RoPE, ALiBi
        and the window see only distances, so a row's shift by its pad count changes nothing. Pads are
        routed like tokens (dropless routing keeps them from touching real tokens; they do count in
        routing stats and capacity), so pass a mask for generation, not training.
        generating: per-token (dropless) routing, and no routing statistics or losses.
        labels_BS (-100 = no loss): the LM head and cross-entropy run together in token chunks
        (moe.model.fused_ce) and return `lm_loss`, never the [tokens, vocab] logits (None then).
        """
        want = (input_ids_BS.shape[0], position_offset + input_ids_BS.shape[1])
        if attention_mask_BS is not None and tuple(attention_mask_BS.shape) != want:
            raise ValueError(f"attention_mask_BS has shape {tuple(attention_mask_BS.shape)}; it must cover "
                             f"every position fed so far: {want}")
        x_BSH = self.embed_tokens(input_ids_BS)
        routing: list[RoutingStats] = []
        for i, block in enumerate(self.layers):
            cache = None if kv_cache is None else kv_cache[i]
            x_BSH, stats = block(x_BSH, cache, position_offset, attention_mask_BS, generating)
            if stats is not None:
                routing.append(stats)
        hidden_BSH = self.norm(x_BSH)
        logits_BSV = lm = None
        if labels_BS is None:
            logits_BSV = self.lm_head(hidden_BSH)
        else:
            lm = linear_cross_entropy(hidden_BSH.flatten(0, 1), self.lm_head.weight, labels_BS.flatten())
        zero = torch.zeros((), device=hidden_BSH.device)
        aux_loss = torch.stack([s.aux_loss for s in routing]).mean() if routing else zero
        z_loss = torch.stack([s.z_loss for s in routing]).mean() if routing else zero
        router_loss = router_loss_sum(routing, self.moe_opt)
        return ModelOutput(logits_BSV, routing, router_loss, aux_loss, z_loss, kv_cache, lm)
