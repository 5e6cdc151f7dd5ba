"""The global gradient norm and clipping of the torch backends: plain gradients (DDP, expert-parallel
experts) and DTensors on several meshes (FSDP2 + TP + EP).

torch's clip_grad_norm_ needs every gradient on one mesh; under fsdp2 dense gradients live on the dense
(and TP) mesh, experts' on the expert mesh, and each EP rank holds other experts. Each gradient's
local squares are summed over the mesh dims it is sharded on (never over its replicas: HSDP's
replicate dim, or the TP ranks of a weight TP does not split), experts' then over the EP group
(torchtitan's EP-aware clipping, torchtitan/distributed/utils.py clip_grad_norm_ with ep).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def local_part(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _sharded_dims(t: torch.Tensor) -> tuple:
    """(mesh, dims the tensor is split over), or (None, ()) for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None, ()
    # not Replicate: Shard, and FSDP2's _StridedShard under TP (whose is_shard() is False)
    return t.device_mesh, tuple(i for i, p in enumerate(t.placements) if not p.is_replicate())


def global_grad_norm(params, expert_params, ep_group=None, device=None) -> torch.Tensor:
    """sqrt of the sum of every gradient's squares over the whole model (a collective on every rank: the
    groups are keyed by parameter, not gradient, so every rank joins the same reductions in one order).
    `expert_params`: those of `params` that are experts (found by module: FSDP2 replaces parameters);
    `device`: where the sums travel (the backend's: CUDA for NCCL), also when no gradient is here."""
    experts = {id(p) for p in expert_params}
    groups: dict[tuple, list[torch.Tensor]] = {}
    meshes: dict[tuple, object] = {}
    device = torch.device("cpu") if device is None else torch.device(device)
    for p in params:
        mesh, dims = _sharded_dims(p)
        key = (id(mesh), dims, id(p) in experts)
        meshes[key] = mesh
        grads = groups.setdefault(key, [])
        if p.grad is not None:
            grads.append(local_part(p.grad).detach())
    dense, expert = torch.zeros((), device=device), torch.zeros((), device=device)
    for key, grads in groups.items():
        total = _sum_of_squares(grads, device)
        for dim in key[1]:
            dist.all_reduce(total, group=meshes[key].get_group(dim))
        if key[2]:
            expert = expert + total
        else:
            dense = dense + total
    if ep_group is not None:
        dist.all_reduce(expert, group=ep_group)
    return (dense + expert).sqrt()


def _sum_of_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    """Sum of the squares of `grads` in fp32 on `device`: one foreach norm per device and dtype (torch's
    clip_grad_norm_ kernels), no per-tensor reduction or copy."""
    total = torch.zeros((), device=device)
    for tensors in _by_device_and_dtype(grads).values():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        total = total + torch.stack(norms).pow(2).sum().to(device)
    return total


def _by_device_and_dtype(tensors) -> dict[tuple, list[torch.Tensor]]:
    """The tensors grouped as a foreach kernel takes them: one device and dtype per call."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


@torch.no_grad()
def clip_local_grads(params, total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient's local part by max_norm / (total_norm + 1e-6) when above, as clip_grad_norm_:
    one foreach multiply per device and dtype, the factor staying on the device (no host sync)."""
    coef = torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)
    grads = _by_device_and_dtype(local_part(p.grad) for p in params if p.grad is not None)
    for (dev, dtype), same in grads.items():
        torch._foreach_mul_(same, coef.to(dev, dtype))
