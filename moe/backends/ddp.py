"""Plain PyTorch: a process per device, DDP over the hardware's backend (gloo on CPU); one device: no DDP.

Expert parallelism under DDP: DDP is told to ignore expert parameters
(`_ddp_params_and_buffers_to_ignore`, read when DDP wraps the module), and after the backward
of an optimizer step's last micro-batch their gradients are summed over the expert-DP group
and divided by the data-parallel world size: the same average over ranks that DDP gives
dense parameters (DeepSpeed does the same sum and division itself). Clipping then uses the
global norm (dense + every expert of the EP group), so every rank scales by the same factor
and replicas stay identical.
"""
from __future__ import annotations

import torch.distributed as dist

from moe.backends.base import Backend, TrainerParts


class DDPBackend(Backend):
    name = "ddp"

    def trainer_parts(self) -> TrainerParts:
        from lightning.pytorch.strategies import DDPStrategy

        world = self.layout.world
        strategy = DDPStrategy(process_group_backend=self.cfg.hardware.backend) if world > 1 else "auto"
        return TrainerParts(accelerator=self.cfg.hardware.accelerator, strategy=strategy,
                            precision=self.cfg.trainer.precision or self.cfg.hardware.precision, plugins=[],
                            overrides={})

    def parallelize(self, module) -> None:
        super().parallelize(module)
        if self.expert_groups is not None:  # experts: reduced over expert-DP by after_backward, not by DDP
            from moe.parallel.expert_grads import expert_param_names

            module._ddp_params_and_buffers_to_ignore = expert_param_names(module)

    def after_backward(self, module) -> None:
        if self.expert_groups is None or module.trainer.fit_loop.epoch_loop._should_accumulate():
            return
        from moe.parallel.expert_grads import expert_params, reduce_expert_grads

        reduce_expert_grads(expert_params(module), self.expert_groups.expert_dp, dist.get_world_size())

    def clip_gradients(self, module, optimizer, max_norm: float) -> bool:
        if self.expert_groups is None:
            return False
        from moe.parallel.expert_grads import clip_to_global_norm

        clip_to_global_norm(module.parameters(), self.grad_norm(module), max_norm)
        return True
