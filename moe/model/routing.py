"""Routing maths for the MoE layer: pure functions on shape-suffixed tensors.

Shapes: T tokens, E experts, K experts per token (top_k), N = T*K assignments,
M = kept assignments. `idx_TK[t, j]` is the j-th expert chosen by token t and
`weights_TK[t, j]` the weight its output gets in the combine.

Conventions (see docs/ARCHITECTURE.md):
- softmax (or a per-expert sigmoid) in fp32 (or `router_dtype`), then top-k; k >= 2 renormalises
  the k weights, k = 1 keeps the raw score so the router gets gradient through the LM loss.
- load balance `E * sum_i f_i * P_i`, f_i = assignments to i / (K*T) counted over all
  top-k picks before drops, P_i = mean router probability of i. A perfectly balanced
  router gives 1.0 for any K. Hugging Face's `load_balancing_loss_func` on one layer
  gives K times this value (it divides by T, not K*T).
- z-loss `mean(logsumexp(logits)^2)` (ST-MoE).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe.config.choices import ROUTER_DTYPES
from moe.config.schema import normalizes
from moe.model.pytree import pytree_dataclass

# Sums a statistics tensor over a process group (identity in one process).
GroupSum = Callable[[torch.Tensor], torch.Tensor]


@pytree_dataclass  # a block's output carries it: FSDP2 hooks its losses (moe.model.pytree)
@dataclass
class RoutingStats:
    """One MoE layer, one forward. The losses carry grad (where their coefficient is not 0); the rest
    are detached."""

    aux_loss: torch.Tensor  # load-balance loss, 1.0 when balanced
    z_loss: torch.Tensor  # mean(logsumexp(logits)^2)
    tokens_per_expert_E: torch.Tensor  # long, assignments before drops, global over EP
    # the monitoring numbers: None in a forward that computes none (routing_stats' `monitor`)
    dropped_fraction: torch.Tensor | None  # dropped assignments / all assignments
    max_load: torch.Tensor | None  # largest per-expert count after drops
    mean_load: torch.Tensor | None  # mean per-expert count after drops
    entropy: torch.Tensor | None  # mean router entropy, nats


def router_dtype(name: str) -> torch.dtype:
    """Map `moe_opt.router_dtype` (validated) to a torch dtype."""
    return getattr(torch, ROUTER_DTYPES[name])


def router_probs(logits_TE: torch.Tensor, dtype: torch.dtype = torch.float32,
                 score_function: str = "softmax") -> torch.Tensor:
    """The router's scores in `dtype` (fp32: bf16 mis-ranks close experts): a softmax over the experts,
    or a sigmoid per expert (DeepSeek-V3; the scores of a token do not sum to 1)."""
    logits_TE = logits_TE.to(dtype)
    return torch.sigmoid(logits_TE) if score_function == "sigmoid" else torch.softmax(logits_TE, dim=-1)


def balance_probs(scores_TE: torch.Tensor, score_function: str = "softmax") -> torch.Tensor:
    """The distribution the load-balance loss and the entropy read: sigmoid scores normalised over the
    experts (Megatron-Core's `scores_for_aux_loss`, moe/router.py), softmax probabilities as they are."""
    if score_function != "sigmoid":
        return scores_TE
    return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)


