"""Pipeline parallelism on the torch-native backend: torch.distributed.pipelining, as torchtitan builds it
(torchtitan 0.3.0 distributed/pipeline_parallel.py: pipeline_llm, _build_pipeline_schedule).

Each pp rank builds only its stages (moe.model.stage.PipelineStageModel, on the meta device: the
layers of ParallelDims.stage_layers, embeddings on the first stage, norm, LM head and loss on the last),
parallelises each one as a whole model (EP, TP, AC, FSDP2 with the stage as its root, materialised
with the canonical values of its parameter names), and hands them to a PipelineStage on the mesh's
`pp` group and to the schedule parallel.pp_schedule names. A step's micro-batches are the schedule's:
the rank's batch (trainer.micro_batch_size x accumulate_grad_batches sequences) cut into
parallel.pipeline_microbatches (default accumulate_grad_batches) pieces.

The step's loss is the mean over micro-batches of LM loss + router terms, as one process accumulating
them computes it: the schedule sums each micro-batch's loss times 1 / micro-batches (torchtitan's
scale_grads=False), and every stage's router terms enter its backward with the same weight
(moe.model.stage.RouterLossGrad). FSDP2's gradient reduction runs once, after the last micro-batch
(PipelineStage.perform_reduce_grad), but for experts offloaded to host memory, which reduce after every
micro-batch (keep_offloaded_experts_reducing).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moe.config.schema import HardwareConfig, ModelConfig, MoEOptConfig, ParallelConfig, TrainerConfig
from moe.errors import UserError
from moe.model.stage import LayerSlice, PipelineStageModel
from moe.parallel.dims import ParallelDims


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    parts: list[PipelineStageModel]  # this rank's stages, in stage order
    schedule: object  # a torch.distributed.pipelining schedule
    n_microbatches: int

    def train(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Forward and backward of every micro-batch of the step (gradients accumulated, then reduced)."""
        self._clear()
        self.schedule.step(input_ids, target=labels, return_outputs=False, labels_BS=labels)

    @torch.no_grad()
    def eval(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Forward of every micro-batch, no backward (validation)."""
        self._clear()
        self.schedule.eval(input_ids, target=labels, return_outputs=False, labels_BS=labels)

    def _clear(self) -> None:
        for part in self.parts:
            part.records.clear()


def check_stage_handshake(group) -> None:
    """Refuse, before training, a pipeline that this torch cannot start over gloo: torch 2.9's first exchange
    between stages sends an int64 and receives a float32 (torch/distributed/pipelining/stage.py:948-949 at
    v2.9.0, `_get_init_p2p_neighbors_ops`), a size mismatch gloo aborts the process on; later torch sends a
    float32 (2.13: stage.py:1118-1121)."""
    import inspect

    import torch.distributed as dist
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if dist.get_backend(group) != "gloo":
        return
    source = inspect.getsource(_PipelineStageBase._get_init_p2p_neighbors_ops)
    if "send_tensor = torch.tensor(self.stage_index, device=self.device)" in source:
        raise UserError("parallel.pp", dist.get_world_size(group), "pipeline on CPU (gloo) with a newer "
                        "torch (2.13 has the fix), or on GPUs (NCCL); or set parallel.pp=1",
                        problem=f"cannot start over gloo on torch {torch.__version__}: its stages first "
                                "connect by sending an int64 where they receive a float32 "
                                "(torch/distributed/pipelining/stage.py), which gloo aborts on")


def build_pipeline(model: ModelConfig, moe_opt: MoEOptConfig, parallel: ParallelConfig,
                   trainer: TrainerConfig, hardware: HardwareConfig, seed: int, dims: ParallelDims, meshes,
                   parallelize_part: Callable[[nn.Module], None], device) -> Pipeline:
    """This rank's stages (built from model and moe_opt with `seed`), each parallelised by `parallelize_part`
    (moe.parallel.parallelize with the backend's steps), and the schedule over the mesh's `pp` group; trainer
    and hardware say the precision the stages exchange hidden states in."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    from moe.backends.fsdp2.spec import FSDP2Spec

    n = parallel.pipeline_microbatches or dims.accumulate_grad_batches
    group = meshes.pp.get_group()
    check_stage_handshake(group)
    hidden_dtype = torch.bfloat16 if FSDP2Spec.gathers_bf16(trainer, hardware) else torch.float32
    parts, stages = [], []
    for stage in dims.stage_ids(meshes.pp.get_local_rank()):
        with torch.device("meta"):
            part = PipelineStageModel(model, moe_opt, seed, dims.stage_layers(stage),
                                      first=stage == 0, last=stage == dims.num_stages - 1)
        part.loss_scale, part.hidden_dtype = 1.0 / n, hidden_dtype
        parallelize_part(part)
        if parallel.offload_experts:
            keep_offloaded_experts_reducing(part)
        parts.append(part)
        inputs, outputs = stage_tensors(model, dims, part, n, hidden_dtype)
        stages.append(PipelineStage(part, stage, dims.num_stages, device, input_args=inputs,
                                    output_args=outputs, group=group))
    schedule_class = get_schedule_class(dims.pp_schedule)

    def loss_fn(lm_loss: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
        return lm_loss / n  # the last stage's output is its micro-batch's mean LM loss

    options = {"n_microbatches": n, "loss_fn": loss_fn, "scale_grads": False}
    multi = issubclass(schedule_class, PipelineScheduleMulti)
    schedule = schedule_class(stages if multi else stages[0], **options)
    return Pipeline(parts=parts, schedule=schedule, n_microbatches=n)


def keep_offloaded_experts_reducing(part: nn.Module) -> None:
    """Under pipelining a stage's FSDP2 units accumulate unsharded gradients, and keep their weights
    gathered, until the step's last backward (torch/distributed/pipelining/stage.py:844-847, then
    perform_reduce_grad): for experts offloaded to host memory that would hold the rank's experts' whole
    fp32 gradient on the device. Their units keep reducing (and resharding) after every micro-batch's
    backward, their gradient going to host memory each time, as without a pipeline; the rest of the
    stage keeps torch's behaviour."""
    from torch.distributed.fsdp import FSDPModule

    from moe.model.moe import Experts

    experts = [m for m in part.modules() if isinstance(m, Experts) and isinstance(m, FSDPModule)]
    stage_class = type(part)

    def set_requires_gradient_sync(requires: bool, *, recurse: bool = True) -> None:
        stage_class.set_requires_gradient_sync(part, requires, recurse=recurse)
        for unit in experts:
            unit.set_requires_gradient_sync(True, recurse=False)

    def set_reshard_after_backward(reshard: bool, *, recurse: bool = True) -> None:
        stage_class.set_reshard_after_backward(part, reshard, recurse=recurse)
        for unit in experts:
            unit.set_reshard_after_backward(True, recurse=False)

    part.set_requires_gradient_sync = set_requires_gradient_sync
    part.set_reshard_after_backward = set_reshard_after_backward


def stage_tensors(model: ModelConfig, dims: ParallelDims, part: PipelineStageModel, n_microbatches: int,
                  hidden_dtype):
    """What a stage takes and gives for one micro-batch, on the meta device: given up front, the schedule
    infers nothing (inference would run a forward of every stage on an uninitialised tensor, through the
    MoE layers' all-to-alls, and count its routing). Token ids [b, S] into the first stage, hidden states
    [b, S, H] (S / tp under sequence parallelism) between stages, the mean LM loss out of the last."""
    rows = dims.micro_batch_size * dims.accumulate_grad_batches // n_microbatches
    seq = dims.seq_len // (dims.tp if dims.sequence_parallel else 1)
    # requires_grad: the receiving stage's backward gives its input a gradient to send back
    hidden = torch.empty(rows, seq, model.hidden_size, dtype=hidden_dtype, device="meta",
                         requires_grad=True)
    inputs = torch.empty(rows, dims.seq_len, dtype=torch.long, device="meta") if part.first else hidden
    outputs = torch.empty((), dtype=torch.float32, device="meta") if part.last else hidden
    return inputs, outputs


class StageParts(nn.Module):
    """This rank's stages seen as one model, under the whole model's parameter names: what the optimizer,
    the checkpoints, the gradient norm and the step statistics read. It holds the stages' modules, not the
    stages (each is its own FSDP2 root and runs only through the schedule), so it is never called."""

    def __init__(self, parts: list[PipelineStageModel]):
        super().__init__()
        self.model_config, self.moe_opt = parts[0].model_config, parts[0].moe_opt
        self.init_seed, self.init_std = parts[0].init_seed, parts[0].init_std
        self.sequence_shard = parts[0].sequence_shard
        first = next((p for p in parts if p.first), None)
        last = next((p for p in parts if p.last), None)
        self.embed_tokens = first.embed_tokens if first is not None else None
        layers = sorted((int(k), block) for part in parts for k, block in part.layers.named_children())
        self.layers = LayerSlice({str(k): block for k, block in layers})
        self.norm = last.norm if last is not None else None
        self.lm_head = last.lm_head if last is not None else None

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its schedule (moe.parallel.pipeline.Pipeline)")
