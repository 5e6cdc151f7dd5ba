"""Plain PyTorch: a process per device, DDP over the hardware's backend (gloo on CPU); one device: no DDP.

Checkpoints (moe.checkpoint.formats, as the spec declares): one portable file; under expert parallelism
a sharded directory, each rank writing its own experts (no rank gathers them all), saved and loaded
collectively by ShardedDDPStrategy (moe.backends.checkpoints).

Expert parallelism under DDP: DDP is told to ignore expert parameters
(`_ddp_params_and_buffers_to_ignore`, read when DDP wraps the module), and after the backward
of an optimizer step's last micro-batch their gradients are summed over the expert-DP group
and divided by the data-parallel world size: the same average over ranks that DDP gives
dense parameters (DeepSpeed does the same sum and division itself). Clipping then uses the
global norm (dense + every expert of the EP group), so every rank scales by the same factor
and replicas stay identical; the step clips under every precision (Backend.clip_gradients).
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from moe.backends.base import Backend, TrainerParts
from moe.backends.checkpoints import FormatCheckpoints
from moe.config.derived import precision_of
from moe.parallel.comm import set_collective_timeout


class DDPBackend(Backend):
    name = "ddp"

    def trainer_parts(self) -> TrainerParts:
        world, backend = self.dims.world, self.cfg.hardware.backend
        timeout = set_collective_timeout(self.cfg.parallel.collective_timeout_s)  # the world group's
        if not self.checkpoint_format.whole_tensors:
            strategy = ShardedDDPStrategy(checkpoint_format=self.checkpoint_format, dims=self.dims,
                                          process_group_backend=backend, timeout=timeout)
        else:
            strategy = (DDPStrategy(process_group_backend=backend, timeout=timeout)
                        if world > 1 else "auto")
        return TrainerParts(accelerator=self.cfg.hardware.accelerator, strategy=strategy,
                            precision=precision_of(self.cfg.trainer, self.cfg.hardware), plugins=[])

    def parallelize(self, module) -> None:
        super().parallelize(module)
        if self.expert_groups is not None:  # experts: reduced over expert-DP by sync_grads, not by DDP
            from moe.parallel.expert_grads import expert_param_names

            module._ddp_params_and_buffers_to_ignore = expert_param_names(module)

    @contextlib.contextmanager
    def micro_batch_sync(self, module, last: bool):
        """DDP all-reduces in the backward of the step's last micro-batch only: `require_backward_grad_sync`
        (what `no_sync` toggles) is on for that backward alone. Lightning runs the whole training_step inside
        DDP's forward, whose end readies the reducer for a backward whenever the flag is on
        (torch/nn/parallel/distributed.py:1828-1839 at 2.13, _post_forward): left on after the step (as
        `no_sync` leaves it), the next step's first micro-batch would all-reduce too. Lightning's manual
        backward readies it for the last one (lightning/pytorch/strategies/ddp.py:315-321 at 2.6.6)."""
        ddp = module.trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):  # one process: nothing to reduce
            yield
            return
        ddp.require_backward_grad_sync = last
        try:
            yield
        finally:
            ddp.require_backward_grad_sync = False

    def sync_grads(self, module) -> None:
        """Expert gradients summed over expert-DP, then, under 16-mixed with an optimizer that unscales inside
        its step (the fused AdamW), the gradients unscaled here: Lightning leaves them scaled for such an
        optimizer (plugins/precision/amp.py optimizer_step), and the norm the guard, the clipping and the
        metrics read must be the true one. GradScaler.step then knows they are (torch/amp/grad_scaler.py:
        an UNSCALED optimizer gets no grad_scale, still its found_inf)."""
        if self.expert_groups is not None:
            from moe.parallel.expert_grads import expert_params, reduce_expert_grads

            reduce_expert_grads(expert_params(module), self.expert_groups.expert_dp, dist.get_world_size())
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)
        optimizer = module.trainer.optimizers[0]
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)


class ShardedDDPStrategy(FormatCheckpoints, DDPStrategy):
    """DDPStrategy whose checkpoints are sharded directories (collective save and load on every rank).

    Lightning's own DCP path (ModelParallelStrategy) needs DTensor modules; ours keeps plain tensors
    and wraps only the expert entries at save time (moe.checkpoint.sharded). The checkpoint is
    restored after setup, once the optimizer exists, straight into the live tensors.
    """

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True
