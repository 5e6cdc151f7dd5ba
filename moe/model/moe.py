"""The MoE feed-forward layer: route -> dispatch -> experts -> combine.

Read top to bottom: `Router` scores experts, `Experts` holds the experts' SwiGLU weights as
stacked tensors and runs rows already sorted by expert, `MoELayer.forward` ties them
together. The maths (top-k, capacity, drops, losses, stats) lives in `moe/model/routing.py`;
where rows go lives in the layer's dispatcher (`moe/model/dispatcher.py`): all experts here by
default, spread over expert-parallel ranks once `moe.parallel.apply.apply_ep` installs an
all-to-all dispatcher. The layer itself holds no process group.

Dispatch is sort-based: assignments are sorted by expert, their token rows gathered into
one contiguous buffer, each expert multiplies its slice (one `torch._grouped_mm` where the
build supports it, else a loop over the slices), and each token sums its k weighted
outputs. Row moves are gathers both ways (`routing.move_rows`), never scatter-adds, and
no [T, E, C] one-hot tensors are built.

The forward is three steps: `MoELayer.route` (scores, top-k, capacity, dispatch), the experts,
`MoELayer.finish` (combine, routing statistics). With model.compile=true (`compile_regions`) the
two around the experts run compiled, fullgraph, where they hold no collective.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from moe.config.schema import group_scored_by, normalizes
from moe.model.dispatcher import Dispatcher, LocalDispatcher, TokenShard
from moe.model.expert_layout import ExpertLayout, arranged, kernel_order, memory_order, stored
from moe.model.fp8 import fp8_grouped_mm, fp8_kernel
from moe.model.fused_swiglu import activation as fused_activation
from moe.model.init import draw_base_seed, initialize
from moe.model.mlp import SwiGLU
from moe.model.probing import probing
from moe.model.routing import (
    GroupSum,
    RoutingStats,
    apply_capacity,
    balance_probs,
    expert_capacity,
    router_dtype,
    router_probs,
    routing_stats,
    sequence_load_balance_loss,
    swiglu,
    top_k_routing,
)
from moe.model.sync import host_sizes

__all__ = ["Router", "Experts", "MoEFeedForward", "MoELayer", "RoutingStats",
           "arrange_for_generation", "autocast_dtype", "expert_kernel", "grouped_mm_works"]

@runtime_checkable
class MoEFeedForward(Protocol):
    """What a Block calls for an MoE layer: `MoELayer` below, or a backend's whole-layer replacement
    (trn1's moe.backends.neuron.nxd_moe_layer.NxDMoELayer, whose library fuses dispatch, experts and
    combine). Returns the output shaped as the input and the routing statistics (None when generating
    or in eval, where they would be thrown away)."""

    def forward(self, x_BSH: torch.Tensor,
                generating: bool = False) -> tuple[torch.Tensor, RoutingStats | None]: ...


class Router(nn.Module):
    """Linear gate, weight [E, H] (and with `bias`, model.router_bias, a trained bias [E] on the logits:
    gpt-oss), computed in `dtype` (fp32) outside autocast.

    With `expert_bias` (moe_opt.enable_expert_bias) it also holds the aux-loss-free balancing bias
    [E] (a buffer: in checkpoints, not trained by the optimizer; moe.module.expert_bias moves it).
    """

    def __init__(self, hidden_size: int, num_experts: int, dtype=torch.float32, jitter_eps: float = 0.0,
                 expert_bias: bool = False, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.dtype, self.jitter_eps = dtype, jitter_eps
        # a None buffer is not in the state dict: models without the bias keep their keys
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)

    def init_buffers(self) -> None:
        """The bias starts at zero (again after the model leaves the meta device)."""
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros_like(self.expert_bias, device=self.weight.device)

    def _apply(self, fn, recurse=True):
        """The bias stays fp32 when the model is cast to half precision (DeepSpeed, bf16-true), as
        Megatron keeps it: steps of bias_update_rate would vanish in bf16 once it grows."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x_TH.device.type, enabled=False):
            x_TH = x_TH.to(self.dtype)
            if self.training and self.jitter_eps > 0:  # multiplicative noise U(1-eps, 1+eps)
                x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            bias = None if self.bias is None else self.bias.to(self.dtype)
            return F.linear(x_TH, self.weight.to(self.dtype), bias)


_GROUPED_MM_OK: dict[tuple[str, torch.dtype, ExpertLayout], bool] = {}
# How far the probe's grouped GEMM may be from per-expert matmuls in each dtype (inputs ~N(0, 1), 16 terms a
# dot product): bf16 keeps 8 mantissa bits, fp16 11; fp32 allows TF32 (10 bits) where CUDA matmuls use it
# (hardware.allow_tf32). A kernel that is wrong (offsets, layouts) is off by O(1).
GROUPED_MM_TOLERANCE = {torch.float32: 1e-2, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def grouped_mm_works(device: torch.device, dtype: torch.dtype, layout: ExpertLayout | None = None) -> bool:
    """Whether torch._grouped_mm runs forward and backward correctly here in `dtype` on weights stored in
    `layout` (default: the stored one); probed once, cached.

    Some builds lack a kernel for a device/dtype or reject some layouts (a right operand [E, in, out] viewed
    from [E, out, in] storage is column-major); then the experts fall back to a loop over contiguous slices.
    The probe runs apart from its caller's autograd and autocast state (moe.model.probing).
    """
    layout = layout or stored()
    key = (device.type, dtype, layout)
    if key not in _GROUPED_MM_OK:
        with probing(device.type):
            _GROUPED_MM_OK[key] = _probe_grouped_mm(device, dtype, layout)
    return _GROUPED_MM_OK[key]


def _probe_grouped_mm(device, dtype, layout: ExpertLayout) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(6, 16, generator=gen).to(device, dtype).requires_grad_()
        stored_w = torch.randn(layout.shape(3, 16, 8), generator=gen).to(device, dtype).requires_grad_()
        w = layout.as_in_out(stored_w)
        g = torch.randn(6, 8, generator=gen).to(device, dtype)
        offs = torch.tensor([2, 2, 6], dtype=torch.int32, device=device)  # expert 1 gets no rows
        y = torch._grouped_mm(x, w, offs=offs)
        ref = torch.cat([x[:2] @ w[0], x[2:2] @ w[1], x[2:] @ w[2]])
        grads = torch.autograd.grad((y * g).sum(), (x, stored_w))
        ref_grads = torch.autograd.grad((ref * g).sum(), (x, stored_w))
        tol = GROUPED_MM_TOLERANCE.get(dtype, 5e-2)
        pairs = [(y, ref), *zip(grads, ref_grads, strict=True)]
        return all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in pairs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_strides_fit(dtype: torch.dtype, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes `weights` in `dtype`: it wants every stride but the unit one a
    multiple of 16 bytes ("strides should be multiple of 16 bytes"), which small widths in half precision
    miss (a bf16 [E, out, in] operand of in-width 20: 40 bytes); the experts then loop."""
    size = torch.empty((), dtype=dtype).element_size()
    return all(s == 1 or s * size % 16 == 0 for w in weights for s in w.stride())


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on `device` here, or None where autocast is off (or does not exist,
    as on the meta device)."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class Experts(nn.Module):
    """E SwiGLU experts as stacked parameters: gate_up H -> 2F (gate outputs, then up), down F -> H, their
    dims in the order moe.model.expert_layout declares (the layout stored when the module was built).

    gpt-oss's experts (model.expert_proj_bias, expert_activation): `gate_up_bias` [E, 2F] and `down_bias`
    [E, H] added to each row by its expert, and `activation` (moe.model.routing.expert_activation) in place
    of SwiGLU. The fused Triton SwiGLU is plain SwiGLU's only: another activation runs its eager formula
    (compiled with the MoE regions)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: Callable | None = None):
        super().__init__()
        self.num_experts = num_experts  # experts held here (E / ep after sharding)
        self.layout = layout = stored()
        H, F = hidden_size, intermediate_size
        self.gate_up = nn.Parameter(torch.empty(layout.shape(num_experts, H, 2 * F)))
        self.down = nn.Parameter(torch.empty(layout.shape(num_experts, F, H)))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * F)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, H)) if bias else None
        self.activation = activation  # None: SwiGLU (fused where it can be)
        self.use_grouped_mm: bool | None = None  # None: use it where grouped_mm_works()
        # what the last forward ran (summary.json): "grouped_mm", "loop", "fp8" or "fp8_emulated"
        self.kernel: str | None = None
        self.compiled_activation = False  # the grouped GEMMs' SwiGLU compiled (MoELayer.compile_regions)
        self.fp8 = False  # moe_opt.fp8_experts: both grouped GEMMs in FP8 (moe.model.fp8)
        self.mark_expert(first=0)

    def mark_expert(self, first: int):
        """Expert parameters say so (backends treat them apart) and which global expert row 0 is."""
        self.first_expert = first
        for p in self.parameters():
            p.is_expert, p.first_expert = True, first
        for p in (self.gate_up_bias, self.down_bias):  # stacked [E, width], yet biases: no weight decay
            if p is not None:
                p.is_bias = True

    def forward(self, x_MH: torch.Tensor, counts_E: torch.Tensor | list[int],
                weights_M: torch.Tensor | None = None) -> torch.Tensor:
        """Rows sorted by expert, expert e owning the next counts_E[e] rows -> outputs [M, H]. counts_E is a
        long tensor, or Python ints where the dispatcher knows them (fixed buffers): then the per-expert
        loop reads nothing back from the device. Rows after the last expert's (dropped assignments) are
        in no expert: their outputs are undefined (grouped GEMM) or zero (loop), and nobody reads them.
        weights_M [M, 1]: each row's routing weight, applied in the SwiGLU (moe_opt.weights_in_activation);
        None: the outputs come out unweighted (the combine weights them)."""
        if self.fp8:
            return self._fp8_forward(x_MH, counts_E, weights_M)
        autocast = autocast_dtype(x_MH.device)  # bf16-mixed: the experts' matmuls run in bf16
        dtype = autocast or x_MH.dtype
        use_gmm = self.use_grouped_mm
        if use_gmm is None:
            same_dtype = autocast is not None or dtype == self.gate_up.dtype  # autocast: weights cast below
            order = memory_order(self.gate_up, self.layout)
            use_gmm = (same_dtype and grouped_mm_works(x_MH.device, dtype, order)
                       and grouped_mm_strides_fit(dtype, self.gate_up, self.down))
        self.kernel = "grouped_mm" if use_gmm else "loop"
        if use_gmm:
            offs_E = _group_ends(counts_E, x_MH.device)
            # under autocast in its dtype, as the per-expert matmuls below would run (the cast weights are
            # what autocast's matmuls make too)
            activation = self._activation(x_MH.device, dtype)
            gate_up, down = (self.layout.as_in_out(w.to(dtype)) for w in (self.gate_up, self.down))
            rows_E = None if self.gate_up_bias is None else _expert_of_rows(offs_E, x_MH.shape[0])
            h_M2F = torch._grouped_mm(x_MH.to(dtype), gate_up, offs=offs_E)
            h_M2F = self._biased(h_M2F, self.gate_up_bias, rows_E)
            y_MH = torch._grouped_mm(activation(h_M2F, weights_M), down, offs=offs_E)
            return self._biased(y_MH, self.down_bias, rows_E)
        sizes = counts_E if isinstance(counts_E, list) else host_sizes(counts_E, x_MH.shape[0])  # one sync
        split = [*sizes, x_MH.shape[0] - sum(sizes)]
        *xs, rest = x_MH.split(split)
        ws = [None] * len(xs) if weights_M is None else weights_M.split(split)
        gate_up, down = self.layout.as_in_out(self.gate_up), self.layout.as_in_out(self.down)
        activation = self.activation or swiglu
        if self.gate_up_bias is None:
            ys = [activation(x @ gate_up[e], ws[e]) @ down[e] for e, x in enumerate(xs)]
        else:
            ys = [activation(x @ gate_up[e] + self.gate_up_bias[e], ws[e]) @ down[e] + self.down_bias[e]
                  for e, x in enumerate(xs)]
        return torch.cat([*ys, rest.new_zeros(rest.shape[0], down.shape[-1], dtype=ys[0].dtype)])

    @staticmethod
    def _biased(h: torch.Tensor, bias_E: torch.Tensor | None, rows_E: torch.Tensor | None) -> torch.Tensor:
        """h plus each row's expert's bias (none without model.expert_proj_bias)."""
        return h if bias_E is None else h + bias_E.to(h.dtype)[rows_E]

    def _fp8_forward(self, x_MH, counts_E, weights_M) -> torch.Tensor:
        """Both GEMMs in FP8 from the stored weights (one rounding, to e4m3: under bf16-mixed not through bf16
        first); bf16 out. The real kernel where the card has it, else its emulation (moe.model.fp8)."""
        self.kernel = "fp8" if fp8_kernel(x_MH.device) else "fp8_emulated"
        ends_E = _group_ends(counts_E, x_MH.device)
        gate_up, down = self.layout.as_in_out(self.gate_up), self.layout.as_in_out(self.down)
        h_MF = self._activation(x_MH.device, torch.bfloat16)(fp8_grouped_mm(x_MH, gate_up, ends_E), weights_M)
        return fp8_grouped_mm(h_MF, down, ends_E)

    def _activation(self, device: torch.device, dtype: torch.dtype) -> Callable:
        """The grouped GEMMs' SwiGLU, one fused kernel each way: compiled with the MoE regions
        (model.compile), else the Triton kernels on CUDA (moe.model.fused_swiglu), else the eager formula."""
        if self.activation is not None:
            return region(self.activation, self.compiled_activation)
        if self.compiled_activation:
            return region(swiglu, True)
        return fused_activation(device, dtype)

    def arrange(self, order: ExpertLayout) -> None:
        """Re-stride gate_up and down in place so their memory runs in `order`
        (moe.model.expert_layout.arranged): shapes, values, names and checkpoints stay the stored layout's;
        a no-op when they already run so."""
        params = [getattr(self, name) for name in self.layout.names]
        if any(type(p.data) is not torch.Tensor for p in params):  # a DTensor shard: left as it is
            return
        weights = [arranged(p.data, self.layout, order) for p in params]
        if grouped_mm_strides_fit(weights[0].dtype, *weights):  # else an order the grouped GEMM refuses
            for p, w in zip(params, weights, strict=True):
                p.data = w

    def shard(self, first: int, count: int) -> None:
        """Keep experts [first, first+count) only (expert parallelism)."""
        dim = self.layout.expert_dim
        self.gate_up = nn.Parameter(self.gate_up.detach().narrow(dim, first, count).clone())
        self.down = nn.Parameter(self.down.detach().narrow(dim, first, count).clone())
        if self.gate_up_bias is not None:
            self.gate_up_bias = nn.Parameter(self.gate_up_bias.detach().narrow(0, first, count).clone())
            self.down_bias = nn.Parameter(self.down_bias.detach().narrow(0, first, count).clone())
        self.num_experts = count
        self.mark_expert(first)


