"""FAKE torch_xla.core.xla_model: what moe/backends/neuron and the NxD fakes call, on the CPU."""
import torch
import torch.distributed as dist

REDUCE_SUM = "sum"
REDUCE_MAX = "max"


def xla_device(n=None, devkind=None):
    return torch.device("cpu")


def mark_step(wait=False, reset_scope=True):
    """Cuts the lazy graph on XLA; on the CPU everything has already run."""


def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
    ops = {REDUCE_SUM: dist.ReduceOp.SUM, REDUCE_MAX: dist.ReduceOp.MAX}
    result = inputs.clone()
    if dist.is_initialized():
        dist.all_reduce(result, op=ops[reduce_type])
    return result * scale if scale != 1.0 else result


def rendezvous(tag, payload=b"", replicas=[]):
    if dist.is_initialized():
        dist.barrier()
    return []
