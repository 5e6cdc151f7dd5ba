"""The typed contract between a backend and the training module and callbacks.

A `Backend` is built once per run from the config and the run's ParallelDims. It gives Lightning's
Trainer its strategy, precision and plugins, builds the LightningModule, parallelises the model
once the process group exists (`parallelize`, called from `LitMoE.configure_model`), and answers
what the step asks (moe.module.train_step: each micro-batch's gradient sync, the gradients' sync and
norm, clipping, a skipped update, collectives) and what checkpoints must hold. Each method's default
is what plain PyTorch (DDP or one process) needs; the other backends override.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moe.backends.registry import SPECS
from moe.backends.threads import THREADS_ENV, Threads, cpu_threads
from moe.config.schema import HardwareConfig, MoEOptConfig, ParallelConfig, TrainConfig, TrainerConfig
from moe.config.specs import BackendSpec
from moe.parallel.dims import ExpertGroups, ParallelDims
from moe.parallel.parallelize import ParallelizePlan, parallelize
from moe.ranks import device_of


@dataclass
class TrainerParts:
    """What `lightning.Trainer` takes from the backend."""

    accelerator: str
    strategy: Any  # a Lightning Strategy instance or a registry name such as "auto"
    precision: str | None  # None when a plugin sets it (Neuron)
    plugins: list


class Backend:
    """Plain PyTorch semantics; subclasses override what their library does differently."""

    name: ClassVar[str]

    def __init__(self, cfg: TrainConfig, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims  # the run's settled config (moe.train.run.settle froze it)
        self.expert_groups: ExpertGroups | None = None  # set by parallelize when ep > 1
        self._resuming = False  # set by build_module
        self.prepare()

    def prepare(self) -> None:
        """What a backend sets up once when built, from `self.cfg` (its library, its environment); plain
        PyTorch: nothing. Subclasses override this, not __init__, so the run's config is taken once."""

    @property
    def spec(self) -> BackendSpec:
        return SPECS[self.name]

    # -- what Trainer gets ------------------------------------------------------------------------
    def trainer_parts(self) -> TrainerParts:
        """What Trainer gets; every backend builds its Lightning strategy here, once, when the run builds
        its Trainer (a backend that reads its strategy later keeps it as `self.strategy`)."""
        raise NotImplementedError

    def threads(self) -> Threads | None:
        """Intra-op threads per process on CPU and what chose them (moe.backends.threads); None elsewhere."""
        if self.cfg.hardware.accelerator != "cpu":
            return None
        return cpu_threads(self.cfg.trainer.devices)

    def env(self) -> dict[str, str]:
        """Environment to set before the accelerator starts: hardware.env (and OMP threads on CPU)."""
        threads = self.threads()
        return {**({THREADS_ENV: str(threads.count)} if threads else {}),
                **{str(k): str(v) for k, v in self.cfg.hardware.env.items()}}

    def build_module(self, resuming: bool = False, guard=None):
        """The LightningModule that trains `moe.model.MoETransformer` on this backend, built on the meta
        device: `parallelize` gives each rank storage and values for its own shard only."""
        from moe.module import LitMoE

        self._resuming = resuming
        return LitMoE(self, on_meta=True, guard=guard)

    def initial_source(self):
        """Where `materialize` takes values from: model.init_from_hf's (or upcycle_from_hf's) files on a
        fresh run, else moe.model.init's seeded values (a resumed run's come from its checkpoint after)."""
        model = self.cfg.model
        if self._resuming or not (model.init_from_hf or model.upcycle_from_hf):
            return None
        from moe.hf import tensor_source

        field = "model.init_from_hf" if model.init_from_hf else "model.upcycle_from_hf"
        return tensor_source(model.init_from_hf or model.upcycle_from_hf, model, self.cfg.seed, field)

    @property
    def checkpoint_format(self):
        """The format its checkpoints are written in (moe.checkpoint.formats, with every backend's own:
        moe.backends.checkpoint_formats), as its spec declares."""
        import moe.backends.checkpoint_formats  # noqa: F401  (every backend's own format, registered on import)
        from moe.checkpoint.formats import BY_KEY

        return BY_KEY[self.spec.checkpoint_format(self.dims.ep)]

    def val_micro_batches(self) -> int:
        """Micro-batches in one validation batch: 1, the module evaluates one micro-batch at a time; under
        pipeline parallelism a step's micro-batches (parallel.pipeline_microbatches, or
        accumulate_grad_batches), which the pipeline evaluates in one run as it trains them (NxD's
        run_eval splits the batch it gets, pipeline/model.py:1074-1077, with the schedule built for them,
        :691-693)."""
        if not self.dims.pp_enabled:
            return 1
        return self.cfg.parallel.pipeline_microbatches or self.dims.accumulate_grad_batches

    def checkpoint_options(self) -> dict:
        """How moe.train.step_checkpoint.StepCheckpoint keeps checkpoints: the newest keep_last_checkpoints
        steps, and last.ckpt, a link to the newest of them (a file or a sharded directory)."""
        return {"keep": self.cfg.trainer.keep_last_checkpoints, "link_last": True}

    # -- the model, once the process group exists ----------------------------------------------
    def make_expert_groups(self) -> ExpertGroups:
        return self.dims.expert_groups()

    def parallelize_plan(self, module) -> ParallelizePlan:
        """Which steps of moe.parallel.parallelize apply: expert parallelism over the EP group, the
        load-balance group, and this rank's storage on the strategy's device."""
        if self.dims.ep_enabled:
            self.expert_groups = self.make_expert_groups()
        return ParallelizePlan(ep_group=self.expert_groups.ep if self.dims.ep_enabled else None,
                     load_balance_group=_load_balance_group(self.cfg.moe_opt),
                     device=device_of(module), source=self.initial_source())

    @classmethod
    def simulated_plan(cls, moe_opt: MoEOptConfig, parallel: ParallelConfig, hardware: HardwareConfig,
                        trainer: TrainerConfig, dims: ParallelDims, fake_mode) -> ParallelizePlan:
        """parallelize_plan for simulate=true's fake ranks (moe.tools.simulate), without building the
        backend (or importing its library): the run's EP group, the load balance over the world. It takes
        the sections any backend's steps read; these read moe_opt only."""
        groups = dims.expert_groups() if dims.ep_enabled else None
        return ParallelizePlan(ep_group=groups.ep if groups else None,
                               load_balance_group=_load_balance_group(moe_opt), fake_mode=fake_mode)

    def parallelize(self, module) -> None:
        """moe.parallel.parallelize's one sequence with this backend's steps."""
        steps = self.parallelize_plan(module)
        parallelize(module.model, self.cfg.model, self.cfg.parallel, self.dims.tp, steps)

    # -- inside the optimizer step (moe.module.train_step) ---------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called on the optimizer before the LR schedule is built (DeepSpeed: expert param groups)."""

    def micro_batch_sync(self, module, last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward (`last`: the step's last): where the library reduces
        gradients in the backward, only the last one's should (DDP, DeepSpeed). Nothing here."""
        return contextlib.nullcontext()

    def sync_grads(self, module) -> None:
        """After the step's last backward: what the library leaves to us (DDP with EP: the expert gradients
        over expert-DP; 16-mixed: the gradients unscaled)."""

    def clip_gradients(self, module, norm: torch.Tensor, max_norm: float) -> None:
        """Scale every gradient by max_norm / `norm` (the global norm, grad_norm's) where it is larger."""
        from moe.parallel.grad_norm import clip_local_grads

        clip_local_grads(module.model.parameters(), norm, max_norm)

    def grad_norm(self, module) -> torch.Tensor:
        """Global L2 norm of `param.grad` before clipping, on the CPU: expert parts summed over the EP
        group, DTensor gradients (fsdp2) over the mesh dims they are sharded on (moe.parallel.grad_norm)."""
        from moe.model.moe import Experts
        from moe.parallel.grad_norm import global_grad_norm

        ep_group = self.expert_groups.ep if self.expert_groups is not None else None
        experts = [p for m in module.model.modules() if isinstance(m, Experts) for p in m.parameters()]
        return global_grad_norm(module.model.parameters(), experts, ep_group, module.device).cpu()

    def skip_update(self, module) -> None:
        """The spike guard skips this step (moe.train.guard): after this the step's `optimizer.step()` must
        leave the weights and the optimizer state bit for bit as they are (the step is still counted). With no
        gradient, torch's AdamW updates nothing (no weight decay, no moments, no step count either)."""
        for p in module.parameters():
            p.grad = None

    def logged_grad_norm(self, module, norm: torch.Tensor) -> float:
        """The step's gradient norm for metrics.csv, read after the optimizer stepped (a logged step that was
        not skipped): `norm`, grad_norm's before clipping, where the step computed it; DeepSpeed and NxD
        report the one their optimizer computed inside its step."""
        return float(norm)

    def all_reduce(self, module, tensor: torch.Tensor, op: str, stage_only: bool = False) -> torch.Tensor:
        """`tensor` summed (op "sum") or maxed ("max") over every rank (`stage_only`: every rank of this
        rank's pipeline stage, which hold the same layers), returned on the CPU.

        The tensor travels on the module's device: where the backend communicates (CUDA for NCCL).
        """
        group = self.stage_group() if stage_only else None
        if group is None:
            return module.trainer.strategy.reduce(tensor.to(module.device), reduce_op=op).detach().cpu()
        reduced = tensor.to(module.device).clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
        return reduced.cpu()

    def stage_group(self):
        """The ranks of this rank's pipeline stage, when a pipeline splits the model here (else None)."""
        return None

    # -- checkpoints ----------------------------------------------------------------------------------
    def on_save_checkpoint(self, module, checkpoint: dict) -> None:
        """Every expert in `checkpoint` whatever ep was (collective over the EP group), where the format
        holds each tensor whole (a portable file); a sharded one has each rank write its own."""
        if self.expert_groups is not None and self.checkpoint_format.whole_tensors:
            from moe.parallel.expert_state import gather_full_experts

            gather_full_experts(module, checkpoint, self.expert_groups.ep, self.dims.ep)

    def on_load_checkpoint(self, module, checkpoint: dict) -> None:
        """Slice this rank's experts out of a portable checkpoint (optimizer moments once it exists); a
        sharded checkpoint has been read into this rank's tensors already."""
        if self.expert_groups is None or not checkpoint.get("state_dict"):
            return
        from moe.parallel.expert_state import slice_local_experts, slice_local_optimizer_states

        slice_local_experts(module, checkpoint, self.expert_groups.ep)
        if module.trainer.optimizers:
            slice_local_optimizer_states(module, checkpoint, self.expert_groups.ep)
        else:  # DDP restores weights before the optimizer exists: slice its moments at fit start
            self._checkpoint_to_slice = checkpoint

    def on_fit_start(self, module) -> None:
        checkpoint = self.__dict__.pop("_checkpoint_to_slice", None)
        if checkpoint is not None:
            from moe.parallel.expert_state import slice_local_optimizer_states

            slice_local_optimizer_states(module, checkpoint, self.expert_groups.ep)


def _load_balance_group(moe_opt: MoEOptConfig):
    """Whose tokens the routing statistics cover: every rank's (moe_opt.aux_loss_group=dp, WORLD), else the
    EP group's (apply_ep's) or this rank's: None."""
    world = dist.is_initialized() and dist.get_world_size() > 1
    return dist.group.WORLD if moe_opt.aux_loss_group == "dp" and world else None
