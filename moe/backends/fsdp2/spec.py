"""What FSDP2 + DTensor can do (moe.config.specs.BackendSpec) and what it holds gathered, readable without
importing torch."""
from __future__ import annotations

from dataclasses import dataclass

from moe.config.derived import PP_SCHEDULES, expert_dp_size, layers_per_stage, num_blocks, precision
from moe.config.size import param_breakdown
from moe.config.specs import BackendSpec


@dataclass(frozen=True)
class FSDP2Spec(BackendSpec):
    """FSDP2 shards weights from zero_stage 2 on (2 keeps them gathered from forward to backward); TP
    splits attention and dense MLPs only (moe.parallel.tensor_parallel)."""

    @staticmethod
    def gathers_bf16(trainer, hardware) -> bool:
        """bf16-mixed: FSDP2 gathers weights in bf16 for compute (reducing gradients in fp32); else fp32."""
        run = precision(trainer, hardware)
        return run.mixed and run.half == "bfloat16"

    def comm_buffer_bytes(self, model, parallel, hardware, trainer, dp: int) -> float:
        """Weights FSDP2 holds gathered at the backward's peak, in the compute dtype: the root unit
        (embedding, final norm, LM head: FSDP2 does not reshard the root after the forward) and the largest
        block's share (its TP part, this EP rank's experts), two blocks with zero_stage 3 (the current one
        and the prefetched one), every block of the rank with 2 or under pipelining (torch's schedules
        keep a stage gathered until the step's last backward; offloaded experts reshard after each block);
        plus one block's unsharded fp32 gradient before its reduce-scatter."""
        m, bd, p = model, param_breakdown(model), parallel
        compute = 2 if self.gathers_bf16(trainer, hardware) else 4
        blocks = num_blocks(m)  # the multi-token-prediction depths' blocks are units as the layers are
        n_moe, n_dense = bd.num_moe_layers, blocks - bd.num_moe_layers
        attention = bd.attention / blocks / p.tp
        experts = bd.experts / p.ep / n_moe if n_moe else 0
        rest_of_moe = attention + (bd.routers + bd.shared_experts) / n_moe if n_moe else 0
        dense_block = attention + bd.dense_mlp / n_dense / p.tp if n_dense else 0
        block = max(rest_of_moe + experts, dense_block)
        layers = layers_per_stage(blocks, p.pp)
        kept = layers if p.zero_stage == 2 or p.pp > 1 else min(2, layers)
        kept_experts = min(2, layers) if p.offload_experts else kept
        gathered = kept * block
        copied_in = 0.0
        if p.offload_experts:  # each block's fp32 expert shard is copied in before its all-gather
            gathered = kept * max(rest_of_moe, dense_block) + kept_experts * experts
            expert_dp = expert_dp_size(dp, p.tp, p.ep, self.ep_folds_tp)
            copied_in = experts * 4 / max(1, expert_dp)
        root = bd.embedding + bd.lm_head + bd.final_norm + bd.mtp
        return (root + gathered) * compute + block * 4 + copied_in


SPEC = FSDP2Spec(  # FSDP2 shards weights too (ZeRO-3 class); pipelining: torch.distributed.pipelining
    name="fsdp2", library="PyTorch FSDP2 + DTensor", max_zero_stage=3, tensor_parallel=True,
    pipeline_parallel=True, hybrid_shard=True,
    precisions=("32-true", "bf16-mixed"), weights_sharded_from=2, tp_splits_all_weights=False,
    backend="moe.backends.fsdp2.backend:FSDP2Backend", ep_folds_tp=True, pp_schedules=PP_SCHEDULES,
    pp_accumulates_full_grads=True, offload_experts=True, sharded_backward=True,
    optimizer_shards="dtensor", simulated_model_parallel=True, checkpoint_formats=("sharded", "sharded"))
