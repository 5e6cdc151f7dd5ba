"""Where this rank's part of a parameter (or of its optimizer state) sits in the canonical tensor.

The canonical tensor is what one process holds: every expert, fused projections in [q | k | v]
and [gate | up] order. A live tensor is one of
- a plain tensor: the whole canonical tensor, or, for experts under expert parallelism, experts
  [first_expert, first_expert + E_local) of it;
- a DTensor (FSDP2 and/or TP, moe/backends/fsdp2/backend.py): a chunk of its own global tensor (found with
  torch's compute_local_shape_and_global_offset), whose rows are experts [first_expert, ...) or, for
  a fused projection, TP-interleaved (moe.parallel.tensor_parallel).

`pieces` gives the local parts with their canonical offsets: what a sharded checkpoint writes and
reads (every backend's checkpoints hold canonical tensors, so any layout resumes any other);
`fill_local` copies canonical values into a live tensor (initial values, a portable checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Where:
    """How a live tensor maps to its canonical one."""

    first_expert: int | None = None  # experts: global index of the live tensor's row 0
    num_experts: int | None = None  # experts: rows of the canonical tensor
    segments: tuple[int, ...] | None = None  # fused projection: canonical row segments
    tp: int = 1


def _chunk(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(local tensor, offsets of its chunk in the live global tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        with unset_fake_temporarily():  # it reads the mesh's (real) rank tensor, also under a simulation
            _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t._local_tensor, list(offsets)
    return t, [0] * t.dim()


def canonical_shape(t: torch.Tensor, where: Where) -> tuple[int, ...]:
    shape = tuple(t.shape)
    return (where.num_experts, *shape[1:]) if where.first_expert is not None else shape


def pieces(t: torch.Tensor, where: Where) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """This rank's non-empty parts of `t` as (view of its local storage, offsets in the canonical tensor)."""
    from moe.parallel.tensor_parallel import canonical_runs

    local, offsets = _chunk(t)
    if local.numel() == 0:
        return []
    if where.first_expert is not None:
        offsets[0] += where.first_expert
    if where.segments is None:
        return [(local, tuple(offsets))]
    runs = canonical_runs(offsets[0], local.shape[0], list(where.segments), where.tp)
    return [(local[start:start + length], (row, *offsets[1:])) for start, length, row in runs]


def to_live_order(value: torch.Tensor, where: Where) -> torch.Tensor:
    """A canonical tensor (experts: this rank's E_local of them) in the live global tensor's row order."""
    if where.segments is None:
        return value
    from moe.parallel.tensor_parallel import interleave_order

    return value.index_select(0, interleave_order(list(where.segments), where.tp).to(value.device))


@torch.no_grad()
def fill_local(t: torch.Tensor, value: torch.Tensor, where: Where) -> None:
    """Copy `value` (canonical; for experts this rank's E_local experts) into live tensor `t`'s local part."""
    local, offsets = _chunk(t)
    if local.numel() == 0:
        return
    value = to_live_order(value, where)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
    local.copy_(value[index].to(local.device, local.dtype))


def where_by_name(root: torch.nn.Module, model_cfg, tp: int) -> dict[str, Where]:
    """Every state-dict key of `root` (activation-checkpoint wrappers stripped) whose live tensor is not
    the whole canonical tensor by itself: experts, and fused projections under tensor parallelism."""
    from moe.model.moe import Experts
    from moe.parallel.tensor_parallel import fused_segments

    clean = _without_wrappers
    found: dict[str, Where] = {}
    for module_name, module in root.named_modules():
        if isinstance(module, Experts):
            for name, _ in module.named_parameters(recurse=False):
                found[clean(f"{module_name}.{name}")] = Where(first_expert=module.first_expert,
                                                             num_experts=model_cfg.num_experts)
    if tp > 1:
        for name, _ in root.named_parameters():
            if (segments := fused_segments(clean(name), model_cfg)) is not None:
                found[clean(name)] = Where(segments=tuple(segments), tp=tp)
    return found


@torch.no_grad()
def materialize_distributed(model: torch.nn.Module, device, source, model_cfg, tp: int) -> None:
    """MoETransformer.materialize for a model already parallelised on the meta device (FSDP2, TP): storage
    for this rank's shards only, filled with the canonical values (moe.model.init's for the model's seed,
    or `source(name, shape, first_expert)`) of the parts it holds. A parameter's full value exists for a
    moment (an expert tensor: this EP rank's experts only), never the whole model."""
    from moe.model.init import initial_values
    from moe.model.model import load_expert_bias

    model.to_storage(device)
    wheres = where_by_name(model, model_cfg, tp)
    seed, (std, out_std) = model.init_seed, model.init_std
    for name, p in model.named_parameters():
        name = _without_wrappers(name)
        where = wheres.get(name, Where())
        shape = tuple(p.shape)  # the live global shape: canonical, or this EP rank's experts
        first = where.first_expert
        value = (source(name, shape, first) if source is not None else
                 initial_values(name, shape, seed, std, out_std, first_expert=first, device=device))
        fill_local(p, value, where)
    if source is not None:
        load_expert_bias(model, lambda name, shape, first: source(_without_wrappers(name), shape, first))


def _without_wrappers(name: str) -> str:
    from moe.parallel.apply import WRAPPED

    return name.replace(f"{WRAPPED}.", "")


@torch.no_grad()
def load_full_checkpoint(lit_module, optimizers: list, checkpoint: dict, model_cfg, tp: int) -> None:
    """A portable checkpoint (one file, every expert, torch's id-keyed optimizer state) into this rank's
    live shards, split `tp` ways, of a network built from `model_cfg`: the weights, then each parameter's
    optimizer state (created first if the optimizer has none yet), then the param groups' hyper-parameters."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    wheres = where_by_name(lit_module, model_cfg, tp)
    live = lit_module.state_dict(keep_vars=True)
    for key, value in checkpoint["state_dict"].items():
        _fill_canonical(live[key], value, wheres.get(key))
    saved_states = checkpoint.get("optimizer_states") or []
    if not (optimizers and saved_states and saved_states[0]):
        return
    _, optim_sd = get_state_dict(lit_module, optimizers)  # the live state tensors, keyed like the model
    saved = saved_states[0]
    fqns = [fqn for group in optim_sd["param_groups"] for fqn in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    for fqn, idx in zip(fqns, ids, strict=True):
        for name, value in saved["state"].get(idx, {}).items():
            _fill_canonical(optim_sd["state"][fqn][name], value, wheres.get(fqn))
    for live_group, saved_group in zip(optimizers[0].param_groups, saved["param_groups"], strict=True):
        live_group.update({k: v for k, v in saved_group.items() if k != "params"})


def _fill_canonical(target: torch.Tensor, value, where: Where | None) -> None:
    """Copy canonical `value` (every expert) into `target`'s local part."""
    if target.dim() == 0:  # an optimizer's step count
        target.copy_(value)
        return
    where = where or Where()
    if where.first_expert is not None:
        value = value[where.first_expert:where.first_expert + target.shape[0]]
    fill_local(target, value, where)
