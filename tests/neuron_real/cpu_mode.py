"""What must change for neuronx-distributed v2.28.0 to run on a CPU in its own CPU mode (NXD_CPU_MODE=1).

Imported first by every check: these override real behaviour, each for a reason the device
removes, so README.md lists them next to what they mean for the results.

P1  parallel_layers/utils.py:246-256 get_local_world_size falls through (PJRT_DEVICE is not NEURON)
    to a pre-PJRT branch reading torch_xla.core.xla_env_vars.HOST_WORLD_SIZE, which torch-xla 2.9
    no longer has: torchrun's LOCAL_WORLD_SIZE instead. It only sets how many ranks materialise
    the model at once and how many save a checkpoint at once (utils/model_utils.py:344,
    trainer/checkpoint.py:579).
P2  trainer/trainer.py:182 puts the model on xm.xla_device() even in CPU mode, whose collectives are
    gloo on CPU tensors (with the model on xla:0 the tensor-parallel all-reduces come out wrong):
    the CPU inside that module. On trn1 the model is on the Neuron device.
P3  torch_xla.core.xla_model.all_reduce / mark_step: XLA's collectives need an XLA device that spans
    processes, which torch-xla's CPU client does not (one process, world size 1): all_reduce over
    a gloo group of the world, as NxD's CPU mode does for its own collectives (comm.py); Lightning's
    barriers (xm.rendezvous) and NxD's strategy.reduce (the "xla" process group) go through it.
    mark_step is a no-op (nothing is lazy on CPU tensors).
P4  lightning/strategy.py: the strategy's root device, where Lightning puts batches, is
    xm.xla_device(): the CPU, where P2 put the model.
P5  lightning/strategy.py:200-218 process_dataloader wraps loaders in torch-xla's MpDeviceLoader,
    which copies batches to an XLA device only: the loader is used as it is (on trn1 the batches
    are prefetched to the device; the data position we save does not depend on it, it is
    trainer.global_step times the accumulation).
"""

from __future__ import annotations

import os
import sys
import types

import neuronx_distributed.parallel_layers.utils as parallel_utils
import neuronx_distributed.trainer.checkpoint  # noqa: F401  (these import get_local_world_size by name: P1)
import neuronx_distributed.trainer.trainer as nxd_trainer
import neuronx_distributed.utils.model_utils  # noqa: F401
import torch
import torch.distributed as dist
import torch_xla.core.xla_model as xm
from neuronx_distributed.lightning import NeuronXLAStrategy


def _local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


_original = parallel_utils.get_local_world_size
for _module in [m for name, m in sys.modules.items() if name.startswith("neuronx_distributed.")]:  # P1
    if getattr(_module, "get_local_world_size", None) is _original:
        _module.get_local_world_size = _local_world_size  # every module that imported it by name

_on_cpu = types.SimpleNamespace(**{k: getattr(xm, k) for k in dir(xm) if not k.startswith("__")})  # P2
_on_cpu.xla_device = lambda *args, **kwargs: torch.device("cpu")
nxd_trainer.xm = _on_cpu

_OPS = {xm.REDUCE_SUM: dist.ReduceOp.SUM, xm.REDUCE_MAX: dist.ReduceOp.MAX, xm.REDUCE_MIN: dist.ReduceOp.MIN}
_gloo_world: list = []  # made at the first collective, which every rank reaches


def _all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):  # P3
    """xm.all_reduce over the world: a tensor gives a new tensor, a list is reduced in place (as XLA's)."""
    if groups not in (None, [], [list(range(dist.get_world_size()))]):  # XLA: empty is every rank
        raise NotImplementedError(f"the CPU harness reduces over the whole world only, not {groups}")
    if not _gloo_world:
        _gloo_world.append(dist.new_group(backend="gloo"))
    tensors = inputs if isinstance(inputs, list) else [inputs.clone()]
    for tensor in tensors:
        dist.all_reduce(tensor, op=_OPS[reduce_type], group=_gloo_world[0])
        if scale != 1.0:
            tensor.mul_(scale)
    return inputs if isinstance(inputs, list) else tensors[0]


xm.all_reduce = _all_reduce
xm.mark_step = lambda *args, **kwargs: None
NeuronXLAStrategy.root_device = property(lambda self: torch.device("cpu"))  # P4
NeuronXLAStrategy.process_dataloader = lambda self, dataloader: dataloader  # P5
