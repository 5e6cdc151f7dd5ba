"""The decoder: embeddings -> blocks (attention + MoE or dense SwiGLU) -> norm -> logits, and in training
the multi-token-prediction depths after it (model.mtp_layers, moe/model/mtp.py).

Reads top to bottom, nanoGPT style. The model never mentions ranks or hardware:
expert parallelism, activation checkpointing and compilation are applied afterwards by
`moe.parallel.apply`, and a backend may swap layers for parallel ones (moe/backends/neuron/).
Weight layout matches Hugging Face Mixtral up to two fusions (`qkv_proj` = [q | k | v] rows,
`gate_up_proj` = [gate | up] rows) so `moe.hf` converts by slicing, never by
re-deriving maths; with `model.attention=mla` the blocks hold DeepSeek-V3's multi-head latent
attention (moe/model/mla.py) and the layout is DeepSeek-V3's (moe.hf.deepseek_v3).
Attention lives in moe/model/attention.py and mla.py, RMSNorm in norm.py; their names are
re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from moe.config.derived import dense_width, is_moe_layer, window_of
from moe.config.rules.architecture import validate_model
from moe.config.schema import ModelConfig, MoEOptConfig
from moe.model.attention import (  # noqa: F401 (re-exported: moe.model.model's names before the split)
    Attention,
    CoreAttention,
    KVCache,
    alibi_slopes,
    apply_rope,
    attention_mask,
    forget_shared_padding,
    rope_cos_sin,
    rotate_half,
)
from moe.model.documents import Documents
from moe.model.fused_ce import linear_cross_entropy
from moe.model.init import draw_base_seed, init_stds, initialize
from moe.model.loss import router_loss_sum
from moe.model.mla import LatentKVCache, MLAttention
from moe.model.mlp import SwiGLU
from moe.model.moe import Experts, MoELayer, Router, RoutingStats
from moe.model.mtp import MTPDepth, mtp_loss
from moe.model.norm import RMSNorm
from moe.model.pytree import pytree_dataclass
from moe.model.routing import expert_activation


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is MoELayer or SwiGLU."""

    def __init__(self, cfg: ModelConfig, moe_opt: MoEOptConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = is_moe_layer(layer_idx, cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLAttention(cfg, layer_idx) if cfg.attention == "mla" else Attention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_moe:
            self.ffn = MoELayer(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k, moe_opt,
                                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                                init_range=None,  # the model initialises every parameter at once
                                router_bias=cfg.router_bias, expert_proj_bias=cfg.expert_proj_bias,
                                activation=None if cfg.expert_activation == "swiglu" else
                                expert_activation(cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit),
                                shared_expert_gate=cfg.shared_expert_gate)
        else:
            self.ffn = SwiGLU(cfg.hidden_size, dense_width(cfg))

    def forward(self, x_BSH, kv_cache: KVCache | None = None, position_offset: int = 0,
                attention_mask_BS: torch.Tensor | None = None, generating: bool = False,
                documents: Documents | None = None):
        attn = self.attn(self.attn_norm(x_BSH), kv_cache, position_offset, attention_mask_BS, documents)
        x_BSH = x_BSH + attn
        if self.is_moe:
            y_BSH, stats = self.ffn(self.ffn_norm(x_BSH), generating)
        else:
            y_BSH, stats = self.ffn(self.ffn_norm(x_BSH)), None
        return x_BSH + y_BSH, stats


# ----------------------------------------------------------------------------- the model


@pytree_dataclass  # FSDP2 hooks the root's backward on these tensors (moe.model.pytree)
@dataclass
class ModelOutput:
    logits_BSV: torch.Tensor | None  # None when forward was given labels: the loss is lm_loss
    routing: list[RoutingStats]  # one per MoE layer, in layer order (empty when generating or unread)
    router_loss: torch.Tensor | float  # what training adds to the LM loss (moe.model.loss.router_loss_sum)
    aux_loss: torch.Tensor  # mean over MoE layers, for logging (0 when none)
    z_loss: torch.Tensor
    kv_cache: list[KVCache] | None = None
    lm_loss: torch.Tensor | None = None  # forward(labels_BS=...): mean CE, from moe.model.fused_ce
    # forward(labels_BS=...) with model.mtp_layers: the mean over depths of each one's mean CE (moe.model.mtp)
    mtp_loss: torch.Tensor | None = None
    mtp_loss_weight: float = 0.0  # model.mtp_loss_weight

    @property
    def loss(self) -> torch.Tensor:
        """The training objective (forward with labels): the LM loss plus every MoE layer's router terms, plus
        model.mtp_loss_weight times the multi-token-prediction loss where the model has depths."""
        loss = self.lm_loss + self.router_loss
        return loss if self.mtp_loss is None else loss + self.mtp_loss_weight * self.mtp_loss


@runtime_checkable
class SequenceShard(Protocol):
    """Sequence parallelism's two ends, installed by moe.parallel (moe.parallel.token_shard.SequenceShard)."""

    def split(self, x_BSH: torch.Tensor) -> torch.Tensor: ...

    def gather(self, x_BsH: torch.Tensor) -> torch.Tensor: ...

    def lm_loss(self, hidden_BsH: torch.Tensor, weight_VH: torch.Tensor,
                labels_BS: torch.Tensor) -> torch.Tensor: ...


def _empty_like(t: torch.Tensor, device) -> torch.Tensor:
    """torch.empty_like(t, device=device), as Module.to_empty makes storage. A plain tensor goes straight
    to the factory: empty_like from the meta device runs torch._refs, whose first call imports sympy (a third
    of a second of every load); a tensor subclass (DTensor) keeps its own empty_like."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    return torch.empty_like(t, device=device)


class MoETransformer(nn.Module):
    """Decoder-only LM; layer i is MoE when i >= first_k_dense_replace, (i + 1) % moe_layer_frequency == 0
    and i is not in dense_layers (moe.config.derived.is_moe_layer).

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
        self.model_config, self.moe_opt = model_cfg, moe_opt
        # its values are initialize's below: handing Embedding its (empty) weight skips its own normal_ init,
        # which on the meta device (every import and load) costs a second of start-up importing torch._dynamo
        # (torch._refs.normal_); Linear's and the norms' inits take no such path
        shape = (model_cfg.vocab_size, model_cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape), _freeze=False)
        block_cls = block_cls or Block
        self.layers = nn.ModuleList([block_cls(model_cfg, moe_opt, i) for i in range(model_cfg.num_layers)])
        self.norm = RMSNorm(model_cfg.hidden_size, model_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(model_cfg.hidden_size, model_cfg.vocab_size, bias=False)
        if model_cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # multi-token prediction (moe.model.mtp): depth d's block is layer num_layers + d
        self.mtp = nn.ModuleList([
            MTPDepth(block_cls(model_cfg, moe_opt, model_cfg.num_layers + d), model_cfg.hidden_size,
                     model_cfg.rms_norm_eps) for d in range(model_cfg.mtp_layers)])
        self.init_seed = draw_base_seed() if init_seed is None else init_seed
        self.init_std = init_stds(model_cfg)
        initialize(self, self.init_seed, *self.init_std)
        # sequence parallelism (moe.parallel.apply.apply_token_shard): the blocks see this rank's chunk
        # of every sequence; split after the embeddings, gathered (or the loss taken per chunk) at the end
        self.sequence_shard: SequenceShard | None = None

    @torch.no_grad()
    def materialize(self, device="cpu", source=None) -> None:
        """Give a model built on the meta device (and perhaps sharded since) real storage on `device`,
        only for what this process holds, and fill it: from `source(name, shape, first_expert)` (e.g.
        moe.hf.tensor_source) or moe.model.init's values for `init_seed`, which equal
        what one process building the whole model would give these parameters. Call it before
        wrapping (activation checkpointing, compile): the values are keyed by parameter name.
        """
        self.to_storage(device)
        if source is None:
            initialize(self, self.init_seed, *self.init_std)
            return
        for name, p in self.named_parameters():
            first = p.first_expert if getattr(p, "is_expert", False) else None
            p.copy_(source(name, tuple(p.shape), first))
        load_expert_bias(self, source)

    def to_storage(self, device) -> None:
        """`to_empty(device)` (storage for what this process holds, values unset), then what it loses:
        new Parameters get the LM head tie and the expert marks again, computed buffers are recomputed."""
        self._apply(lambda t: _empty_like(t, device))  # Module.to_empty, without its sympy import
        self._rebind(Attention | Router)

    def load_assigned(self, state: dict[str, torch.Tensor]) -> None:
        """load_state_dict(strict, assign) into a model built on the meta device: its parameters become
        `state`'s tensors themselves (a checkpoint mapped in by torch.load(mmap=True) is not copied), then
        get what assignment loses, as to_storage gives it (the loaded expert bias is kept)."""
        self.load_state_dict(state, strict=True, assign=True)
        self._rebind(Attention)

    def _rebind(self, computed) -> None:
        """The LM head tie and the expert marks on new Parameters; init_buffers of the `computed` modules."""
        if self.model_config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, Experts):
                module.mark_expert(module.first_expert)
            elif isinstance(module, computed):
                module.init_buffers()

    def new_kv_cache(self, latent: bool = True) -> list[KVCache]:
        """An empty per-layer cache to pass as `kv_cache` for generation. With model.attention=mla it holds
        each token's latent and RoPE key (moe.model.mla.LatentKVCache) and decode steps attend through
        them; `latent=False`: the expanded per-head keys and values instead (the reference it equals)."""
        kind = LatentKVCache if latent and self.model_config.attention == "mla" else KVCache
        return [kind(window_of(self.model_config, i)) for i in range(len(self.layers))]

    def forward(self, input_ids_BS: torch.Tensor, kv_cache: list[KVCache] | None = None,
                position_offset: int = 0, attention_mask_BS: torch.Tensor | None = None,
                generating: bool = False, labels_BS: torch.Tensor | None = None,
                documents: Documents | None = None, last_only: bool = False) -> ModelOutput:
        """attention_mask_BS: optional [B, position_offset + S], 1 = real token, 0 = left padding, over
        every position fed so far (cached ones included). Pads take positions like tokens; RoPE, ALiBi
        and the window see only distances, so a row's shift by its pad count changes nothing. Pads are
        routed like tokens (dropless routing keeps them from touching real tokens; they do count in
        routing stats and capacity), so pass a mask for generation, not training.
        generating: per-token (dropless) routing, and no routing statistics or losses.
        labels_BS (-100 = no loss): the LM head and cross-entropy run together in token chunks
        (moe.model.fused_ce) and return `lm_loss`, never the [tokens, vocab] logits (None then); with
        model.mtp_layers the depths run after the main blocks and return `mtp_loss` (moe.model.mtp), their
        MoE layers' routing after the main model's. Without labels they do not run.
        documents: the packed documents of each row (moe.model.documents, data.document_mask), over the
        whole sequence: block-causal attention and positions that restart at each document (training only).
        last_only: logits for each row's last position only ([B, 1, V]), all a generation step picks from
        (transformers' generate asks the same, logits_to_keep=1: generation/utils.py:2952-2956 at 5.24).
        """
        want = (input_ids_BS.shape[0], position_offset + input_ids_BS.shape[1])
        if attention_mask_BS is not None and tuple(attention_mask_BS.shape) != want:
            raise ValueError(f"attention_mask_BS has shape {tuple(attention_mask_BS.shape)}; it must cover "
                             f"every position fed so far: {want}")
        x_BSH = self.embed_tokens(input_ids_BS)
        sequence = self.sequence_shard
        if sequence is not None:
            x_BSH = sequence.split(x_BSH)  # this rank's chunk of every sequence from here on
        routing: list[RoutingStats] = []
        for i, block in enumerate(self.layers):
            cache = None if kv_cache is None else kv_cache[i]
            x_BSH, stats = block(x_BSH, cache, position_offset, attention_mask_BS, generating, documents)
            if stats is not None:
                routing.append(stats)
        if attention_mask_BS is not None:
            forget_shared_padding()
        hidden_BSH = self.norm(x_BSH)
        logits_BSV = lm = None
        if labels_BS is None:
            whole_BSH = hidden_BSH if sequence is None else sequence.gather(hidden_BSH)
            logits_BSV = self.lm_head(whole_BSH[:, -1:] if last_only else whole_BSH)
        elif sequence is not None:
            lm = sequence.lm_loss(hidden_BSH, self.lm_head.weight, labels_BS)
        else:
            lm = linear_cross_entropy(hidden_BSH.flatten(0, 1), self.lm_head.weight, labels_BS.flatten())
        mtp = None
        if labels_BS is not None and len(self.mtp):  # sequence parallelism is refused with depths
            mtp, mtp_routing = mtp_loss(self.mtp, self.embed_tokens, self.lm_head.weight, input_ids_BS,
                                        hidden_BSH, labels_BS, documents)
            routing += mtp_routing
        zero = torch.zeros((), device=hidden_BSH.device)
        aux_loss = torch.stack([s.aux_loss for s in routing]).mean() if routing else zero
        z_loss = torch.stack([s.z_loss for s in routing]).mean() if routing else zero
        router_loss = router_loss_sum(routing, self.moe_opt)
        return ModelOutput(logits_BSV, routing, router_loss, aux_loss, z_loss, kv_cache, lm, mtp,
                           self.model_config.mtp_loss_weight)


@torch.no_grad()
def load_expert_bias(model: nn.Module, source) -> None:
    """The routers' expert bias (a buffer) from `source` where it has one (a DeepSeek-V3 checkpoint's
    e_score_correction_bias); a source without it (Mixtral) leaves the bias at zero."""
    for name, bias in model.named_buffers():
        if name.endswith("router.expert_bias"):
            try:
                bias.copy_(source(name, tuple(bias.shape), None))
            except KeyError:
                return


def state_shapes(model_cfg: ModelConfig, moe_opt: MoEOptConfig) -> dict[str, tuple]:
    """The shape of every tensor of such a model's state_dict, from a build on the meta device (no storage):
    what a checkpoint or a directory of weights must hold for it."""
    with torch.device("meta"):
        model = MoETransformer(model_cfg, moe_opt)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
