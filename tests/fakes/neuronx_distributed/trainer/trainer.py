"""FAKE neuronx_distributed.trainer.trainer (v2.28.0 signatures and control flow, trainer/trainer.py).

`initialize_parallel_model` runs the real phases: model_fn under the meta-device context that moves
every registered parameter to the meta device (utils/model_utils.py:256-333), the pipeline wrapper
when pp > 1, then every module's parameters made empty CPU tensors of the same shape and filled by
`param_init_fn(module, device)` with the tensor-parallel attributes kept (model_utils.py:160-229),
activation checkpointing of the configured classes, and the NxDModel wrapper. The optimizer wrapper
all-reduces gradients over the data-parallel group and clips as NxDOptimizer and torch-xla's
ZeRO-1 optimizer do (trainer/optimizer.py:122-147; with ZeRO-1, max_norm from the optimizer keyword
arguments, default 1.0, not optimizer_config's max_grad_norm). With ZeRO-1 and mixed precision's
use_fp32_grad_acc (NxD's default with ZeRO-1, trainer.py:66-91, :284-285) each backward moves a
parameter's gradient into its fp32 `main_grad` and leaves `param.grad` None, the step reads `main_grad` and
zero_grad zeroes it, as torch-xla 2.9.0's ZeroRedundancyOptimizer with use_grad_acc_hook does
(distributed/zero_redundancy_optimizer.py:199-217, :350-356, :488-494).
"""
import torch
import torch.distributed as dist
from torch import nn

from ..parallel_layers import parallel_state
from ..pipeline.model import NxDPPModel
from ..utils.model_utils import init_on_device

PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions",
                  "sequence_parallel_enabled", "expert_model_parallel")


def neuronx_distributed_config(tensor_parallel_size=1, pipeline_parallel_size=1, expert_parallel_size=1,
                               context_parallel_size=1, pipeline_config=None, optimizer_config=None,
                               activation_checkpoint_config=None, pad_model=False, sequence_parallel=False,
                               model_init_config=None, lora_config=None, mixed_precision_config=None,
                               sequential_move_factor=11, lnc_size=1):
    optimizer_config = dict(optimizer_config or {"zero_one_enabled": False, "grad_clipping": True,
                                                 "max_grad_norm": 1.0})
    optimizer_config.setdefault("zero_one_enabled", False)
    optimizer_config.setdefault("grad_clipping", True)
    if optimizer_config["grad_clipping"]:
        optimizer_config.setdefault("max_grad_norm", 1.0)
    model_init_config = dict(model_init_config or {"sequential_move_factor": sequential_move_factor,
                                                   "meta_device_init": False, "param_init_fn": None})
    if model_init_config.get("meta_device_init") and "param_init_fn" not in model_init_config:
        raise ValueError("param_init_fn must be provided when meta_device_init is True")
    config = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
              "expert_parallel_size": expert_parallel_size, "context_parallel_size": context_parallel_size,
              "pipeline_config": pipeline_config, "optimizer_config": optimizer_config,
              "activation_checkpoint_config": activation_checkpoint_config, "pad_model": pad_model,
              "sequence_parallel": sequence_parallel, "model_init_config": model_init_config,
              "lora_config": lora_config, "mixed_precision_config": mixed_precision_config, "lnc_size": lnc_size}
    if dist.is_initialized():  # trainer.py:133-140
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size, pipeline_model_parallel_size=pipeline_parallel_size,
            expert_model_parallel_size=expert_parallel_size, lnc_size=lnc_size,
            context_parallel_size=context_parallel_size)
    return config


def _materialize(model: nn.Module, param_init_fn) -> None:
    with torch.no_grad():
        for module in model.modules():
            for key, param in list(module._parameters.items()):
                if param is None:
                    continue
                attrs = {a: getattr(param, a) for a in PARALLEL_ATTRS if hasattr(param, a)}
                empty = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="cpu"), param.requires_grad)
                for attr, value in attrs.items():
                    setattr(empty, attr, value)
                module._parameters[key] = empty
            if param_init_fn is not None:
                param_init_fn(module, torch.device("cpu"))


