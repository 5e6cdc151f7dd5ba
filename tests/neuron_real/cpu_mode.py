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
P3  torch_xla.core.xla_model's collectives (all_reduce, all_gather, reduce_scatter, all_to_all and the
    bucketized two) and mark_step: XLA's collectives need an XLA device that spans processes, which
    torch-xla's CPU client does not (one process, world size 1). Here each runs over a gloo group of
    the XLA replica group holding this rank (made the first time those groups are used: every rank
    reaches an SPMD collective with the same groups), as NxD's CPU mode does for its own collectives
    (parallel_layers/comm.py); a bucketized collective runs tensor by tensor (buckets only batch the
    calls). NxD's expert-parallel all-to-all (mappings.py:275-287), ZeRO-1's reduce-scatter and
    all-gather, Lightning's barriers (xm.rendezvous) and NxD's strategy.reduce (the "xla" process
    group) go through them. mark_step is a no-op (nothing is lazy on CPU tensors).
P4  lightning/strategy.py: the strategy's root device, where Lightning puts batches, is
    xm.xla_device(): the CPU, where P2 put the model.
P5  lightning/strategy.py:200-218 process_dataloader wraps loaders in torch-xla's MpDeviceLoader,
    which copies batches to an XLA device only: the loader is used as it is (on trn1 the batches
    are prefetched to the device; the data position we save does not depend on it, it is
    trainer.global_step times the accumulation).
P6  ZeRO-1 (NeuronZero1Optimizer, NeuronEPZero1Optimizer over torch-xla's ZeroRedundancyOptimizer) on
    CPU parameters: its _shard_parameters (torch_xla/distributed/zero_redundancy_optimizer.py:234-269, v2.9.0)
    asserts an XLA device and unlazies; the same shards are made without both, each its own copy as on
    the device (on CPU tensors `.to("cpu")` and the chunk would be views of the parameter). Its rank and world
    (xr.global_ordinal, xr.global_device_count, one process under torch-xla's CPU client) are
    torch.distributed's. NxD's comm.all_reduce in CPU mode hands its groups to gloo, which takes a
    process group, not the replica groups ZeRO-1's gradient norm passes (parallel_layers/grads.py:
    111-117): those go through P3's groups. Its collectives are P3's.
"""

from __future__ import annotations

import os
import sys
import types

import neuronx_distributed.parallel_layers.comm as nxd_comm
import neuronx_distributed.parallel_layers.grads as nxd_grads
import neuronx_distributed.parallel_layers.utils as parallel_utils
import neuronx_distributed.trainer.checkpoint  # noqa: F401  (these import get_local_world_size by name: P1)
import neuronx_distributed.trainer.trainer as nxd_trainer
import neuronx_distributed.utils.model_utils  # noqa: F401
import torch
import torch.distributed as dist
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from neuronx_distributed.lightning import NeuronXLAStrategy
from torch import nn
from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer


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
_gloo_groups: dict = {}  # replica groups -> this rank's gloo group


def _group(groups):  # P3
    """The gloo group of the XLA replica group (a list of rank lists; empty: the world) holding this rank."""
    groups = [list(range(dist.get_world_size()))] if not groups else [list(g) for g in groups]
    key = tuple(map(tuple, groups))
    if key not in _gloo_groups:
        _gloo_groups[key] = dist.new_subgroups_by_enumeration(groups, backend="gloo")[0]
    return _gloo_groups[key]


def _all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):  # P3
    """xm.all_reduce: a tensor gives a new tensor, a list is reduced in place (as XLA's)."""
    tensors = inputs if isinstance(inputs, list) else [inputs.clone()]
    for tensor in tensors:
        dist.all_reduce(tensor, op=_OPS[reduce_type], group=_group(groups))
        if scale != 1.0:
            tensor.mul_(scale)
    return inputs if isinstance(inputs, list) else tensors[0]


def _all_gather(value, dim=0, groups=None, output=None, pin_layout=True, channel_id=None,
                use_global_device_ids=None):  # P3
    """xm.all_gather; an XLA tensor (xm.rendezvous gathers payload sizes) travels through the CPU."""
    group, device = _group(groups), value.device
    pieces = [torch.empty_like(value, device="cpu") for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, value.cpu().contiguous(), group=group)
    result = torch.cat(pieces, dim=dim).to(device)
    return result if output is None else output.copy_(result)


def _reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None,
                    pin_layout=True, channel_id=None, use_global_device_ids=None):  # P3
    if isinstance(input, list):
        return [_reduce_scatter(reduce_type, t, scale, scatter_dim, shard_count, groups) for t in input]
    group = _group(groups)
    total = input.clone().contiguous()
    dist.all_reduce(total, op=_OPS[reduce_type], group=group)
    result = total.chunk(shard_count, dim=scatter_dim)[dist.get_rank(group)] * scale
    return result if output is None else output.copy_(result)


def _all_to_all(value, split_dimension, concat_dimension, split_count, groups=None, pin_layout=True):  # P3
    """XLA's AllToAll: block i of `value` split along split_dimension goes to the group's i-th rank; the
    blocks received are concatenated along concat_dimension in rank order."""
    blocks = torch.stack(value.chunk(split_count, dim=split_dimension)).contiguous()
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks, group=_group(groups))
    return torch.cat(received.unbind(0), dim=concat_dimension)


