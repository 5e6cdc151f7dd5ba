"""ParallelDims: every degree of a run's layout, computed once, and the process groups and meshes it implies.

Built once from the validated config (`ParallelDims.from_config(cfg)`, or `validated_dims(cfg)` which
validates first) and handed to everything that needs a degree, a rank's coordinates or a group: the
backends, the data module, the planner, the simulation, checkpoints. Nothing else derives a degree
(torchtitan's ParallelDims is the model).

Rank order is neuronx-distributed's (parallel_layers/parallel_state.py): dense ranks are laid
out [PP, DP, TP] (TP fastest), experts [PP, DP_exp, EP, TP] with DP_exp * EP = DP, so an EP
group is `ep` consecutive members of a DP group. With tp = pp = 1 this is also DeepSpeed's
`_create_expert_and_data_parallel` order: EP groups are consecutive ranks (one node's GPUs),
expert-DP groups are `ep` apart (across nodes), as the 16-GPU MoE recipe lays out 2 nodes.

Once the default process group exists, `expert_groups()` makes the EP and expert-DP groups (DDP and
DeepSpeed with EP) and `meshes(device_type)` the torch-native backend's DeviceMesh (fsdp2), each
collectively and once.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from moe.config.derived import data_parallel_size, world_of
from moe.config.validate import validate


@dataclass(frozen=True)
class RankGroups:
    """One kind of process group: its size, how many there are, and every group's ranks."""

    name: str
    ranks: list[list[int]]

    @property
    def size(self) -> int:
        return len(self.ranks[0])

    @property
    def count(self) -> int:
        return len(self.ranks)


@dataclass
class ExpertGroups:
    """This rank's expert-parallel group (token all-to-all) and expert-data-parallel group (grad sum)."""

    ep: Any
    expert_dp: Any


@dataclass
class Meshes:
    """The torch-native backend's DeviceMesh (torchtitan's dims) and the sub-meshes each step uses.

    world    (dp_replicate, dp_shard_mod_ep, ep, tp), tp fastest: its EP and expert-DP groups are
             the rank order's above, those of every other backend
    dense    FSDP2 of attention, dense MLPs, norms, router, embeddings: every data-parallel rank,
             2-D (dp_replicate, dp_shard) for HSDP when parallel.hybrid_shard_degree is set
    experts  FSDP2 of each rank's experts: the ranks holding the same experts (its expert-DP ranks
             and its TP group; experts are whole on every TP rank, so FSDP2 shards their storage
             over the TP ranks too), 2-D (dp_replicate, expert_shard) under HSDP
    ep, tp   the all-to-all of tokens; DTensor tensor parallelism
    dp       every data-parallel rank (statistics, Lightning's sampler size)

    The shard group of HSDP holds whole EP groups (ep divides hybrid_shard_degree), as torchtitan
    requires, so an expert's replicas are sharded inside a node-sized group and replicated across them.
    """

    world: Any
    dense: Any
    experts: Any
    ep: Any
    tp: Any
    dp: Any


