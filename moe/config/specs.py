"""What a backend can do, readable without importing it: the validator and the planner ask its spec.

`hardware.strategy` names a backend. Its spec says which parallel degrees and ZeRO stages
it really implements (a degree it would ignore is refused at validation, never planned for)
and how many bytes each parameter's weight, gradient and optimizer state take under a
precision. This module holds the shape every spec shares; each backend's own spec is in its
package (moe/backends/<name>/spec.py), which moe.backends.registry finds by hardware.strategy. The
backends themselves (moe/backends/<name>/backend.py) import their heavy libraries only when a run
builds them.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe.config.derived import precision


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter for the weight, its gradient and its AdamW state, and why.

    `step`: what the optimizer step adds for a moment per (optimizer-sharded) parameter: torch's
    foreach AdamW keeps one more fp32 copy while it computes the update, its fused kernel (what
    moe.module.optim builds on CPU and CUDA) none; DeepSpeed's ZeRO optimizer holds the partition's
    fp32 gradient then, having freed the model's half-precision ones (`grads_in_step` False;
    deepspeed 0.19.8 runtime/zero/stage_1_and_2.py:3126 sets the fp32 grad partition, :3128 frees
    the half gradients, :3139 steps, :3141 frees the partition).
    """

    param: int
    grad: int
    optimizer: int
    note: str
    step: int = 4
    grads_in_step: bool = True


@dataclass(frozen=True)
class BackendSpec:
    name: str  # hardware.strategy
    library: str  # what it trains through, for messages
    max_zero_stage: int  # highest ZeRO stage it shards, for a model with MoE experts
    tensor_parallel: bool
    pipeline_parallel: bool
    hybrid_shard: bool
    precisions: tuple[str, ...] | None  # trainer.precision values it runs; None: it ignores trainer.precision
    # attention keeps no [heads, S, S] scores for backward: torch's scaled_dot_product_attention
    # (flash / memory-efficient kernels on CUDA). Under XLA (trn1) it is traced to plain matmuls.
    fused_attention: bool = True
    # the LM head and cross-entropy run in token chunks (moe/model/fused_ce.py): no [tokens, vocab]
    # logits. NxD's vocabulary-parallel cross-entropy takes the full (sharded) logits.
    fused_cross_entropy: bool = True
    # torch's fused AdamW (moe.module.optim.FUSED_ADAMW_DEVICES): the update needs no fp32 copy
    fused_adamw: bool = True
    # the ZeRO stage from which weights are sharded at rest (ZeRO-3; FSDP2 from 2, which only keeps them
    # gathered between a block's forward and backward)
    weights_sharded_from: int = 3
    # tensor parallelism splits every non-expert weight (NxD: embeddings, LM head too); False: only
    # attention and dense MLPs, the rest whole on every TP rank (moe.parallel.tensor_parallel)
    tp_splits_all_weights: bool = True
    # activation checkpointing wraps the MoE layer itself, not its block: moe_only keeps each MoE block's
    # attention activations, selective recomputes the whole MoE layer with the core attention (NxD's
    # classes, moe/backends/neuron/nxd_config.py CHECKPOINT_CLASSES); False: moe.parallel.apply.apply_ac
    ac_wraps_moe_layer: bool = False
    # the backend's class, "module:Class", imported only when a run builds it (moe.backends.build_backend)
    backend: str = ""
    # expert parallelism folded with tensor parallelism: EP groups are carved from DP x TP, and each TP
    # rank routes its share of the tokens (moe.parallel.dims, moe.parallel.token_shard); else from DP
    ep_folds_tp: bool = False
    # the pipeline schedules it runs (parallel.pp_schedule); the first is its default (NxD: its own 1F1B)
    pp_schedules: tuple[str, ...] = ("1F1B",)
    # under pipelining each unit's unsharded fp32 gradient accumulates over the step's micro-batches
    # (torch.distributed.pipelining: no reduce-scatter before the last, stage.py:844-847)
    pp_accumulates_full_grads: bool = False
    offload_experts: bool = False  # parallel.offload_experts: FSDP2's CPUOffloadPolicy on the expert units
    overlap_comm: bool = False  # parallel.overlap_comm: DeepSpeed ZeRO's reduction on side streams
    # why max_zero_stage is its highest, and what to use instead (the refusal's fix)
    zero_limit: str = "{library} shards optimizer states only"
    # the backward reduce-scatters each unit's gradients as it finishes (FSDP2 without pipelining)
    sharded_backward: bool = False
    # under -mixed precision the engine casts the model's weights to the half type (DeepSpeed)
    half_weights_when_mixed: bool = False
    # how its optimizer state is split: "none", "dtensor" (each DTensor's local shard), "zero" (ZeRO's
    # flat partitions of the dense and the expert parameters)
    optimizer_shards: str = "none"
    # simulate=true runs its tensor and pipeline parallelism (torch's own; a library's cannot run there),
    # and its communication buffers are real tensors of the simulated step (else they are added as planned)
    simulated_model_parallel: bool = False
    # activation elements an MLP keeps per token and width unit: gate, up, silu(gate), their product (NxD's
    # fused MLP measures at 3, tests/neuron_real)
    mlp_activations: int = 4
    # the checkpoint format it writes (moe.checkpoint.formats, by key) without and with expert parallelism:
    # one portable file holds every expert; under EP a sharded directory, each rank writing its own experts
    checkpoint_formats: tuple[str, str] = ("portable", "sharded")
    # every rank holds the whole model as one module (DDP): in-run evaluation (moe/eval/in_run.py) runs it
    whole_model_per_rank: bool = False

    def checkpoint_format(self, ep: int) -> str:
        """The key of the format a run with `ep` expert-parallel ranks writes."""
        return self.checkpoint_formats[ep > 1]

    def pipeline_schedule(self, parallel) -> str:
        """The schedule a pipelined run of this backend runs."""
        return parallel.pp_schedule if len(self.pp_schedules) > 1 else self.pp_schedules[0]

    def state_bytes(self, model, parallel, hardware, trainer) -> StateBytes:
        """Bytes per parameter under the run's precision (`model` and `parallel`: NxD's preset and ZeRO-1)."""
        run = precision(trainer, hardware)
        step = 0 if self.fused_adamw else 4
        if run.half is None:
            return StateBytes(4, 4, 8, "fp32 weights, grads and AdamW moments", step=step)
        if not run.mixed:
            return StateBytes(2, 2, 4, f"{run.name}: half-precision weights, grads and moments", step=step)
        return StateBytes(4, 4, 8, f"{run.name} autocast: fp32 weights, grads and moments", step=step)

    def comm_buffer_bytes(self, model, parallel, hardware, trainer, dp: int) -> float:
        """Bytes of communication buffers held through the backward, per device (`dp`, the data-parallel
        degree: FSDP2's offloaded expert shards)."""
        return 0.0

    def activation_bytes(self, model, hardware, trainer) -> int:
        """Bytes per activation element: 4 for an fp32 (or fp64) run, else the half type's 2."""
        return precision(trainer, hardware).activation_bytes


LIGHTNING_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
