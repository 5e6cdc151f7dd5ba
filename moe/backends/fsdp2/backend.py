"""The torch-native backend: one DeviceMesh, FSDP2 + DTensor TP + EP (hardware=gpu_fsdp2, trn2, cpu_fsdp2).

What torchtitan trains MoE with, and what Trainium from trn2 on runs (TorchNeuron: native PyTorch
with DTensor and FSDP2 on a `neuron` device). Lightning's ModelParallelStrategy drives it (it calls
`LitMoE.configure_model`, where `parallelize` applies, on the meta device, in torchtitan's order:
expert parallelism (moe.parallel.apply.apply_ep, the all-to-all dispatcher on the mesh's `ep` dim),
tensor parallelism (moe.parallel.tensor_parallel), activation checkpointing, compile, FSDP2
(moe.parallel.fsdp), and only then gives each rank storage for its own shards
(moe.parallel.placement.materialize_distributed): moe.parallel.parallelize's one sequence. The mesh is
ParallelDims.meshes's. Under TP, EP is folded with it: each MoE layer splits its tokens over the TP
group and dispatches them over an EP group of consecutive ranks (moe.parallel.token_shard), so no
expert matmul runs twice; the routers' and shared experts' gradients are summed over TP after the
last backward of a step (`sync_grads`).

parallel.zero_stage says how FSDP2 shards: 3 frees each block's gathered weights after its forward
(gathers them again for the backward), 2 keeps them until the backward (more memory, one all-gather
fewer); weights, gradients and optimizer states are sharded either way. HSDP: parallel.hybrid_shard_degree.
Checkpoints are sharded directories in the canonical layout (moe/checkpoint/sharded.py): any
layout of this backend, DDP or DeepSpeed resumes them.
"""
from __future__ import annotations

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from moe.backends.base import Backend, TrainerParts
from moe.backends.checkpoints import FormatCheckpoints
from moe.backends.fsdp2.spec import FSDP2Spec
from moe.config.derived import precision_of
from moe.config.schema import HardwareConfig, ModelConfig, MoEOptConfig, ParallelConfig, TrainerConfig
from moe.parallel.comm import set_collective_timeout
from moe.parallel.dims import ExpertGroups, Meshes, ParallelDims
from moe.parallel.parallelize import ParallelizePlan
from moe.ranks import device_of


class FSDP2Backend(Backend):
    name = "fsdp2"

    def trainer_parts(self) -> TrainerParts:
        parallel = self.cfg.parallel
        self.strategy = FSDP2Strategy(self.dims, checkpoint_format=self.checkpoint_format,
                                      model_cfg=self.cfg.model, offload_experts=parallel.offload_experts,
                                      process_group_backend=self.cfg.hardware.backend,
                                      timeout=set_collective_timeout(parallel.collective_timeout_s))
        accelerator = self.cfg.hardware.accelerator
        if accelerator == "torch_neuron":  # Lightning has none for TorchNeuron's device
            from moe.backends.torch_neuron import TorchNeuronAccelerator

            accelerator = TorchNeuronAccelerator()
        return TrainerParts(accelerator=accelerator, strategy=self.strategy,
                            precision=precision_of(self.cfg.trainer, self.cfg.hardware), plugins=[])

    @property
    def meshes(self) -> Meshes:
        """The run's mesh, which its strategy builds with the process group
        (FSDP2Strategy.setup_environment)."""
        return self.strategy.meshes

    def parallelize_plan(self, module) -> ParallelizePlan:
        if self.dims.ep_enabled:
            self.expert_groups = ExpertGroups(ep=self.meshes.ep.get_group(), expert_dp=None)
        cfg = self.cfg
        return fsdp2_plan(cfg.moe_opt, cfg.parallel, cfg.hardware, self.dims, self.meshes,
                           mixed_precision(cfg.trainer, cfg.hardware), device_of(module),
                           self.initial_source())

    @classmethod
    def simulated_plan(cls, moe_opt: MoEOptConfig, parallel: ParallelConfig, hardware: HardwareConfig,
                        trainer: TrainerConfig, dims: ParallelDims, fake_mode) -> ParallelizePlan:
        """fsdp2_plan on the run's mesh, storage fake."""
        return fsdp2_plan(moe_opt, parallel, hardware, dims, dims.meshes("cpu"),
                           mixed_precision(trainer, hardware), "cpu", None, fake_mode)

    def parallelize(self, module) -> None:
        """moe.parallel.parallelize's sequence on the whole model, or under pipeline parallelism on each of
        this rank's stages (moe.parallel.pipeline), which the module then trains through the schedule."""
        if not self.dims.pp_enabled:
            return super().parallelize(module)
        from moe.module.pipelined import PipelineSchedule
        from moe.parallel.parallelize import parallelize
        from moe.parallel.pipeline import StageParts, build_pipeline

        cfg, dims, steps = self.cfg, self.dims, self.parallelize_plan(module)
        pipeline = build_pipeline(cfg.model, cfg.moe_opt, cfg.parallel, cfg.trainer, cfg.hardware, cfg.seed,
                                  dims, self.meshes,
                                  lambda part: parallelize(part, cfg.model, cfg.parallel, dims.tp, steps),
                                  steps.device)
        module.model = StageParts(pipeline.parts)
        module.schedule = PipelineSchedule(pipeline)

    def val_micro_batches(self) -> int:
        """A validation batch is a training step's rows, cut into the same micro-batches (the stages' shapes
        are given once, moe.parallel.pipeline.stage_tensors)."""
        return self.dims.accumulate_grad_batches if self.dims.pp_enabled else 1

    def stage_group(self):
        return self.meshes.tokens.get_group() if self.dims.pp_enabled else None

    def grad_norm(self, module) -> torch.Tensor:
        """The base norm over this stage's gradients, then over the stages (each holds other layers)."""
        norm = super().grad_norm(module)
        if not self.dims.pp_enabled:
            return norm
        import torch.distributed as dist

        squares = norm.to(module.device).pow(2)
        dist.all_reduce(squares, group=self.meshes.pp.get_group())
        return squares.sqrt().cpu()

    def sync_grads(self, module) -> None:
        """After the step's last backward: the routers' and shared experts' gradients (with sequence
        parallelism also the norms' and the LM head's) summed over TP: each TP rank's cover its share of
        the tokens."""
        if self.dims.moe_token_split == 1:
            return
        from moe.parallel.comm import sum_grads
        from moe.parallel.token_shard import partial_params

        params = partial_params(module.model, self.dims.sequence_parallel)
        sum_grads(params, self.meshes.tp.get_group())


