"""FAKE neuronx_distributed.lightning (v2.28.0 signatures and behaviour, src/neuronx_distributed/lightning/).

The strategy runs on CPU processes over gloo (Lightning's DDP machinery underneath, as NxD's
XLAStrategy is a DDPStrategy) with what NxD's does differently: the accelerator accepts `devices`
of 1 or TPU_NUM_DEVICES (default 8) only (accelerator.py:98-113) and a single device fails in
setup_distributed (Lightning's XLAStrategy); model parallelism is initialised there; the module is
not wrapped in DDP (gradients are the optimizer wrapper's business); `reduce` takes sum, mean and
avg only and divides by the whole world (strategy.py:159-199); `broadcast` does nothing
(strategy.py:87-88); batches stay on the CPU with pipeline parallelism. The precision plugin calls
optimizer.step() and never the closure (precision_plugin.py:18-26).
"""
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

from ..parallel_layers.parallel_state import (
    get_data_parallel_rank,
    get_data_parallel_size,
    get_pipeline_model_parallel_rank,
    get_tensor_model_parallel_rank,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from ..trainer import initialize_parallel_model, initialize_parallel_optimizer


class NeuronXLAAccelerator(CPUAccelerator):
    @staticmethod
    def auto_device_count() -> int:
        return int(os.environ.get("TPU_NUM_DEVICES", 8))

    @staticmethod
    def parse_devices(devices):
        count = NeuronXLAAccelerator.auto_device_count()
        if devices == "auto":
            return count
        devices = int(devices)
        if devices not in {1, count}:
            raise ValueError(f"`devices` can only be 'auto', 1, {count} or [<0-{count - 1}>] for TPUs. Got {devices}")
        return devices


class NeuronCheckpointIO(TorchCheckpointIO):
    def __init__(self, save_load_xser: bool = True, weights_only: bool = False, *args: Any, **kwargs: Any):
        super().__init__()
        self.save_load_xser, self.weights_only = save_load_xser, weights_only


class NeuronXLAStrategy(DDPStrategy):
    def __init__(self, nxd_config: dict[str, Any] | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, expert_parallel_size: int = 1, context_parallel_size: int = 1,
                 debug: bool = False, sync_module_states: bool = False, checkpoint_io: NeuronCheckpointIO | None = None,
                 save_load_xser: bool = True):
        if checkpoint_io is not None and not isinstance(checkpoint_io, NeuronCheckpointIO):
            raise NotImplementedError("NeuronXLAStrategy only supports NeuronCheckpointIO")
        super().__init__(accelerator=NeuronXLAAccelerator(), process_group_backend="gloo",
                         checkpoint_io=checkpoint_io or NeuronCheckpointIO(save_load_xser=save_load_xser))
        self.nxd_config = nxd_config
        source = nxd_config or {}
        self.tensor_parallel_size = source.get("tensor_parallel_size", tensor_parallel_size)
        self.pipeline_parallel_size = source.get("pipeline_parallel_size", pipeline_parallel_size)
        self.expert_parallel_size = source.get("expert_parallel_size", expert_parallel_size)
        self.context_parallel_size = source.get("context_parallel_size", context_parallel_size)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        if len(self.parallel_devices) == 1:
            raise NotImplementedError("The `XLAStrategy` does not support running on a single device with the PjRT "
                                      "runtime. Try using all devices or the `SingleDeviceXLAStrategy` strategy")
        if not model_parallel_is_initialized():
            initialize_model_parallel(tensor_model_parallel_size=self.tensor_parallel_size,
                                      pipeline_model_parallel_size=self.pipeline_parallel_size,
                                      expert_model_parallel_size=self.expert_parallel_size,
                                      context_parallel_size=self.context_parallel_size)
        self.data_parallel_rank, self.data_parallel_size = get_data_parallel_rank(), get_data_parallel_size()
        self.tensor_parallel_rank = get_tensor_model_parallel_rank()
        self.pipeline_parallel_rank = get_pipeline_model_parallel_rank()

    def _setup_model(self, model):
        return model  # no DDP wrapper: NxD's optimizer reduces the gradients

    def model_to_device(self) -> None:
        """Nothing to move: NxD's strategy leaves placement to its model builder
        (lightning/strategy.py:131-133)."""

    def broadcast(self, obj, src: int = 0):
        return obj

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": get_data_parallel_size(), "rank": get_data_parallel_rank()}

    def batch_to_device(self, batch, device=None, dataloader_idx: int = 0):
        return super().batch_to_device(batch, torch.device("cpu") if self.pipeline_parallel_size > 1 else device,
                                       dataloader_idx)

    def reduce(self, output, group=None, reduce_op=None):
        if not isinstance(output, torch.Tensor):
            output = torch.tensor(output, device=self.root_device)
        if isinstance(reduce_op, str) and reduce_op.lower() not in ("sum", "mean", "avg"):
            raise ValueError("Currently, the XLAStrategy only supports `sum`, `mean`, `avg` for the reduce operation, "
                             f"got: {reduce_op}")
        output = output.clone()
        dist.all_reduce(output, op=dist.ReduceOp.SUM)
        if isinstance(reduce_op, str) and reduce_op.lower() in ("avg", "mean"):
            output = output / self.world_size
        return output.cpu()


class NeuronXLAPrecisionPlugin(Precision):
    def __init__(self, mixed_precision_enabled: bool = False):
        self.mixed_precision_enabled = mixed_precision_enabled

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any):
        optimizer.step()


