"""STAND-IN for neuronx_distributed.trainer: records the nxd_config arguments."""
from neuronx_distributed import RECORD


def neuronx_distributed_config(**kwargs):
    RECORD["neuronx_distributed_config"] = kwargs
    config = {"context_parallel_size": 1, "lnc_size": 1, "model_init_config": None, **kwargs}
    return config


def initialize_parallel_model(nxd_config, model_fn, include_buffers=False, *args, **kwargs):
    RECORD["initialize_parallel_model"] = {"nxd_config": nxd_config, "model_fn": model_fn}
    return model_fn(*args, **kwargs)


def initialize_parallel_optimizer(nxd_config, optimizer_class, parameters, **defaults):
    RECORD["initialize_parallel_optimizer"] = {"optimizer_class": optimizer_class, "defaults": defaults}
    return optimizer_class(parameters, **defaults)
