"""FAKE neuronx_distributed.utils.model_utils.init_on_device (v2.28.0, utils/model_utils.py:256-333)."""
import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def init_on_device(device: torch.device, include_buffers: bool = False, force_custom_init_on_device: bool = False):
    """Every parameter registered inside is moved to `device` as it is registered (and every buffer
    with include_buffers), as NxD's own implementation does; each is created first where its
    module creates it, so the transient cost is one parameter, not the model."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def register_empty_parameter(module, name, param):
        register_parameter(module, name, param)
        if param is not None:
            kwargs = dict(module._parameters[name].__dict__)
            kwargs["requires_grad"] = module._parameters[name].requires_grad
            module._parameters[name] = (param if param.device == device
                                        else type(param)(module._parameters[name].to(device), **kwargs))

    def register_empty_buffer(module, name, buffer, persistent=True):
        register_buffer(module, name, buffer, persistent=persistent)
        if buffer is not None:
            module._buffers[name] = module._buffers[name].to(device)

    nn.Module.register_parameter = register_empty_parameter
    if include_buffers:
        nn.Module.register_buffer = register_empty_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer
