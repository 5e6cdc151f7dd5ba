"""Our MoE layer's interface over neuronx-distributed's MoE module (RouterTopK + ExpertMLPs + MoE).

`forward(x_BSH, generating=False) -> (y_BSH, RoutingStats | None)`, as moe.model.moe.MoELayer, so
the Block around it is ours. NxD routes and runs the experts; the load-balance and z-losses and
the monitoring numbers are ours (moe.model.routing.routing_stats), computed from the router logits
NxD returns, with the assignments it kept recomputed by its own rule. Lines cited are
neuronx-distributed v2.28.0 (SDK 2.28, the last release that trains on trn1), src/neuronx_distributed/.

- Dropless (moe_opt.capacity_factor null) is NxD's capacity_factor 0.0, the blockwise path;
  None there would run every token through every expert (modules/moe/expert_mlps_v2.py:1451-1465).
- A capacity drops by position: tokens earlier in the flattened order keep their slot, with
  capacity min(ceil(T*k*cf/E), T) and no minimum (expert_mlps_v2.py:498-521); validation refuses
  drop_policy=probs and min_capacity > 0 on trn1.
- ExpertMLPs gets the router's sequence_parallel_enabled, or eval gathers the wrong sizes
  (expert_mlps_v2.py:472-473, :503-511, :774-775; NxD's own Mixtral example misses this).
- In eval, capacity_factor <= 0 takes the capacity path with capacity 0 and fails
  (expert_mlps_v2.py:1496-1497, :580), so a dropless layer runs its eval forward in training mode
  (no_grad around it keeps it cheap); with jitter off (refused on trn1) the result is the same.
- With sequence parallelism the router logits are gathered over the sequence in training only
  (modules/moe/routing.py:78-83, :102-109): statistics are computed in training, not in eval.
- model.router_bias is RouterTopK(bias=True), the bias of its nn.Linear (routing.py:73), on the logits
  our statistics read. Under sequence parallelism the router sees this rank's tokens, and NxD marks
  only the weight for its gradient's sum over TP (routing.py:76): the bias is marked here as well.
- Under sequence parallelism the input is [S / tp, B, H] (causal_lm.SEQUENCE_DIM): tokens are in
  sequence-major order, which decides which ones a capacity drops when a micro-batch holds more
  than one sequence (NxD's own models run the same way).

Expert parallelism (parallel.ep > 1) is NxD's Megatron-style path, EP carved out of data
parallelism ([PP, DP_exp, EP, TP], parallel_layers/parallel_state.py:621-628): each data-parallel
rank routes its own tokens into [E, C, H] capacity slots, and `Experts` sends every expert's slots
to the rank that holds it with a static all-to-all over the EP group and back
(modules/moe/experts.py:182-213, parallel_layers/mappings.py:603-677). NxD's defaults assume
inference, where every rank holds the same tokens; for training:
- `ExpertMLPs(enable_spmd_rank=True)`: its constructor reads the SPMD rank's expert indices under EP
  (expert_mlps_v2.py:122-139); layers.py fills SPMDRank with the rank and its experts.
- The router's process group: under EP NxD gives it the world group (routing.py:66-67); with
  sequence parallelism it gathers its logits over it, so here it is the tensor-parallel group.
- `MoE.ep_enabled` off: with it NxD reduces the MoE output over the world group (model.py:227-240)
  and skips the affinities' tensor-parallel gradient reduction (model.py:206-208). The experts' output
  is a tensor-parallel partial sum for this rank's own tokens, so both stay the tensor-parallel ones.
- `Experts` dispatches in training mode only (experts.py:182, :206): in eval an EP layer runs its
  forward in training mode, as a dropless one does.
Routing statistics (the load-balance and z-losses, the drop and load numbers) are summed over the EP
group, as on every backend (moe.parallel.apply.apply_ep): the losses of one process routing the
group's tokens.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import nn

from moe.backends.neuron.causal_lm import SEQUENCE_DIM
from moe.config.schema import normalizes
from moe.model.routing import (
    RoutingStats,
    apply_capacity,
    balance_probs,
    router_probs,
    routing_stats,
    top_k_routing,
)
from moe.parallel.comm import group_sum


def nxd_capacity_factor(capacity_factor: float | None) -> float:
    """Our capacity factor as NxD's: null (dropless) is 0.0, the blockwise dropless path."""
    return 0.0 if capacity_factor is None else float(capacity_factor)