def limit_to_groups(scores_TE: torch.Tensor, top_k: int, num_groups: int, group_top_k: int,
                    scored_by: int | None = None) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3's node-limited routing), as Megatron-Core's
    `group_limited_topk` (moe/moe_utils.py): a group's score is the sum of its best `scored_by` scores
    (None: top_k/group_top_k, Megatron-Core's); the experts outside the best group_top_k groups get -inf,
    so top-k never picks them."""
    T, E = scores_TE.shape
    grouped_TGe = scores_TE.view(T, num_groups, E // num_groups)
    group_scores_TG = grouped_TGe.topk(scored_by or top_k // group_top_k, dim=-1).values.sum(dim=-1)
    chosen_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(
        1, group_scores_TG.topk(group_top_k, dim=-1).indices, True)
    return scores_TE.masked_fill(~chosen_TG.repeat_interleave(E // num_groups, dim=1), float("-inf"))


def top_k_routing(
    probs_TE: torch.Tensor, top_k: int, normalize: bool | None = None, bias_E: torch.Tensor | None = None,
    num_groups: int | None = None, group_top_k: int | None = None, scaling_factor: float | None = None,
    group_scored_by: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the top_k experts per token -> (weights_TK, idx_TK), weights as `normalizes` says.

    bias_E (aux-loss-free balancing, DeepSeek-V3): added to the scores to choose the experts only;
    the weights are the chosen experts' unbiased scores. num_groups/group_top_k: the choice is
    limited to the best groups (`limit_to_groups`, on the biased scores; each scored by its best
    group_scored_by, None: top_k/group_top_k). scaling_factor multiplies
    the final weights (Megatron-Core's moe_router_topk_scaling_factor).
    """
    if bias_E is None and num_groups is None:
        weights_TK, idx_TK = torch.topk(probs_TE, top_k, dim=-1)
    else:
        choice_TE = probs_TE.detach() if bias_E is None else probs_TE.detach() + bias_E
        if num_groups is not None:
            choice_TE = limit_to_groups(choice_TE, top_k, num_groups, group_top_k, group_scored_by)
        idx_TK = torch.topk(choice_TE, top_k, dim=-1).indices
        weights_TK = probs_TE.gather(-1, idx_TK)
    if normalizes(normalize, top_k):
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    if scaling_factor is not None:
        weights_TK = weights_TK * scaling_factor
    return weights_TK, idx_TK


def expert_capacity(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None, min_capacity: int = 0
) -> int | None:
    """Slots per expert: min(T, max(min_capacity, ceil(K*T*cf/E))); None (dropless) when cf is None."""
    if capacity_factor is None:
        return None
    capacity = math.ceil(top_k * num_tokens * capacity_factor / num_experts)
    return min(num_tokens, max(min_capacity, capacity))


def expert_counts(expert_N: torch.Tensor, num_bins: int) -> torch.Tensor:
    """How many entries of `expert_N` hold each value 0..num_bins-1, as a long tensor [num_bins].

    A scatter-add, not `torch.bincount`: bincount sizes its output from the data, which on CUDA
    reads the maximum back to the host (a sync) and under fake tensors has no shape.
    """
    ones = torch.ones_like(expert_N, dtype=torch.long)
    return torch.zeros(num_bins, dtype=torch.long, device=expert_N.device).scatter_add_(0, expert_N, ones)


def dispatch_order(
    expert_N: torch.Tensor, num_experts: int, keep_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments sorted by expert (stable, so token order within an expert).

    Returns (order_N, counts_E): order_N indexes the flat [N] assignments, counts_E is how many kept
    assignments each expert got (the contiguous slice sizes). Dropped assignments (keep_N False) sort after
    every kept one, past sum(counts_E), where the experts' grouped GEMM ignores them (elements beyond its
    last offset, torch.nn.functional.grouped_mm): the kept count is never read back to the host.
    """
    if keep_N is not None:  # dropped: the sentinel expert E, last in the order and in no expert's slice
        expert_N = torch.where(keep_N, expert_N, num_experts)
    counts_E = expert_counts(expert_N, num_experts + (keep_N is not None))[:num_experts]
    return torch.argsort(expert_N, stable=True), counts_E


def apply_capacity(
    idx_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    drop_policy: str = "probs",
) -> torch.Tensor:
    """Keep mask over the [T, K] assignments: at most `capacity` per expert.

    drop_policy "position": each expert keeps its earliest tokens (latest dropped first).
    drop_policy "probs": each expert keeps its highest-weight assignments (the combine
    weight, i.e. what the token would lose; ties go to the earlier token), as Megatron.
    """
    if capacity is None:
        return torch.ones_like(idx_TK, dtype=torch.bool)
    expert_N = idx_TK.reshape(-1)
    if drop_policy == "position":
        order_N = torch.argsort(expert_N, stable=True)
    else:
        by_weight_N = torch.argsort(weights_TK.reshape(-1).detach(), descending=True, stable=True)
        order_N = by_weight_N[torch.argsort(expert_N[by_weight_N], stable=True)]
    counts_E = expert_counts(expert_N, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert_N = torch.arange(expert_N.numel(), device=expert_N.device) - starts_E[expert_N[order_N]]
    keep_N = torch.empty_like(expert_N, dtype=torch.bool)
    keep_N[order_N] = rank_in_expert_N < capacity
    return keep_N.view_as(idx_TK)


def load_balance_loss(
    probs_TE: torch.Tensor, idx_TK: torch.Tensor, counts_E: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch/GShard loss E * sum_i f_i * P_i; 1.0 for a perfectly balanced router.

    f_i counts every top-k pick before drops (no gradient); P_i = mean prob (gradient).
    `counts_E` overrides the local pick counts (global counts under expert parallelism).
    """
    num_experts = probs_TE.shape[-1]
    if counts_E is None:
        counts_E = expert_counts(idx_TK.reshape(-1), num_experts)
    f_E = counts_E.to(probs_TE.dtype) / counts_E.sum().clamp(min=1)
    P_E = probs_TE.mean(dim=0)
    return num_experts * torch.sum(f_E * P_E)


def sequence_load_balance_loss(probs_TE: torch.Tensor, idx_TK: torch.Tensor,
                               num_sequences: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: `load_balance_loss` within each sequence, averaged
    over the sequences (f_i from the sequence's top-k picks, P_i its mean probability); 1.0 when
    every sequence is balanced. Local to this process's sequences: no statistics are exchanged."""
    B, E = num_sequences, probs_TE.shape[-1]
    idx_BN = idx_TK.reshape(B, -1)
    counts_BE = torch.zeros(B, E, dtype=probs_TE.dtype, device=probs_TE.device).scatter_add_(
        1, idx_BN, torch.ones_like(idx_BN, dtype=probs_TE.dtype))
    f_BE = counts_BE / idx_BN.shape[1]
    P_BE = probs_TE.reshape(B, -1, E).mean(dim=1)
    return E * (f_BE * P_BE).sum(-1).mean()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2, in fp32."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


def _with_value(local: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` in the forward, the gradient of `local` in the backward."""
    return local + (value - local).detach()


@torch.no_grad()
def _local_sums(logits_TE, probs_TE, idx_TK, keep_TK, monitor: bool) -> torch.Tensor:
    """[picks E, prob sums E, sum of logsumexp^2, tokens] and, with `monitor`, [kept E, entropy sum]:
    one float64 tensor, so one all-reduce sums them over a group."""
    num_experts = probs_TE.shape[-1]
    picks_E = expert_counts(idx_TK.reshape(-1), num_experts)
    probs_f = probs_TE.float()
    parts = [picks_E.double(), probs_f.sum(0).double(),
             torch.logsumexp(logits_TE.float(), dim=-1).square().sum().double().reshape(1),
             picks_E.new_tensor([probs_TE.shape[0]], dtype=torch.float64)]
    if monitor:
        dropped_as_E = torch.where(keep_TK, idx_TK, num_experts).reshape(-1)  # dropped: the sentinel bin E
        kept_E = expert_counts(dropped_as_E, num_experts + 1)[:num_experts]
        entropy_sum = torch.special.entr(probs_f).sum()  # over the tokens
        parts += [kept_E.double(), entropy_sum.double().reshape(1)]
    return torch.cat(parts)


def routing_stats(
    logits_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    idx_TK: torch.Tensor,
    keep_TK: torch.Tensor,
    group_sum: GroupSum | None = None,
    grad_share: float = 1.0,
    losses: tuple[bool, bool] = (True, True),
    monitor: bool = True,
) -> RoutingStats:
    """Losses and monitoring numbers for one layer, global over the EP group.

    `group_sum` adds a tensor over the expert-parallel ranks (one all-reduce here).
    Under EP every rank returns the same values, equal to one process routing all the
    ranks' tokens; the losses' gradients are those of the local-token means, so
    averaging gradients over ranks (as DDP does) gives the global loss's gradient.
    `grad_share`: the fraction of its rank's tokens these are (1/tp when the MoE layer splits them
    over the TP group, whose router gradients are then summed): the local means' gradients scale by it.
    `losses` (load-balance, z-loss): which carry gradient; one whose coefficient is 0 is its value
    alone. Without `monitor` the drop and load numbers and the entropy are not computed (None): the
    step logs none of them (moe.model.moe.MoELayer.monitor).
    """
    E = probs_TE.shape[-1]
    sums = _local_sums(logits_TE, probs_TE, idx_TK, keep_TK, monitor)
    if group_sum is not None:
        sums = group_sum(sums)
    picks_E, prob_sum_E = sums[:E], sums[E : 2 * E]
    lse2_sum, num_tokens = sums[2 * E], sums[2 * E + 1]

    f_E = picks_E / picks_E.sum()
    aux = (E * torch.sum(f_E * prob_sum_E / num_tokens)).float()
    z = (lse2_sum / num_tokens).float()
    aux_grad, z_grad = losses
    if aux_grad:  # the value over the group; the gradient of this rank's share
        local = load_balance_loss(probs_TE.float(), idx_TK, picks_E) * grad_share
        aux = local if group_sum is None and grad_share == 1.0 else _with_value(local, aux)
    if z_grad:
        local = z_loss(logits_TE) * grad_share
        z = local if group_sum is None and grad_share == 1.0 else _with_value(local, z)
    kept_E = entropy_sum = None
    if monitor:
        kept_E, entropy_sum = sums[2 * E + 2 : 3 * E + 2], sums[3 * E + 2]
    return RoutingStats(
        aux_loss=aux,
        z_loss=z,
        tokens_per_expert_E=picks_E.round().long(),
        dropped_fraction=None if kept_E is None else (1.0 - kept_E.sum() / picks_E.sum()).float(),
        max_load=None if kept_E is None else kept_E.max().float(),
        mean_load=None if kept_E is None else kept_E.mean().float(),
        entropy=None if kept_E is None else (entropy_sum / num_tokens).float(),
    )


# ---- moving rows between token order [T*K] and expert order [M] ----
# Every move is a gather in the forward AND in the backward (each row of the source is
# used exactly once, so the backward is the inverse gather). index_select's own backward
# and index_add are scatter-adds, which are several times slower on CPU.


def inverse_index(index_M: torch.Tensor, n: int, keep_N: torch.Tensor | None = None) -> torch.Tensor:
    """pos_n with pos_n[index_M[m]] = m; entries nobody maps to, and those `keep_N` drops, get M (the zero
    row)."""
    pos_n = torch.full((n,), index_M.numel(), dtype=torch.long, device=index_M.device)
    pos_n[index_M] = torch.arange(index_M.numel(), device=index_M.device)
    return pos_n if keep_N is None else pos_n.masked_fill(~keep_N, index_M.numel())


def _take(x: torch.Tensor, index: torch.Tensor, pad: bool = False) -> torch.Tensor:
    """x[index] on dim 0; index == len(x) selects a zero row when index is longer than x, or `pad`."""
    if pad or index.numel() > x.shape[0]:
        x = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
    return x.index_select(0, index)


class _MoveRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, back, pad, pad_back):
        ctx.save_for_backward(back)
        ctx.pad_back = pad_back
        return _take(x, index, pad)

    @staticmethod
    def backward(ctx, grad):
        (back,) = ctx.saved_tensors
        return _take(grad, back, ctx.pad_back), None, None, None, None


def move_rows(x: torch.Tensor, index: torch.Tensor, back: torch.Tensor, pad: bool = False,
              pad_back: bool | None = None) -> torch.Tensor:
    """x[index] (index == len(x) gives a zero row) whose gradient is grad[back].

    `back` must be the inverse map (e.g. `inverse_index(index, len(x))`): every row of x
    appears at most once in `index`, and the rows it does not cover get zero gradient. `pad`: either
    map may point one past the end whatever the lengths (a fixed buffer's dropped or empty slots);
    `pad_back`: the backward's map alone may (default: as `pad`).
    """
    return _MoveRows.apply(x, index, back, pad, pad if pad_back is None else pad_back)


def sort_rows(x_TH: torch.Tensor, order_M: torch.Tensor, pos_N: torch.Tensor, top_k: int,
              drops: bool = False) -> torch.Tensor:
    """Token rows for the assignments, in expert order -> [M, H]. `drops`: pos_N points dropped assignments
    at the zero row (their rows, past every expert's slice, get no gradient)."""
    x_NH = x_TH.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, x_TH.shape[-1])  # backward: sum over k
    return move_rows(x_NH, order_M, pos_N, pad_back=drops)


def combine(y_MH: torch.Tensor, weights_TK: torch.Tensor, order_M: torch.Tensor, pos_N: torch.Tensor,
            drops: bool = False, weighted: bool = True):
    """Weighted sum of each token's expert outputs -> [T, H]; dropped assignments (pos_N at the zero row)
    add zero, whatever the experts left in their rows. weighted=False: the experts applied the weights."""
    return weighted_sum(move_rows(y_MH, pos_N, order_M, pad=drops, pad_back=False), weights_TK, weighted)


def weighted_sum(y_NH: torch.Tensor, weights_TK: torch.Tensor, weighted: bool = True) -> torch.Tensor:
    """Each token's K outputs (rows of its assignments, in [T, K] order) weighted and summed -> [T, H].

    Accumulates in fp32 for low-precision inputs. weighted=False (moe_opt.weights_in_activation: the
    experts multiplied each row by its weight): the K rows summed in their own dtype, no fp32 copy of them
    (torch's sum accumulates in fp32 and rounds once).
    """
    T, K = weights_TK.shape
    y_TKH = y_NH.view(T, K, -1)
    if not weighted:
        return y_TKH[:, 0] if K == 1 else y_TKH.sum(1)
    acc = torch.float32 if y_NH.dtype in (torch.bfloat16, torch.float16) else y_NH.dtype
    if K == 1:
        return (y_TKH[:, 0].to(acc) * weights_TK.to(acc)).to(y_NH.dtype)
    return (y_TKH.to(acc) * weights_TK.to(acc).unsqueeze(-1)).sum(1).to(y_NH.dtype)


def capacity_slots(idx_TK: torch.Tensor, keep_TK: torch.Tensor, num_experts: int,
                   capacity: int) -> torch.Tensor:
    """slot_N: each assignment's slot in an [E * C] buffer (expert * C + its rank among the expert's kept
    assignments, in token order); a dropped one gets E * C, one past the end. Nothing is read back to the
    host: the buffer's size is fixed, so the kept count is never needed."""
    E, C = num_experts, capacity
    expert_N = torch.where(keep_TK.reshape(-1), idx_TK.reshape(-1), E)  # dropped: the sentinel E
    order_N = torch.argsort(expert_N, stable=True)
    counts_E = expert_counts(expert_N, E + 1)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_expert = expert_N[order_N]
    rank_N = torch.arange(expert_N.numel(), device=idx_TK.device) - starts_E[sorted_expert]
    slot_sorted = torch.where(sorted_expert < E, sorted_expert * C + rank_N, E * C)
    return torch.empty_like(slot_sorted).scatter_(0, order_N, slot_sorted)


def clamped_swiglu(h_N2F: torch.Tensor, weights_N1: torch.Tensor | None = None, alpha: float = 1.702,
                   limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's expert activation (model.expert_activation=clamped_swiglu), gate columns first: the gate
    clamped above at `limit`, the up projection to [-limit, limit], then gate * sigmoid(alpha * gate) *
    (up + 1), as transformers' GptOssExperts._apply_gate (models/gpt_oss/modeling_gpt_oss.py:82-88, which
    reads gate and up from interleaved columns: moe.hf.gpt_oss de-interleaves them)."""
    gate, up = h_N2F.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    out = gate * torch.sigmoid(gate * alpha) * (up + 1)
    return out if weights_N1 is None else out * weights_N1.to(h_N2F.dtype)


@functools.cache
def expert_activation(kind: str, alpha: float, limit: float) -> Callable:
    """The experts' activation for model.expert_activation (one function per setting, so a compiled region
    compiles it once for every layer)."""
    if kind == "clamped_swiglu":
        return functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
    return swiglu


def swiglu(h_N2F: torch.Tensor, weights_N1: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, gate columns first; times each row's routing weight where given
    (moe_opt.weights_in_activation: Megatron-Core's weighted SwiGLU; the down projection is linear, so the
    expert's output comes out weighted), the weight cast to the rows' dtype."""
    gate, up = h_N2F.chunk(2, dim=-1)
    if weights_N1 is None:
        return F.silu(gate) * up
    return F.silu(gate) * up * weights_N1.to(h_N2F.dtype)
