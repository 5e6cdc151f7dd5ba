"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2): D depths after the main model, depth k
predicting token i + k + 1 at position i, trained with lambda / D times the sum of their cross-entropies.

Depth k (k = 1..D, model.mtp_layers = D), at every position i:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])   the embedding first: the order the released
                                                              weights' eh_proj expects
    h^k_i = norm(Block(h'_i))                                 its own final norm (DeepSeek's shared_head.norm)
    CE_k  = cross-entropy of lm_head(h^k_i) against t_{i+k+1}

with the main model's embedding and LM head (shared, as the paper's), h^0 the main model's output after its
final norm (what its LM head reads), and L_MTP = lambda / D * sum_k CE_k, each CE_k a mean over the tokens
that carry a label. This is Megatron-Core's computation (megatron/core/transformer/multi_token_prediction.py
at 13f8f52): `_concat_embeddings` (cat((enorm(embedding), hnorm(hidden)), -1), then eh_proj), `_postprocess`
(the depth's final_layernorm, whose output the shared head and the next depth read; the decoder hands the
first depth its output after the decoder's own final layernorm, which the output layer reads unchanged in
`process_mtp_loss`), `process_mtp_loss` (labels and loss mask rolled left once per depth, each depth's loss
over its own token count, scaled by mtp_loss_scaling_factor / mtp_num_layers). vLLM reads the released
weights the same way (vllm/model_executor/models/deepseek_mtp.py, DeepSeekMultiTokenPredictorLayer:
torch.cat([inputs_embeds, previous_hidden_states], -1), the target model's normed output as the first
previous hidden states).

The sequence keeps its length: token ids and labels are shifted left by k, the last k positions filled (ids
with 0, labels with -100, so they carry no loss), as Megatron's roll_tensor fills the rolled-in end. Attention
is causal, so what fills the end never reaches an earlier position. Depth d's block is layer num_layers + d
(0-based d: DeepSeek-V3's layer 61), MoE or dense by moe.config.derived.is_moe_layer; its MoE layer routes as
any other (its router terms join the loss, its statistics the step's).
"""
from __future__ import annotations

import torch
from torch import nn

from moe.model.fused_ce import linear_cross_entropy
from moe.model.loss import IGNORE_INDEX
from moe.model.norm import RMSNorm


class MTPDepth(nn.Module):
    """One depth: enorm and hnorm, eh_proj (2H -> H, no bias), a decoder block, its final norm. Parameter
    names are DeepSeek's (moe.hf.mtp maps them to model.layers.{num_layers + d}.*)."""

    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, hidden_BSH: torch.Tensor, embedded_BSH: torch.Tensor, documents=None):
        """(h^k, the block's RoutingStats or None) from h^{k-1} and the embeddings of the tokens k ahead;
        `documents` (moe.model.documents): the main model's block-causal layout, position i's as its."""
        x_BSH = self.eh_proj(torch.cat([self.enorm(embedded_BSH), self.hnorm(hidden_BSH)], dim=-1))
        x_BSH, stats = self.block(x_BSH, documents=documents)
        return self.norm(x_BSH), stats


def shift_left(x_BS: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x shifted left by k along the sequence, its last k positions `fill` (roll_tensor k times)."""
    k = min(k, x_BS.shape[1])
    return torch.cat([x_BS[:, k:], x_BS.new_full((x_BS.shape[0], k), fill)], dim=1)


def mtp_loss(depths: nn.ModuleList, embed: nn.Module, head_weight_VH: torch.Tensor,
             input_ids_BS: torch.Tensor, hidden_BSH: torch.Tensor,
             labels_BS: torch.Tensor, documents=None) -> tuple[torch.Tensor, list]:
    """(the mean over depths of each depth's mean cross-entropy, the RoutingStats of the depths' MoE layers).

    hidden_BSH: the main model's output after its final norm; labels_BS: the main model's (token i + 1 at
    i, -100 = no loss). The LM head and cross-entropy run in token chunks (moe.model.fused_ce) as the main
    loss does. With packed `documents` (data.document_mask) the depths attend as the main model does, and
    position i carries no loss at depth k when token i + k lies in another document."""
    losses, routing = [], []
    for k, depth in enumerate(depths, start=1):
        hidden_BSH, stats = depth(hidden_BSH, embed(shift_left(input_ids_BS, k, 0)), documents)
        if stats is not None:
            routing.append(stats)
        labels_BS_k = shift_left(labels_BS, k, IGNORE_INDEX)
        if documents is not None:
            same_document = shift_left(documents.ids_BS, k, -1) == documents.ids_BS
            labels_BS_k = labels_BS_k.masked_fill(~same_document, IGNORE_INDEX)
        labels_N = labels_BS_k.flatten()
        losses.append(linear_cross_entropy(hidden_BSH.flatten(0, 1), head_weight_VH, labels_N))
    return torch.stack(losses).mean(), routing
