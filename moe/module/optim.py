"""AdamW with an optional no-decay group, and linear warmup into cosine decay to a floor."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def param_groups(model: nn.Module | Iterable[nn.Parameter], weight_decay: float,
                 no_decay_norms_and_biases: bool) -> list[dict]:
    """Split a model's (or these) parameters into decay and no-decay groups; 1-D tensors are norms and biases,
    and so are the experts' stacked biases ([E, width], marked `is_bias` by moe.model.moe.Experts).

    Each group carries a `name` (DeepSpeed's MoE group splitter needs one) and, through
    `param.is_expert`, stays splittable into expert and non-expert groups later.
    """
    decay, no_decay = [], []
    for p in model.parameters() if isinstance(model, nn.Module) else model:
        if not p.requires_grad:
            continue
        bias = p.ndim < 2 or getattr(p, "is_bias", False)
        (no_decay if no_decay_norms_and_biases and bias else decay).append(p)
    groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"name": "no_decay", "params": no_decay, "weight_decay": 0.0})
    return groups


FUSED_ADAMW_DEVICES = {"cpu", "cuda"}  # torch.optim.adamw: _fused_adamw_ kernels (also mps, xpu)


def build_optimizer(model: nn.Module, opt_cfg) -> torch.optim.Optimizer:
    """AdamW over `param_groups`, torch's fused kernel where the parameters' device has one (CPU, CUDA:
    one kernel for every tensor, 4.5x the per-tensor loop on CPU, docs/BENCHMARKS.md), else its default."""
    groups = param_groups(model, opt_cfg.weight_decay, opt_cfg.no_decay_norms_and_biases)
    devices = {p.device.type for group in groups for p in group["params"]}
    fused = devices <= FUSED_ADAMW_DEVICES or None
    return torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps, fused=fused)


def warmup_of(opt_cfg, max_steps: int) -> int:
    """optimizer.warmup_steps, or 10% of the decay horizon where it would not fit in it (a short run,
    e.g. trainer.max_steps=10 with the default 20: the learning rate would never reach optimizer.lr)."""
    horizon = opt_cfg.decay_steps or max_steps
    return opt_cfg.warmup_steps if opt_cfg.warmup_steps <= horizon else horizon // 10


def warmup_note(opt_cfg, max_steps: int) -> str | None:
    """What train.py prints when warmup_of clamped the warm-up."""
    warmup = warmup_of(opt_cfg, max_steps)
    if warmup == opt_cfg.warmup_steps:
        return None
    horizon = opt_cfg.decay_steps or max_steps
    return (f"note: optimizer.warmup_steps={opt_cfg.warmup_steps} is longer than the {horizon}-step "
            f"schedule; warming up over {warmup} steps (10%) instead")


def lr_at(step: int, opt_cfg, max_steps: int) -> float:
    """Learning rate after `step` optimizer steps: linear warmup, cosine to min_lr, then flat."""
    warmup = warmup_of(opt_cfg, max_steps)
    if warmup > 0 and step < warmup:
        return opt_cfg.lr * (step + 1) / warmup
    decay_steps = opt_cfg.decay_steps or max_steps
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return opt_cfg.min_lr + (opt_cfg.lr - opt_cfg.min_lr) * cosine


def fit_scheduler_states(checkpoint: dict, schedulers: list, opt_cfg, max_steps: int) -> None:
    """Let a checkpoint whose optimizer was grouped otherwise (DeepSpeed gives experts groups of their own;
    a run resumed under another backend) restore into these schedulers: the step is kept, every group's
    learning rate is the schedule's at that step (all groups share one schedule)."""
    for state, scheduler in zip(checkpoint.get("lr_schedulers", []), schedulers, strict=False):
        groups = scheduler.optimizer.param_groups
        if len(state.get("base_lrs", groups)) == len(groups):
            continue
        lr = lr_at(state["last_epoch"], opt_cfg, max_steps)
        state.update(base_lrs=[opt_cfg.lr] * len(groups), _last_lr=[lr] * len(groups),
                     lr_lambdas=[None] * len(groups))
        for group in groups:
            group["lr"] = lr


def build_scheduler(optimizer: torch.optim.Optimizer, opt_cfg, max_steps: int):
    """A per-step LambdaLR whose factor is `lr_at(step) / lr`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, opt_cfg, max_steps) / opt_cfg.lr
    )