def _all_gather_bucketized(input_list, dim=0, groups=None, output=None, pin_layout=False,
                           bucket_cap_mb=160):  # P3
    return [_all_gather(t, dim, groups) for t in input_list]


def _reduce_scatter_bucketized(reduce_type, input_list, scale, scatter_dim, shard_count, groups=None,
                               output=None, pin_layout=False, bucket_cap_mb=160):  # P3
    return [_reduce_scatter(reduce_type, t, scale, scatter_dim, shard_count, groups) for t in input_list]


xm.all_reduce, xm.all_gather, xm.reduce_scatter = _all_reduce, _all_gather, _reduce_scatter
xm.all_to_all = _all_to_all
xm.all_gather_bucketized, xm.reduce_scatter_bucketized = _all_gather_bucketized, _reduce_scatter_bucketized
xm.mark_step = lambda *args, **kwargs: None
NeuronXLAStrategy.root_device = property(lambda self: torch.device("cpu"))  # P4
NeuronXLAStrategy.process_dataloader = lambda self, dataloader: dataloader  # P5


def _shard_parameters(self):  # P6
    """ZeroRedundancyOptimizer._shard_parameters less its XLA-device assert and xm.unlazy."""
    self.device = next(p.device for group in self.param_groups for p in group["params"])
    sharded_groups = []
    for group in self.param_groups:
        shards = []
        for param in group["params"]:
            # on an XLA device the host round trip copies; on CPU .to("cpu") and the chunk are views of the
            # parameter: cloned, the shard is its own copy (its memory and its updates), as on the device
            data = self._shard_tensor(param.data.to(device="cpu")).to(dtype=self.optimizer_dtype).clone()
            shard = nn.Parameter(data.to(device=self.device), requires_grad=param.requires_grad)
            if self.use_grad_acc_hook:
                self._register_hook(param, shard)
            shards.append(shard)
        sharded_groups.append({**group, "params": shards})
    return sharded_groups


_nxd_all_reduce = nxd_comm.all_reduce


def _nxd_all_reduce_any_groups(op_type, tensor_bucket, groups, pin_layout=True):  # P6
    if isinstance(groups, list):
        groups = _group(groups)
    return _nxd_all_reduce(op_type, tensor_bucket, groups, pin_layout)


ZeroRedundancyOptimizer._shard_parameters = _shard_parameters
xr.global_ordinal = lambda: dist.get_rank()
xr.global_device_count = lambda: dist.get_world_size()
nxd_comm.all_reduce = nxd_grads.all_reduce = _nxd_all_reduce_any_groups