@dataclass(eq=False)
class ParallelDims:
    world: int
    tp: int
    pp: int
    ep: int
    dp: int  # every data-parallel rank: world / (tp * pp); EP is carved out of it
    sequence_parallel: bool
    zero_stage: int
    devices_per_node: int
    micro_batch_size: int
    accumulate_grad_batches: int
    seq_len: int
    num_layers: int
    num_experts: int
    hybrid_shard_degree: int | None = None  # HSDP: shard within groups of this many data-parallel ranks
    _built: dict = field(default_factory=dict, repr=False)  # process groups and meshes, once made

    @classmethod
    def from_config(cls, cfg) -> ParallelDims:
        p, t = cfg.parallel, cfg.trainer
        return cls(
            world=world_of(cfg), tp=p.tp, pp=p.pp, ep=p.ep, dp=data_parallel_size(cfg),
            sequence_parallel=bool(p.sequence_parallel and p.tp > 1), zero_stage=p.zero_stage,
            devices_per_node=cfg.hardware.devices_per_node, micro_batch_size=t.micro_batch_size,
            accumulate_grad_batches=t.accumulate_grad_batches, seq_len=cfg.data.seq_len,
            num_layers=cfg.model.num_layers, num_experts=cfg.model.num_experts,
            hybrid_shard_degree=p.hybrid_shard_degree,
        )

    # -- which dimensions are on ----------------------------------------------------------------------
    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    # -- degrees and batch arithmetic -------------------------------------------------------------------
    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: dp / ep (the 16-GPU recipe's "DP 2" at EP 8)."""
        return self.dp // self.ep

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.devices_per_node)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch_size * self.accumulate_grad_batches * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    @property
    def layers_per_stage(self) -> int:
        return math.ceil(self.num_layers / self.pp)

    # -- a rank's coordinates ([PP, DP, TP] dense; [PP, DP_exp, EP, TP] experts) ------------------------
    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp % self.dp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.dp)

    def ep_rank(self, rank: int) -> int:
        return self.dp_rank(rank) % self.ep

    def expert_dp_rank(self, rank: int) -> int:
        return self.dp_rank(rank) // self.ep

    def first_expert(self, rank: int) -> int:
        """Index of the first of this rank's experts_per_rank experts."""
        return self.ep_rank(rank) * self.experts_per_rank

    # -- process groups, as lists of ranks --------------------------------------------------------------
    def _members(self, keep) -> list[list[int]]:
        """Ranks grouped by every coordinate but the ones `keep(rank)` varies over."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            groups.setdefault(keep(rank), []).append(rank)
        return list(groups.values())

    def rank_groups(self) -> list[RankGroups]:
        """Every kind of group, each as the full list of its groups' ranks (ranks ascending)."""
        tp, dp, pp = self.tp_rank, self.dp_rank, self.pp_rank
        return [
            RankGroups("TP", self._members(lambda r: (pp(r), dp(r)))),
            RankGroups("PP", self._members(lambda r: (dp(r), tp(r)))),
            RankGroups("DP", self._members(lambda r: (pp(r), tp(r)))),
            RankGroups("EP", self._members(lambda r: (pp(r), self.expert_dp_rank(r), tp(r)))),
            RankGroups("expert-DP", self._members(lambda r: (pp(r), self.ep_rank(r), tp(r)))),
        ]

    def group(self, name: str) -> RankGroups:
        return next(g for g in self.rank_groups() if g.name == name)

    # -- the process groups themselves, once the default group exists ------------------------------------
    def expert_groups(self) -> ExpertGroups:
        """This rank's EP and expert-DP groups. Collective the first time: every rank creates every group,
        in the same order (expert-DP groups first, then EP groups, as DeepSpeed's
        `_create_expert_and_data_parallel` does). With 16 ranks and ep 8: EP [0..7], [8..15] (inside a
        node), expert-DP [0, 8], [1, 9], ..., [7, 15] (across nodes)."""
        if "expert_groups" not in self._built:
            import torch.distributed as dist

            rank, mine = dist.get_rank(), {}
            for kind in ("expert-DP", "EP"):
                for ranks in self.group(kind).ranks:
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[kind] = group
            self._built["expert_groups"] = ExpertGroups(ep=mine["EP"], expert_dp=mine["expert-DP"])
        return self._built["expert_groups"]

    def mesh_shape(self) -> dict[str, int]:
        """Sizes of the world mesh's dims: dp = dp_replicate * dp_shard_mod_ep * ep."""
        shard = self.hybrid_shard_degree or self.dp
        return {"dp_replicate": self.dp // shard, "dp_shard_mod_ep": shard // self.ep, "ep": self.ep,
                "tp": self.tp}

    def meshes(self, device_type: str) -> Meshes:
        """The DeviceMesh and its sub-meshes (Meshes). Collective the first time: every rank builds the
        same meshes in the same order."""
        if "meshes" not in self._built:
            from torch.distributed.device_mesh import init_device_mesh

            shape = self.mesh_shape()
            world = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
            dp = world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("data_parallel")
            if self.hybrid_shard_degree:
                world["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
                world["dp_shard_mod_ep", "tp"]._flatten("expert_shard")
                with warnings.catch_warnings():  # torchtitan's 2-D HSDP mesh; torch 2.13 warns it will change
                    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
                    dense = world["dp_replicate", "dp_shard"]
                    experts = world["dp_replicate", "expert_shard"]
            else:
                dense = dp
                experts = world["dp_replicate", "dp_shard_mod_ep", "tp"]._flatten("expert_shard")
            self._built["meshes"] = Meshes(world=world, dense=dense, experts=experts, ep=world["ep"],
                                           tp=world["tp"], dp=dp)
        return self._built["meshes"]


def validated_dims(cfg) -> ParallelDims:
    """Every rule of moe.config.validate, then the run's ParallelDims."""
    validate(cfg)
    return ParallelDims.from_config(cfg)
