"""The parallel layout, computed once from a validated config: world, tp, pp, ep, dp, expert-dp, ranks.

`Layout.from_config(cfg)` is what training, the backends, the dry-run planner and the metrics
read; nothing else derives the world size, the data-parallel degree or a rank's coordinates.

Rank order is neuronx-distributed's (parallel_layers/parallel_state.py): dense ranks are laid
out [PP, DP, TP] (TP fastest), experts [PP, DP_exp, EP, TP] with DP_exp * EP = DP, so an EP
group is `ep` consecutive members of a DP group. With tp = pp = 1 this is also DeepSpeed's
`_create_expert_and_data_parallel` order: EP groups are consecutive ranks (one node's GPUs),
expert-DP groups are `ep` apart (across nodes), as the 16-GPU MoE recipe lays out 2 nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


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


def world_of(cfg) -> int:
    """Devices the layout runs on: trainer.devices * trainer.num_nodes.

    A dry run or a simulation plans for the layout itself instead, so big presets can be
    inspected on one machine: tp*pp*dp when parallel.dp is pinned, else at least tp*pp*ep
    (the smallest world where EP fits inside DP, NxD's `world % (tp*pp*ep) == 0`).
    """
    trainer_world = cfg.trainer.devices * cfg.trainer.num_nodes
    if not planning(cfg):
        return trainer_world
    p = cfg.parallel
    if p.dp is not None:
        return p.tp * p.pp * p.dp
    return max(trainer_world, p.tp * p.pp * p.ep)


def planning(cfg) -> bool:
    """True for runs that plan a layout without launching it (dry_run, simulate)."""
    return bool(cfg.get("dry_run", False) or cfg.get("simulate", False))


def launch_overrides(world: int, devices_per_node: int) -> str:
    """The trainer overrides that give `world` devices on nodes of `devices_per_node`, fewest nodes first."""
    nodes = math.ceil(world / devices_per_node)
    if world % nodes:
        return f"{world} devices do not split evenly over nodes of {devices_per_node}"
    return f"trainer.devices={world // nodes} trainer.num_nodes={nodes}"


@dataclass(frozen=True)
class Layout:
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

    @classmethod
    def from_config(cls, cfg) -> Layout:
        p, t = cfg.parallel, cfg.trainer
        world = world_of(cfg)
        return cls(
            world=world, tp=p.tp, pp=p.pp, ep=p.ep, dp=p.dp if p.dp is not None else world // (p.tp * p.pp),
            sequence_parallel=bool(p.sequence_parallel and p.tp > 1), zero_stage=p.zero_stage,
            devices_per_node=cfg.hardware.devices_per_node, micro_batch_size=t.micro_batch_size,
            accumulate_grad_batches=t.accumulate_grad_batches, seq_len=cfg.data.seq_len,
            num_layers=cfg.model.num_layers, num_experts=cfg.model.num_experts,
            hybrid_shard_degree=p.hybrid_shard_degree,
        )

    # -- degrees and batch arithmetic ---------------------------------------------------------------
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

    # -- a rank's coordinates ([PP, DP, TP] dense; [PP, DP_exp, EP, TP] experts) ------------------
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

    # -- process groups --------------------------------------------------------------------------------
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