def nxd_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """NxD's slots per expert: min(ceil(T*k*cf/E), T) (expert_mlps_v2.py:498-501)."""
    return min(math.ceil(num_tokens * top_k * capacity_factor / num_experts), num_tokens)


class NxDMoELayer(nn.Module):
    """A moe.model.moe.MoEFeedForward: NxD's MoE module (route, dispatch, experts, combine in one)."""

    def __init__(self, model_cfg, moe_opt, sequence_parallel: bool, init_method):
        super().__init__()
        from neuronx_distributed.modules.moe import MoE, RouterTopK
        from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs
        from neuronx_distributed.parallel_layers import parallel_state

        E, k, H = model_cfg.num_experts, model_cfg.top_k, model_cfg.hidden_size
        self.num_experts, self.top_k, self.normalize_top_k = E, k, moe_opt.normalize_top_k
        self.score_function = moe_opt.score_function
        self.capacity_factor = nxd_capacity_factor(moe_opt.capacity_factor)
        expert_parallel = parallel_state.get_expert_model_parallel_size() > 1
        self.expert_parallel = expert_parallel
        sp = sequence_parallel
        router = RouterTopK(num_experts=E, top_k=k, hidden_size=H, sequence_parallel_enabled=sp,
                            sequence_dimension=SEQUENCE_DIM,
                            act_fn=moe_opt.score_function,  # routing.py:116-126 apply_activation_fn
                            jitter_eps=moe_opt.jitter_eps, bias=model_cfg.router_bias)
        if model_cfg.router_bias:  # NxD marks the weight only (routing.py:76): the bias, too, sees SP shards
            router.linear_router.bias.sequence_parallel_enabled = sp
        experts = ExpertMLPs(num_experts=E, top_k=k, hidden_size=H,
                             intermediate_size=model_cfg.intermediate_size, hidden_act="silu", glu_mlp=True,
                             capacity_factor=self.capacity_factor, sequence_parallel_enabled=sp,
                             normalize_top_k_affinities=normalizes(moe_opt.normalize_top_k, k),
                             init_method=init_method, output_layer_init_method=init_method,
                             enable_spmd_rank=expert_parallel)
        # the sequence dimension of [S / tp, B, H], or of [B, S, H] without sequence parallelism: NxD's eval
        # reads its length, and a length of 1 is token generation (model.py:196, expert_mlps_v2.py:1469)
        self.moe = MoE(router=router, expert_mlps=experts, return_router_logits=True,
                       sequence_parallel_enabled=sp, sequence_dimension=SEQUENCE_DIM if sp else 1)
        self.stats_sum = None
        if expert_parallel:  # training's groups, not inference's (module docstring)
            router.tensor_parallel_group = parallel_state.get_tensor_model_parallel_group()
            self.moe.ep_enabled = False
            # a plain torch.distributed all-reduce over NxD's EP group, as NxD sums its expert-parallel
            # gradient norm (parallel_layers/grads.py:88-93)
            ep_group = parallel_state.get_expert_model_parallel_group()
            self.stats_sum = functools.partial(group_sum, group=ep_group)

    def forward(self, x_BSH: torch.Tensor,
                generating: bool = False) -> tuple[torch.Tensor, RoutingStats | None]:
        """moe.model.moe.MoEFeedForward: x [B, S, H], or [S / tp, B, H] under sequence parallelism; y
        shaped as x."""
        x = x_BSH
        dropless = self.capacity_factor <= 0
        eval_in_train_mode = not self.training and (dropless or self.expert_parallel)
        with _training(self.moe) if eval_in_train_mode else contextlib.nullcontext():
            y, logits_TE = self.moe(x)[:2]
        if not self.training or generating:
            return y, None
        scores_TE = router_probs(logits_TE.float(), score_function=self.score_function)
        weights_TK, idx_TK = top_k_routing(scores_TE, self.top_k, self.normalize_top_k)
        probs_TE = balance_probs(scores_TE, self.score_function)
        capacity = None if dropless else nxd_capacity(logits_TE.shape[0], self.num_experts, self.top_k,
                                                      self.capacity_factor)
        keep_TK = apply_capacity(idx_TK, weights_TK, self.num_experts, capacity, "position")
        return y, routing_stats(logits_TE, probs_TE, idx_TK, keep_TK, self.stats_sum)


@contextlib.contextmanager
def _training(module: nn.Module):
    module.train()
    try:
        yield
    finally:
        module.eval()
