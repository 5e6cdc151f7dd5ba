"""Portable checkpoints under expert parallelism: every expert in the file, whatever ep was.

On save, every expert tensor (and, for torch optimizers, its Adam moments) is gathered over the
EP group, so `state_dict` holds all E experts; on load, this rank's experts are sliced back
out. A checkpoint written with ep2 loads with ep1, ep2 or in `infer.py`. Both are collective
over the EP group: every rank calls them (Lightning runs the hooks on all ranks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe.errors import ConfigError
from moe.ranks import trainer_of


def _expert_entries(lit_module) -> dict[str, torch.nn.Parameter]:
    """state-dict key -> expert Parameter (keep_vars gives the Parameters, with their keys)."""
    return {k: v for k, v in lit_module.state_dict(keep_vars=True).items() if getattr(v, "is_expert", False)}


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _local_slice(t: torch.Tensor, local: int, group) -> torch.Tensor:
    """Rows [rank*local, (rank+1)*local) of a full [E, ...] tensor; a local-sized tensor is an error."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[0] == local * ep:
        return t[rank * local : (rank + 1) * local].clone()
    raise ConfigError("parallel.ep", ep,
                      "load a checkpoint written by this repository (it stores all experts)",
                      problem=f"expects {local * ep} experts in the checkpoint tensor but found {t.shape[0]}")


def _torch_optimizer_expert_states(lit_module, opt_state: dict):
    """(param, its state-dict id) for every expert param in a torch optimizer state_dict, else nothing.

    torch numbers parameters 0.. across param groups in order; DeepSpeed's ZeRO state has
    another layout (and its own per-rank files), so it is left alone.
    """
    if not (isinstance(opt_state, dict) and "state" in opt_state and "param_groups" in opt_state):
        return
    trainer = trainer_of(lit_module)
    optimizers = trainer.optimizers if trainer is not None else []
    if len(optimizers) != 1:
        return
    params = [p for group in optimizers[0].param_groups for p in group["params"]]
    ids = [i for group in opt_state["param_groups"] for i in group["params"]]
    if len(ids) != len(params):
        return
    for idx, p in zip(ids, params, strict=True):
        if getattr(p, "is_expert", False) and idx in opt_state["state"]:
            yield p, idx


def _replace_expert_moments(lit_module, opt_state: dict, fn) -> None:
    """opt_state["state"][idx] := a new dict with fn applied to the expert-shaped tensors.

    The per-parameter dicts of `Optimizer.state_dict()` are the live optimizer's own, so they
    are replaced, never edited in place.
    """
    for p, idx in list(_torch_optimizer_expert_states(lit_module, opt_state)):
        old = opt_state["state"][idx]
        opt_state["state"][idx] = {k: fn(v, p) if _per_expert(v, p) else v for k, v in old.items()}


def _per_expert(value, p) -> bool:
    """exp_avg / exp_avg_sq of an expert param: [E_local or E, ...] (not the 0-d step)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[1:] == p.shape[1:]


def gather_full_experts(lit_module, checkpoint: dict, group, ep: int) -> None:
    """In place: expert tensors of `checkpoint` (weights, Adam moments) become all E experts."""
    state = checkpoint["state_dict"]
    for key in _expert_entries(lit_module):
        state[key] = _gather(state[key], group)
    for opt_state in checkpoint.get("optimizer_states", []):
        _replace_expert_moments(lit_module, opt_state, lambda t, p: _gather(t, group))
    checkpoint["expert_parallel"] = {"ep_saved": ep, "experts": "full"}


def slice_local_experts(lit_module, checkpoint: dict, group) -> None:
    """In place: full expert tensors of `checkpoint`'s state_dict become this rank's E/ep experts."""
    state = checkpoint["state_dict"]
    for key, p in _expert_entries(lit_module).items():
        if key in state:
            state[key] = _local_slice(state[key], p.shape[0], group)


def slice_local_optimizer_states(lit_module, checkpoint: dict, group) -> None:
    """In place: full expert Adam moments become this rank's; needs the optimizer built."""
    for opt_state in checkpoint.get("optimizer_states", []):
        _replace_expert_moments(lit_module, opt_state, lambda t, p: _local_slice(t, p.shape[0], group))