def _expert_of_rows(ends_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each row's (local) expert from the experts' end rows, without a sync; rows after the last expert's
    (dropped assignments, undefined outputs) count as the last expert's."""
    rows = torch.arange(num_rows, device=ends_E.device, dtype=ends_E.dtype)
    return torch.searchsorted(ends_E, rows, right=True).clamp_(max=ends_E.shape[0] - 1)


def _group_ends(counts_E: torch.Tensor | list[int], device) -> torch.Tensor:
    """Each expert's end row, int32 (the grouped GEMMs' offsets)."""
    if isinstance(counts_E, list):
        return torch.tensor(list(itertools.accumulate(counts_E)), dtype=torch.int32, device=device)
    return torch.cumsum(counts_E, 0).to(torch.int32)


def arrange_for_generation(model: nn.Module) -> None:
    """Every expert's weights in the memory order its no-grad matmuls want for its device and dtype
    (moe.model.expert_layout.kernel_order): one copy the first time where the stored memory differs (a
    model stored [E, in, out] on the CPU), none after or for the default (moe.infer.generate)."""
    for m in model.modules():
        if isinstance(m, Experts):
            order = kernel_order(m.gate_up.device, m.gate_up.dtype)
            if order is not None:
                m.arrange(order)


def expert_kernel(model: nn.Module) -> str | None:
    """What the model's experts ran in their last forward: "grouped_mm", "loop", "fp8" or "fp8_emulated"
    (several joined by "+"), or None (no expert ran here: a dense model, or a backend with its own expert
    layer)."""
    kernels = sorted({m.kernel for m in model.modules() if isinstance(m, Experts) and m.kernel})
    return "+".join(kernels) or None


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts; forward(x_BSH) -> (y_BSH, RoutingStats).

    A dropped assignment adds nothing to its token's output (the block's residual carries
    the token). Capacity uses moe_opt.capacity_factor in training and
    moe_opt.eval_capacity_factor in eval; null means dropless; it counts this process's
    tokens (under EP the dispatcher makes every rank use the group's largest capacity).

    Installed by `moe.parallel.apply`: `dispatcher` (where rows go; local by default),
    `stats_sum` (sums routing statistics over the ranks whose tokens the load-balance and
    z-losses cover, e.g. the EP group or every data-parallel rank; None = this process's) and
    `token_shard` (under TP: each TP rank routes its share of the tokens, moe.parallel.token_shard).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, moe_opt,
                 shared_expert_intermediate_size: int = 0, init_range: float | None = 0.02,
                 out_init_std: float | None = None, router_bias: bool = False, expert_proj_bias: bool = False,
                 activation: Callable | None = None, shared_expert_gate: bool = False):
        """init_range None: leave the parameters for the model to initialise (moe.model.init). router_bias,
        expert_proj_bias, activation: gpt-oss's router and experts (Router, Experts). shared_expert_gate:
        the shared expert's output times sigmoid(Linear(hidden, 1)(x)) (Qwen2-MoE,
        models/qwen2_moe/modeling_qwen2_moe.py:337-350 at transformers 5.24)."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = moe_opt.capacity_factor
        self.eval_capacity_factor = moe_opt.eval_capacity_factor
        self.min_capacity, self.drop_policy = moe_opt.min_capacity, moe_opt.drop_policy
        self.normalize_top_k = moe_opt.normalize_top_k
        self.normalize_after_drop = (moe_opt.normalize_after_drop
                                     and normalizes(moe_opt.normalize_top_k, top_k))
        self.load_balancing_type = moe_opt.load_balancing_type
        self.score_function = moe_opt.score_function
        self.num_groups, self.group_top_k = moe_opt.num_groups, moe_opt.group_top_k
        self.group_scored_by = group_scored_by(moe_opt, top_k)
        self.topk_scaling_factor = moe_opt.topk_scaling_factor
        self.weights_in_activation = moe_opt.weights_in_activation  # the experts weight their rows
        # what the RoutingStats are read for: a loss term carries gradient where its coefficient is not 0;
        # the expert bias reads the picks every step; `monitor` (the drop, load and entropy numbers) is on
        # unless the training step logs none of them (moe.module.lit_moe.LitMoE.training_step)
        # (seq_aux_loss computes its own loss)
        balance = self.load_balancing_type == "aux_loss" and moe_opt.aux_loss_coeff != 0
        self.loss_terms = (balance, moe_opt.z_loss_coeff != 0)
        self.picks_read = moe_opt.enable_expert_bias
        self.monitor = True
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.stats_sum: GroupSum | None = None
        self.token_shard: TokenShard | None = None
        self.compiled_regions = False  # compile_regions() (model.compile=true)

        self.router = Router(hidden_size, num_experts, router_dtype(moe_opt.router_dtype), moe_opt.jitter_eps,
                             expert_bias=moe_opt.enable_expert_bias, bias=router_bias)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, expert_proj_bias, activation)
        self.experts.fp8 = moe_opt.fp8_experts
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = SwiGLU(hidden_size, shared_expert_intermediate_size)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        if init_range is not None:
            out_std = init_range if out_init_std is None else out_init_std
            initialize(self, draw_base_seed(), init_range, out_std)

    def forward(self, x_BSH: torch.Tensor,
                generating: bool = False) -> tuple[torch.Tensor, RoutingStats | None]:
        """generating: per-token (dropless) routing and no statistics, as generation wants."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        shard = self.token_shard
        if shard is not None and x_TH.shape[0] % shard.size:  # a token count validation does not see
            shard = None  # (generation): every rank routes every token
        if shard is not None:
            x_TH = shard.split(x_TH)
        cf = None if generating else self.capacity_factor if self.training else self.eval_capacity_factor
        capacity = expert_capacity(x_TH.shape[0], self.num_experts, self.top_k, cf, self.min_capacity)
        capacity = self.dispatcher.agree_capacity(capacity, x_TH.device)
        want_stats = not generating and (self.monitor or self.picks_read or any(self.loss_terms))

        compiled = self.compiled_regions and not generating  # generation's shapes change every token
        route, finish = region(MoELayer.route, compiled), region(MoELayer.finish, compiled)
        routed = route(self, x_TH, capacity)
        # eager: its own FSDP unit, its grouped GEMM
        y_MH = self.experts(routed.rows_MH, routed.counts_E, routed.weights_M)
        y_TH, stats = finish(self, y_MH, x_TH, routed, shard, x_BSH.shape[0], want_stats)
        return y_TH.view_as(x_BSH), stats

    def compile_regions(self) -> bool:
        """torch.compile (fullgraph) what runs before and after the experts, where both are pure tensor code:
        every expert in this process (no all-to-all, whose split sizes are read on the host), no token split
        over TP and no statistics all-reduce. The experts stay eager (under FSDP2 they are their own unit,
        whose hooks a compiled region would have to trace), but for their SwiGLU between the two grouped GEMMs
        (unless activation checkpointing wraps them: a recomputation would run it eager). Returns whether it
        compiled the regions."""
        if isinstance(self.experts, Experts):
            self.experts.compiled_activation = True
        local = isinstance(self.dispatcher, LocalDispatcher)
        self.compiled_regions = local and self.token_shard is None and self.stats_sum is None
        return self.compiled_regions

    def route(self, x_TH: torch.Tensor, capacity: int | None) -> Routed:
        """Scores, top-k, the capacity cut and the dispatch: the experts' rows and how to bring them back."""
        # 1. route: fp32 scores over all E experts (the router is replicated under EP)
        logits_TE = self.router(x_TH)
        scores_TE = router_probs(logits_TE, self.router.dtype, self.score_function)
        bias_E = self.router.expert_bias  # None unless aux-loss-free balancing is on
        weights_TK, idx_TK = top_k_routing(scores_TE, self.top_k, self.normalize_top_k, bias_E,
                                           self.num_groups, self.group_top_k, self.topk_scaling_factor,
                                           self.group_scored_by)

        # 2. capacity: which assignments fit (all of them when dropless)
        keep_TK = apply_capacity(idx_TK, weights_TK, self.num_experts, capacity, self.drop_policy)
        if self.normalize_after_drop and capacity is not None:
            weights_TK = F.normalize(weights_TK * keep_TK, p=1.0, dim=-1)  # NxD's eps: all dropped -> 0

        # 3. dispatch: the rows of the experts held here, in expert order
        rows_MH, counts_E, ctx, weights_M = self.dispatcher.dispatch(
            x_TH, idx_TK, None if capacity is None else keep_TK, capacity, self.num_experts,
            weights_TK if self.weights_in_activation else None)
        return Routed(rows_MH, counts_E, ctx, weights_M, logits_TE, scores_TE, weights_TK, idx_TK, keep_TK)

    def finish(self, y_MH: torch.Tensor, x_TH: torch.Tensor, routed: Routed, shard: TokenShard | None,
               num_sequences: int, want_stats: bool) -> tuple[torch.Tensor, RoutingStats | None]:
        """The experts' outputs (plus the shared expert's) back in token order, then the statistics."""
        y_TH = self.dispatcher.combine(y_MH, routed.weights_TK, routed.ctx, weighted=routed.weights_M is None)
        if self.shared_expert is not None:
            shared_TH = self.shared_expert(x_TH)
            if self.shared_expert_gate is not None:
                shared_TH = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared_TH
            y_TH = y_TH + shared_TH
        if shard is not None:
            y_TH = shard.gather(y_TH)
        if not want_stats:
            return y_TH, None  # nothing would read the statistics
        probs_TE, idx_TK = balance_probs(routed.scores_TE, self.score_function), routed.idx_TK
        stats = routing_stats(routed.logits_TE, probs_TE, idx_TK, routed.keep_TK, self.stats_sum,
                              grad_share=1.0 if shard is None else 1.0 / shard.size,
                              losses=self.loss_terms, monitor=self.monitor)
        if self.load_balancing_type == "seq_aux_loss":  # per sequence: over the whole rows again
            if shard is not None:
                probs_TE = shard.whole_sequences(probs_TE, num_sequences)
                idx_TK = shard.whole_sequences(idx_TK, num_sequences)
            stats.aux_loss = sequence_load_balance_loss(probs_TE.float(), idx_TK, num_sequences)
        elif self.load_balancing_type == "none":
            stats.aux_loss = torch.zeros_like(stats.aux_loss)
        return y_TH, stats


class Routed(NamedTuple):
    """What `MoELayer.route` hands to the experts and to `MoELayer.finish`."""

    rows_MH: torch.Tensor  # the experts' rows, sorted by expert
    counts_E: torch.Tensor | list[int]  # rows per local expert
    ctx: Any  # the dispatcher's return ticket
    weights_M: torch.Tensor | None  # each row's routing weight [M, 1] where the experts apply it, else None
    logits_TE: torch.Tensor
    scores_TE: torch.Tensor
    weights_TK: torch.Tensor
    idx_TK: torch.Tensor
    keep_TK: torch.Tensor


def region(fn: Callable, compiled: bool) -> Callable:
    """`fn` compiled where `compiled`, else itself. Eager under a dispatch mode too (a memory tracker, an op
    counter, fake tensors): dynamo refuses to trace under one, and such a mode is there to see every op."""
    return _compiled(fn) if compiled and not is_in_torch_dispatch_mode() else fn


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """`fn` compiled once for every layer (fullgraph: a graph break is an error, not a silent fallback)."""
    return torch.compile(fn, fullgraph=True)