def mixed_precision(trainer: TrainerConfig, hardware: HardwareConfig):
    """FSDP2's policy: bf16-mixed gathers weights in bf16 for compute and reduces gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if FSDP2Spec.gathers_bf16(trainer, hardware):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def fsdp2_plan(moe_opt: MoEOptConfig, parallel: ParallelConfig, hardware: HardwareConfig, dims: ParallelDims,
                meshes, mp_policy, device, source, fake_mode=None) -> ParallelizePlan:
    """Every step on the mesh: EP on its `ep` dim, the MoE tokens split over `tp`, TP on `tp`, the load
    balance over the ranks whose tokens it covers, FSDP2 on the dense and expert meshes (the training
    run's, or the simulation's on fake ranks)."""
    from functools import partial

    from moe.parallel.fsdp import apply_fsdp

    # an expert's gradient sums every rank's tokens that reached it: the average is over dp
    # (torchtitan's divide factor for the experts, models/llama4/infra/parallelize.py apply_fsdp)
    shard = partial(apply_fsdp, meshes=meshes, expert_divide_factor=dims.dp,
                    reshard_after_forward=dims.zero_stage >= 3, mp_policy=mp_policy,
                    sum_only=hardware.backend == "gloo", offload_experts=parallel.offload_experts)
    return ParallelizePlan(ep_group=meshes.ep.get_group() if dims.ep_enabled else None,
                 token_group=meshes.tp.get_group() if dims.moe_token_split > 1 else None,
                 tp_mesh=meshes.tp if dims.tp_enabled else None, sequence_parallel=dims.sequence_parallel,
                 load_balance_group=_load_balance_group(moe_opt, dims, meshes),
                 shard=shard, device=device, source=source, fake_mode=fake_mode)


def _load_balance_group(moe_opt: MoEOptConfig, dims: ParallelDims, meshes):
    """Whose tokens the routing statistics cover: every rank's (aux_loss_group=dp), else the EP group's
    or, when it is smaller, the TP group's (the ranks splitting one micro-batch); None: this rank's."""
    if moe_opt.aux_loss_group == "dp" and dims.world > 1:
        return meshes.tokens.get_group()
    if dims.tp_enabled and dims.tp > dims.ep:
        return meshes.tp.get_group()
    return None  # apply_ep's EP group (whole TP groups), or one rank


class FSDP2Strategy(FormatCheckpoints, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy on our mesh (ParallelDims.meshes) with our sharded checkpoints.

    Lightning builds a 2-D (data_parallel, tensor_parallel) mesh over every rank and saves DCP with its own
    layout; the run's mesh has the PP, EP and HSDP dims too (`meshes`, what this strategy and its backend
    read), and checkpoints are canonical (moe/checkpoint/sharded.py, through moe.backends.checkpoints),
    restored after setup straight into the live shards.
    """

    meshes: Meshes | None = None  # the run's, built with the process group (setup_environment)

    def __init__(self, dims: ParallelDims, model_cfg: ModelConfig, offload_experts: bool, **kwargs):
        # Lightning's mesh (world / tp, tp) is valid on every layout; nothing reads it
        super().__init__(dims=dims, data_parallel_size=dims.world // dims.tp, tensor_parallel_size=dims.tp,
                         **kwargs)
        self.model_cfg, self.offload_experts = model_cfg, offload_experts

    def setup_environment(self) -> None:
        """Lightning's (the process group, its mesh), then the run's mesh."""
        super().setup_environment()
        self.meshes = self.dims.meshes(self.root_device.type)

    def model_to_device(self) -> None:
        """Everything to the device but the experts offloaded to host memory
        (moe.parallel.fsdp.experts_held_back)."""
        if not self.offload_experts:
            return super().model_to_device()
        from moe.parallel.fsdp import experts_held_back

        with experts_held_back(self.model):
            super().model_to_device()

    @property
    def distributed_sampler_kwargs(self) -> dict:
        dp = self.meshes.dp
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """A checkpoint read whole (a portable file) goes into this rank's shards here: Lightning's
        ModelParallelStrategy loads nothing after load_checkpoint."""
        from moe.checkpoint.formats import in_place

        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if in_place(checkpoint):
            return checkpoint
        from moe.parallel.placement import load_full_checkpoint

        load_full_checkpoint(self.lightning_module, list(self.optimizers), checkpoint, self.model_cfg,
                             self.dims.tp)
        return {**checkpoint, "state_dict": {}, "optimizer_states": [{}] * len(self.optimizers)}