class NeuronLTModule(LightningModule):
    def __init__(self, nxd_config: dict, opt_cls: Callable, scheduler_cls: Callable, model_args: tuple = (),
                 model_kwargs: dict = {}, opt_args: tuple = (), opt_kwargs: dict = {}, scheduler_args: tuple = (),
                 scheduler_kwargs: dict = {}, model_fn: Callable[..., Any] | None = None, grad_accum_steps: int = 1,
                 train_batch_size: int = 16, logging_interval: int = 1, log_rank0: bool = False,
                 manual_opt: bool = True):
        super().__init__()
        self.model_fn, self.nxd_config, self.opt_cls, self.scheduler_cls = model_fn, nxd_config, opt_cls, scheduler_cls
        self.model_args, self.model_kwargs, self.opt_args, self.opt_kwargs = model_args, model_kwargs, opt_args, opt_kwargs
        self.scheduler_args, self.scheduler_kwargs = scheduler_args, scheduler_kwargs
        self.grad_accum_steps, self.train_batch_size = grad_accum_steps, train_batch_size
        self.logging_interval, self.log_rank0 = logging_interval, log_rank0
        self.automatic_optimization = not manual_opt

    def setup(self, stage=None, include_buffers=False):  # lightning/module.py:103-112
        self.model = initialize_parallel_model(self.nxd_config, self.model_fn, include_buffers, *self.model_args,
                                               **self.model_kwargs)
        self.averaged_loss = torch.zeros(1, dtype=torch.double)
        self.print_pp_rank = 0 if self.log_rank0 else self.trainer.strategy.pipeline_parallel_size - 1

    def configure_optimizers(self):
        optimizer = initialize_parallel_optimizer(self.nxd_config, self.opt_cls, list(self.model.parameters()),
                                                  **self.opt_kwargs)
        return [optimizer], [{"scheduler": self.scheduler_cls(optimizer, *self.scheduler_args,
                                                              **self.scheduler_kwargs)}]

    def configure_gradient_clipping(self, *args, **kwargs):
        """Lightning clips nothing: NxD's optimizer wrapper or ZeRO-1 clips (lightning/module.py:89-92;
        tests/test_neuron.py test_grad_clip_is_applied_with_and_without_zero1 checks the clipping)."""

    def clip_gradients(self, *args, **kwargs):
        """As configure_gradient_clipping (lightning/module.py:94-95)."""

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        self.model.load_state_dict(state_dict, strict=strict)
