"""What each backend can do, readable without importing it: the validator and the planner ask here.

`hardware.strategy` names a backend. Its spec says which parallel degrees and ZeRO stages
it really implements (a degree it would ignore is refused at validation, never planned for)
and how many bytes each parameter's weight, gradient and optimizer state take under a
precision. The backends themselves (moe/backends/<name>.py) import their heavy libraries
only when a run builds them.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe.config.derived import PP_SCHEDULES, expert_dp_size, layers_per_stage, neuron_precision, precision
from moe.config.size import param_breakdown


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


REDUCE_BUCKET_ELEMENTS = 200_000_000  # ZeRO's reduce and all-gather buckets (moe/backends/deepspeed.py)


@dataclass(frozen=True)
class DeepSpeedSpec(BackendSpec):
    def state_bytes(self, model, parallel, hardware, trainer) -> StateBytes:
        run = precision(trainer, hardware)
        if run.mixed:  # DeepSpeed keeps half weights and grads, fp32 master + moments
            return StateBytes(2, 2, 12, f"{run.name} DeepSpeed: half weights, grads; fp32 master, moments",
                              step=4, grads_in_step=False)
        return super().state_bytes(model, parallel, hardware, trainer)

    def comm_buffer_bytes(self, model, parallel, hardware, trainer, dp: int) -> float:
        """ZeRO's gradient reduction bucket: reduce_bucket_size elements of the model dtype, twice when
        overlap_comm (on GPU) double-buffers it (deepspeed 0.19.8 stage_1_and_2.py:3256-3278)."""
        if parallel.zero_stage < 1:
            return 0.0
        model_dtype_bytes = self.state_bytes(model, parallel, hardware, trainer).param
        return REDUCE_BUCKET_ELEMENTS * model_dtype_bytes * (2 if hardware.accelerator == "gpu" else 1)


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
        n_moe, n_dense = bd.num_moe_layers, m.num_layers - bd.num_moe_layers
        attention = bd.attention / m.num_layers / p.tp
        experts = bd.experts / p.ep / n_moe if n_moe else 0
        rest_of_moe = attention + (bd.routers + bd.shared_experts) / n_moe if n_moe else 0
        dense_block = attention + bd.dense_mlp / n_dense / p.tp if n_dense else 0
        block = max(rest_of_moe + experts, dense_block)
        layers = layers_per_stage(m.num_layers, p.pp)
        kept = layers if p.zero_stage == 2 or p.pp > 1 else min(2, layers)
        kept_experts = min(2, layers) if p.offload_experts else kept
        gathered = kept * block
        copied_in = 0.0
        if p.offload_experts:  # each block's fp32 expert shard is copied in before its all-gather
            gathered = kept * max(rest_of_moe, dense_block) + kept_experts * experts
            expert_dp = expert_dp_size(dp, p.tp, p.ep, self.ep_folds_tp)
            copied_in = experts * 4 / max(1, expert_dp)
        return (bd.embedding + bd.lm_head + bd.final_norm + gathered) * compute + block * 4 + copied_in


@dataclass(frozen=True)
class NeuronSpec(BackendSpec):
    def state_bytes(self, model, parallel, hardware, trainer) -> StateBytes:
        """ZeRO-1 (torch-xla's ZeroRedundancyOptimizer under NxD's) steps on its own copies of the weights'
        shards, in its optimizer dtype (torch_xla/distributed/zero_redundancy_optimizer.py:255-263 at
        v2.9.0): fp32, bf16 under XLA_USE_BF16; `mixed` makes them float64 for XLA_DOWNCAST_BF16 to hold
        in fp32 (NxD trainer/trainer.py:281-283), its master weights, with fp32 gradient accumulation."""
        preset, zero1 = neuron_precision(hardware, model), parallel.zero_stage >= 1
        if preset == "bf16_sr":
            return StateBytes(2, 2, 4 + 2 * zero1, "bf16 + stochastic rounding: bf16 weights, grads and "
                              "AdamW moments" + (", ZeRO-1's bf16 copy" if zero1 else ""))
        if preset == "mixed" and zero1:
            return StateBytes(2, 4, 12, "mixed: bf16 weights, fp32 grad accumulation, fp32 master + moments")
        if preset == "mixed":  # NxD keeps master weights with ZeRO-1 only (nxd_config.py)
            return StateBytes(2, 2, 4, "mixed without ZeRO-1: bf16 weights, grads and AdamW moments")
        return StateBytes(4, 4, 8 + 4 * zero1,
                          "fp32 weights, grads and moments" + (", ZeRO-1's copy" if zero1 else ""))

    def activation_bytes(self, model, hardware, trainer) -> int:
        return 4 if neuron_precision(hardware, model) == "fp32" else 2


LIGHTNING_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")

SPECS: dict[str, BackendSpec] = {
    "ddp": BackendSpec(
        name="ddp", library="PyTorch DDP", max_zero_stage=0, tensor_parallel=False, pipeline_parallel=False,
        hybrid_shard=False, precisions=LIGHTNING_PRECISIONS, backend="moe.backends.ddp:DDPBackend"),
    "deepspeed": DeepSpeedSpec(
        name="deepspeed", library="DeepSpeed", max_zero_stage=2,  # ZeRO-3 rejects DeepSpeed's native MoE
        tensor_parallel=False, pipeline_parallel=False, hybrid_shard=False,
        precisions=("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"),
        backend="moe.backends.deepspeed:DeepSpeedBackend", overlap_comm=True, half_weights_when_mixed=True,
        optimizer_shards="zero",
        zero_limit="optimizer states and gradients sharded, with expert parallelism for the experts: "
                   "DeepSpeed ZeRO-3 does not support MoE"),
    "fsdp2": FSDP2Spec(  # FSDP2 shards weights too (ZeRO-3 class); pipelining: torch.distributed.pipelining
        name="fsdp2", library="PyTorch FSDP2 + DTensor", max_zero_stage=3, tensor_parallel=True,
        pipeline_parallel=True, hybrid_shard=True,
        precisions=("32-true", "bf16-mixed"), weights_sharded_from=2, tp_splits_all_weights=False,
        backend="moe.backends.fsdp2:FSDP2Backend", ep_folds_tp=True, pp_schedules=PP_SCHEDULES,
        pp_accumulates_full_grads=True, offload_experts=True, sharded_backward=True,
        optimizer_shards="dtensor", simulated_model_parallel=True, checkpoint_formats=("sharded", "sharded")),
    "neuron": NeuronSpec(  # what its expert parallelism needs: moe.config.validate.check_neuron
        name="neuron", library="neuronx-distributed", max_zero_stage=1, tensor_parallel=True,
        pipeline_parallel=True, hybrid_shard=False, precisions=None,
        fused_attention=False, fused_cross_entropy=False, fused_adamw=False, ac_wraps_moe_layer=True,
        backend="moe.backends.neuron:NeuronBackend", mlp_activations=3, checkpoint_formats=("nxd", "nxd")),
}


def spec_of(hardware) -> BackendSpec:
    """The spec of hardware.strategy (validate has checked the name)."""
    return SPECS[hardware.strategy]