class NxDModel(nn.Module):
    def __init__(self, module, nxd_config):
        super().__init__()
        self.module, self.nxd_config = module, nxd_config
        self.pp_enabled = nxd_config["pipeline_parallel_size"] > 1
        if not self.pp_enabled:
            self.train()

    def local_modules(self):
        return [self.module]

    def run_train(self, *args, **kwargs):
        if self.pp_enabled:
            return self.module.run_train(*args, **kwargs)
        loss = self.forward(*args, **kwargs)
        loss.backward()
        return loss

    def run_eval(self, *args, **kwargs):
        assert self.pp_enabled, "`run_eval` should be used only when pipeline parallel is enabled."
        return self.module.run_eval(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):  # trainer/model.py:53-60: the module's own names
        if self.pp_enabled:
            return self.module.local_named_parameters(*args, **kwargs)
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        if self.pp_enabled:
            return self.module.local_state_dict(*args, **kwargs)
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        target = self.module.original_torch_module if self.pp_enabled else self.module
        return target.load_state_dict(state_dict, strict=strict)


def initialize_parallel_model(nxd_config, model_fn, include_buffers: bool = False, *model_args, **model_kwargs):
    init = nxd_config["model_init_config"]
    if init["meta_device_init"]:
        with init_on_device(device=torch.device("meta"), include_buffers=include_buffers,
                            force_custom_init_on_device=True):  # trainer.py:162-166
            model = model_fn(*model_args, **model_kwargs)
    else:
        model = model_fn(*model_args, **model_kwargs)
    if nxd_config["pipeline_parallel_size"] > 1:
        model = NxDPPModel(model, **{**nxd_config["pipeline_config"], "param_init_fn": init.get("param_init_fn")})
    if init.get("param_init_fn") is not None:  # reinit_model (utils/model_utils.py:220-229)
        _materialize(model.original_torch_module if isinstance(model, NxDPPModel) else model,
                     init["param_init_fn"])
    nxd_model = NxDModel(model, nxd_config)
    classes = nxd_config["activation_checkpoint_config"]
    if classes is not None:
        if classes == "full":
            raise RuntimeError('`activation_checkpoint_config` "full" is only supported for huggingface transformers '
                               "or nxdt models (trainer.py:202-222)")
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        classes = tuple(classes if isinstance(classes, (list, tuple)) else [classes])
        apply_activation_checkpointing(nxd_model, check_fn=lambda m: isinstance(m, classes))
    return nxd_model


class NxDOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer, nxd_config):
        self.optimizer, self.nxd_config, self._grad_norm = optimizer, nxd_config, None
        self.max_norm = None

    @property
    def grad_norm(self):
        return self._grad_norm

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=False):
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in _params(self):  # zero_redundancy_optimizer.py:488-494
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()

    def step(self, closure=None):
        accumulated = [p for p in _params(self) if hasattr(p, "main_grad")]
        for p in accumulated:  # the fp32 sum stands in for the gradient (zero_redundancy_optimizer.py:350-356)
            p.grad = p.main_grad.to(p.dtype, copy=True)
        params = [p for p in _params(self) if p.grad is not None]
        group = parallel_state.get_data_parallel_group()
        dp = parallel_state.get_data_parallel_size()
        for p in params:  # data-parallel average (grads.py:259-327)
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)
        opt = self.nxd_config["optimizer_config"]
        max_norm = self.max_norm if opt["zero_one_enabled"] else opt.get("max_grad_norm")
        if opt["grad_clipping"]:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        result = self.optimizer.step()
        for p in accumulated:  # the shards' gradients go (:409-410), the parameters had none
            p.grad = None
        return result


def _params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _accumulate_in_fp32(param) -> None:
    """torch-xla's gradient-accumulation hook (zero_redundancy_optimizer.py:199-217)."""
    if not hasattr(param, "main_grad"):
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    param.main_grad.add_(param.grad.to(torch.float32))
    param.grad = None


def initialize_parallel_optimizer(nxd_config, optimizer_class, parameters, **defaults):
    zero1 = nxd_config["optimizer_config"]["zero_one_enabled"]
    max_norm = defaults.pop("max_norm", 1.0) if zero1 else None
    optimizer = NxDOptimizer(optimizer_class(parameters, **defaults), nxd_config)
    optimizer.max_norm = max_norm
    mixed = nxd_config["mixed_precision_config"]
    if zero1 and (mixed is None or mixed.get("use_fp32_grad_acc", True)):  # NxD defaults, trainer.py:66-91
        for p in _params(optimizer):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_accumulate_in_fp32)
    return optimizer
