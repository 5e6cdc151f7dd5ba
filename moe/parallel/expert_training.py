"""Expert parallelism in training: groups, sharding, expert gradients and portable checkpoints.

`setup_expert_parallel(lit_module, ep)` runs in `LitMoE.configure_model`, after the process
group exists and before the strategy wraps the model:

1. EP and expert-DP groups: the strategy's own when it has them (`strategy.expert_groups(ep)`,
   DeepSpeed, so the token exchange and DeepSpeed's expert-gradient reduction share one EP
   group), else `moe.parallel.groups.build_expert_groups`.
2. `apply_ep`: each rank keeps its E/ep experts; every MoELayer exchanges tokens over the EP group.
3. Expert gradients under plain DDP (strategies without `reduces_expert_grads`): DDP is told
   to ignore expert parameters (`_ddp_params_and_buffers_to_ignore`, read when DDP wraps
   the module), and after the backward of an optimizer step's last micro-batch their grads
   are summed over the expert-DP group and divided by the data-parallel world size: the
   same average over ranks that DDP gives dense parameters (DeepSpeed does the same sum and
   division itself). Gradient clipping then uses the global norm (dense + all experts of
   the EP group) so every rank scales by the same factor and replicas stay identical.

Checkpoints stay portable: `ExpertParallelHooks.on_save_checkpoint` gathers every expert
tensor (and, for torch optimizers, its Adam moments) over the EP group, so `state_dict`
holds all E experts whatever ep was; `on_load_checkpoint` slices this rank's experts back
out. A checkpoint written with ep2 loads with ep1, ep2 or in `infer.py`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe.errors import ConfigError


def setup_expert_parallel(lit_module, ep: int) -> None:
    """Shard experts over `ep` ranks and make their gradients right (ep == 1: nothing to shard)."""
    apply_aux_loss_group(lit_module)
    if ep <= 1:
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() % ep:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        raise ConfigError("parallel.ep", ep,
                          f"launch a multiple of {ep} processes (e.g. trainer.devices={ep}), "
                          "or set parallel.ep=1",
                          problem=f"needs a multiple of {ep} processes but this run has {world}")
    from moe.parallel.apply import apply_ep
    from moe.parallel.groups import build_expert_groups

    strategy = lit_module._trainer.strategy if lit_module._trainer is not None else None
    make_groups = getattr(strategy, "expert_groups", None)
    ep_group, expert_dp_group = make_groups(ep) if make_groups else build_expert_groups(ep)
    apply_ep(lit_module.model, ep_group)
    lit_module.ep_group, lit_module.expert_dp_group, lit_module.ep_size = ep_group, expert_dp_group, ep
    if not getattr(strategy, "reduces_expert_grads", False):
        lit_module._ddp_params_and_buffers_to_ignore = expert_param_names(lit_module)
        lit_module.sync_expert_grads = True


def apply_aux_loss_group(lit_module) -> None:
    """moe_opt.aux_loss_group=dp: load-balance statistics over every data-parallel rank.

    Each MoE layer then computes f_i and P_i over the global batch (Megatron's global-batch
    balancing), so N ranks give the loss and gradients of one process holding all N
    micro-batches; with `ep` (the default) they cover the EP group only (one rank's tokens at ep=1).
    On DDP and DeepSpeed tp = pp = 1, so the data-parallel group is the world.
    """
    scope = getattr(lit_module.cfg.moe_opt, "aux_loss_group", "ep")
    if scope not in ("ep", "dp"):
        raise ConfigError("moe_opt.aux_loss_group", scope, "use ep (the expert-parallel group) or dp (all "
                          "data-parallel ranks)", problem="is not a load-balance group")
    if scope == "dp" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from moe.moe_layer import MoELayer

        for module in lit_module.model.modules():
            if isinstance(module, MoELayer):
                module.stats_group = dist.group.WORLD


def expert_param_names(module: torch.nn.Module) -> list[str]:
    """Names (as `named_parameters` spells them, the names DDP matches) of expert parameters."""
    return [name for name, p in module.named_parameters() if getattr(p, "is_expert", False)]


def expert_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "is_expert", False)]


def reduce_expert_grads(params: list[torch.nn.Parameter], expert_dp_group, dp_world_size: int) -> None:
    """Sum expert grads over the expert-DP group, divide by the data-parallel world size (one all-reduce)."""
    for p in params:
        if p.grad is None:  # no token reached these experts here: still join the all-reduce
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=expert_dp_group)
    flat.div_(dp_world_size)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def clip_to_global_norm(params, total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads by max_norm / (total_norm + 1e-6) when above max_norm, as clip_grad_norm_ does."""
    coef = torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))


