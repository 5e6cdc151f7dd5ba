"""The one parallelize sequence: a model built on the meta device becomes this rank's part of it.

In torchtitan's order (torchtitan/models/*/infra/parallelize.py):

    expert parallelism -> token split over TP -> tensor parallelism -> load-balance group
        -> activation checkpointing -> compile -> sharding (FSDP2)
        -> materialize (storage and values for this rank's shards only)

Each backend says which steps apply with a `ParallelizePlan` (moe/backends): DDP and DeepSpeed expert
parallelism over their EP group; fsdp2 all of them on its DeviceMesh; the simulation
(moe/tools/simulate.py) the backend's own, on fake ranks, materialising fake tensors. NxD builds
its parallel layers while it builds the model (moe/backends/neuron/layers.py) and its own activation
checkpointing, so it does not come here.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from moe.config.schema import ModelConfig, ParallelConfig
from moe.parallel.apply import apply_ac, apply_compile, apply_ep, apply_load_balance_group, apply_token_shard
from moe.parallel.placement import materialize_distributed


@dataclass
class ParallelizePlan:
    """What a backend applies; None skips a step."""

    ep_group: Any = None  # expert parallelism over this group: experts sharded, the all-to-all dispatcher
    token_group: Any = None  # MoE layers split their tokens over it (the TP group: EP folded with TP)
    tp_mesh: Any = None  # DTensor tensor parallelism on this 1-D mesh (moe.parallel.tensor_parallel)
    sequence_parallel: bool = False  # activations between blocks split along the sequence over tp_mesh
    load_balance_group: Any = None  # routing statistics summed over it (moe_opt.aux_loss_group=dp)
    shard: Callable[[nn.Module], Any] | None = None  # FSDP2 (moe.parallel.fsdp.apply_fsdp with its meshes)
    device: Any = "cpu"  # where this rank's storage goes
    source: Callable | None = None  # initial values (name, shape, first_expert); None: moe.model.init's
    fake_mode: Any = None  # the simulation's FakeTensorMode: storage is fake


def parallelize(model: nn.Module, model_cfg: ModelConfig, parallel: ParallelConfig, tp: int,
                plan: ParallelizePlan) -> nn.Module:
    """Apply `plan` to `model` (built on the meta device from `model_cfg`) in the one order; returns it.
    `tp` is the tensor-parallel degree the materialised values are split for."""
    if plan.ep_group is not None:
        apply_ep(model, plan.ep_group)
    if plan.token_group is not None:
        apply_token_shard(model, plan.token_group, plan.sequence_parallel)
    if plan.tp_mesh is not None:
        from moe.parallel.tensor_parallel import apply_tp

        apply_tp(model, plan.tp_mesh, plan.sequence_parallel)
    if plan.load_balance_group is not None:
        apply_load_balance_group(model, plan.load_balance_group)
    apply_ac(model, parallel.activation_checkpointing, parallel.activation_checkpointing_every_n)
    if model_cfg.compile:
        apply_compile(model)
    if plan.shard is not None:
        plan.shard(model)
    if next(model.parameters()).is_meta:
        with plan.fake_mode or contextlib.nullcontext():
            materialize_distributed(model, plan.device, plan.source, model_cfg, tp)
    return model