# ----------------------------------------------------------------------------- checkpoints


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
    optimizers = lit_module.trainer.optimizers if lit_module._trainer is not None else []
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


def gather_full_experts(lit_module, checkpoint: dict) -> None:
    """In place: expert tensors of `checkpoint` (weights, Adam moments) become all E experts.

    Collective over the EP group: every rank calls it (Lightning runs on_save_checkpoint on all ranks).
    """
    group = lit_module.ep_group
    state = checkpoint["state_dict"]
    for key in _expert_entries(lit_module):
        state[key] = _gather(state[key], group)
    for opt_state in checkpoint.get("optimizer_states", []):
        _replace_expert_moments(lit_module, opt_state, lambda t, p: _gather(t, group))
    checkpoint["expert_parallel"] = {"ep_saved": lit_module.ep_size, "experts": "full"}


def slice_local_experts(lit_module, checkpoint: dict) -> None:
    """In place: full expert tensors of `checkpoint`'s state_dict become this rank's E/ep experts."""
    group = lit_module.ep_group
    state = checkpoint["state_dict"]
    for key, p in _expert_entries(lit_module).items():
        if key in state:
            state[key] = _local_slice(state[key], p.shape[0], group)


def slice_local_optimizer_states(lit_module, checkpoint: dict) -> None:
    """In place: full expert Adam moments become this rank's; needs the optimizer built."""
    for opt_state in checkpoint.get("optimizer_states", []):
        _replace_expert_moments(lit_module, opt_state,
                                lambda t, p: _local_slice(t, p.shape[0], lit_module.ep_group))


class ExpertParallelHooks:
    """LightningModule hooks that expert parallelism needs; mixed into LitMoE. Inert when ep == 1."""

    ep_group = None
    expert_dp_group = None
    ep_size = 1
    sync_expert_grads = False  # True under DDP + EP: this module reduces expert grads itself

    def on_after_backward(self) -> None:
        """After the last micro-batch's backward (DDP has just averaged the dense grads)."""
        if not self.sync_expert_grads or self.trainer.fit_loop.epoch_loop._should_accumulate():
            return
        reduce_expert_grads(expert_params(self), self.expert_dp_group, dist.get_world_size())

    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Norm clipping with the global norm under DDP + EP; Lightning's own clipping otherwise."""
        if not self.sync_expert_grads or not gradient_clip_val or gradient_clip_algorithm == "value":
            return super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        clip_to_global_norm(self.parameters(), self.grad_norm(), float(gradient_clip_val))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.ep_group is not None:
            gather_full_experts(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Weights now; optimizer moments once the optimizer exists (DDP restores weights before it)."""
        if self.ep_group is None:
            return
        slice_local_experts(self, checkpoint)
        if self.trainer.optimizers:
            slice_local_optimizer_states(self, checkpoint)
        else:
            self._checkpoint_to_slice = checkpoint  # the dict Lightning restores optimizers from later

    def on_fit_start(self) -> None:
        checkpoint = self.__dict__.pop("_checkpoint_to_slice", None)
        if checkpoint is not None:
            slice_local_optimizer_states(self, checkpoint)
