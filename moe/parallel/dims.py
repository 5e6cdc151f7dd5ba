"""ParallelDims: every degree of a run's layout, computed once, and the process groups and meshes it implies.

Built once from the validated config (`ParallelDims.from_config(cfg)`, after moe.config.validate's rules:
moe.train.run.settle) and handed to everything that needs a degree, a rank's coordinates or a group: the
backends, the data module, the planner, the simulation, checkpoints. Nothing else derives a degree
(torchtitan's ParallelDims is the model).

Dense ranks are laid out [PP, DP, TP] (TP fastest) on every backend. Experts:

- neuronx-distributed (parallel_layers/parallel_state.py): [PP, DP_exp, EP, TP] with DP_exp * EP = DP,
  so an EP group is `ep` consecutive members of a DP group, and every TP rank of it holds TP-split
  experts.
- folded (the torch-native backend, `ep_folds_tp`): [PP, DP_exp, EP] over the flat DP x TP ranks, as
  torchtitan's sparse mesh (torchtitan 0.3.0 distributed/parallel_dims.py:292-330: dense
  (pp, dp_replicate, fsdp, tp), sparse (pp, dp_replicate, efsdp, ep), efsdp = fsdp * tp / ep) and
  Megatron-Core's "parallel folding": an EP group is `ep` consecutive ranks, whole TP groups when
  tp divides ep. The MoE layer splits its tokens over the TP group first (moe.parallel.token_shard), so
  every rank routes different tokens and no expert multiplies a token twice; TP and then EP stay
  inside a node.

With tp = pp = 1 both are DeepSpeed's `_create_expert_and_data_parallel` order: EP groups are
consecutive ranks (one node's GPUs), expert-DP groups are `ep` apart (across nodes), as the 16-GPU
MoE recipe lays out 2 nodes.

Once the default process group exists, `expert_groups()` makes the EP and expert-DP groups (DDP and
DeepSpeed with EP), `meshes(device_type)` the torch-native backend's DeviceMesh (fsdp2) and
`checkpoint_mesh(device_type)` the 1-D mesh a sharded checkpoint is written on, each collectively and once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moe.backends.registry import spec_of
from moe.config.derived import (
    data_parallel_size,
    expert_dp_size,
    layers_per_stage,
    planning,
    stages_per_rank,
    world_of,
)


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

    world    (pp, dp_replicate, dp_shard, tp), tp fastest: the dense view of the ranks
    sparse   (pp, dp_replicate, efsdp, ep), ep fastest: the experts' view of the same ranks (folded order)
    pp       the pipeline's point-to-point group (a rank's peers holding the other stages)
    dense    FSDP2 of attention, dense MLPs, norms, router, embeddings: every data-parallel rank,
             2-D (dp_replicate, dp_shard) for HSDP when parallel.hybrid_shard_degree is set
    experts  FSDP2 of each rank's experts: the ranks holding the same experts (efsdp), 2-D
             (dp_replicate, efsdp) under HSDP
    ep, tp   the all-to-all of tokens; DTensor tensor parallelism (and the MoE's token split)
    dp       every data-parallel rank (Lightning's sampler size)
    tokens   every rank of the stage: ranks whose MoE tokens differ (routing statistics over dp)

    Every view but `world`, `sparse` and `pp` is this rank's pipeline stage's (the pp coordinate fixed).

    The shard group of HSDP holds whole EP groups (ep divides hybrid_shard_degree * tp), as torchtitan
    requires, so an expert's replicas are sharded inside a node-sized group and replicated across them.
    """

    world: Any
    sparse: Any
    dense: Any
    experts: Any
    ep: Any
    tp: Any
    dp: Any
    tokens: Any
    pp: Any


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
    pp_schedule: str = "1F1B"  # the torch-native backend's pipeline schedule (torch.distributed.pipelining)
    pp_stages_per_rank: int = 1  # pipeline stages each pp rank holds (2 for the interleaved schedules)
    ep_folds_tp: bool = False  # experts in the folded order (module docstring): the torch-native backend
    _built: dict = field(default_factory=dict, repr=False)  # process groups and meshes, once made

    @classmethod
    def from_config(cls, cfg) -> ParallelDims:
        """The run's dims: its parallel section, the world it plans for, and the few facts of the other
        sections the layout arithmetic needs."""
        t, m = cfg.trainer, cfg.model
        return cls.of(cfg.parallel, world_of(t, cfg.parallel, planning(cfg.dry_run, cfg.simulate)),
                      devices_per_node=cfg.hardware.devices_per_node, micro_batch_size=t.micro_batch_size,
                      accumulate_grad_batches=t.accumulate_grad_batches, seq_len=cfg.data.seq_len,
                      num_layers=m.num_layers, num_experts=m.num_experts,
                      ep_folds_tp=spec_of(cfg.hardware).ep_folds_tp)

    @classmethod
    def of(cls, parallel, world: int, *, devices_per_node: int, micro_batch_size: int,
           accumulate_grad_batches: int, seq_len: int, num_layers: int, num_experts: int,
           ep_folds_tp: bool) -> ParallelDims:
        """The dims of the `parallel` section on `world` devices."""
        p = parallel
        return cls(
            world=world, tp=p.tp, pp=p.pp, ep=p.ep, dp=data_parallel_size(p, world),
            sequence_parallel=bool(p.sequence_parallel and p.tp > 1), zero_stage=p.zero_stage,
            devices_per_node=devices_per_node, micro_batch_size=micro_batch_size,
            accumulate_grad_batches=accumulate_grad_batches, seq_len=seq_len, num_layers=num_layers,
            num_experts=num_experts, hybrid_shard_degree=p.hybrid_shard_degree, ep_folds_tp=ep_folds_tp,
            pp_schedule=p.pp_schedule,
            pp_stages_per_rank=stages_per_rank(p.pp_schedule, p.pp_stages_per_rank),
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

    # -- degrees and batch arithmetic -------------------------------------------------------------------
    @property
    def expert_dp(self) -> int:
        return expert_dp_size(self.dp, self.tp, self.ep, self.ep_folds_tp)

    @property
    def moe_token_split(self) -> int:
        """Ranks each MoE layer's tokens are split over before dispatch: tp when EP folds TP, else 1."""
        return self.tp if self.ep_folds_tp else 1

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
        return layers_per_stage(self.num_layers, self.pp)

    # -- pipeline stages (the torch-native backend; NxD places its own) ---------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.pp_stages_per_rank

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        """The stages a pp rank runs, looped as torchtitan places them (distributed/pipeline_parallel.py:
        541-578): stage s on rank s mod pp."""
        return tuple(pp_rank + s * self.pp for s in range(self.pp_stages_per_rank))

    def stage_layers(self, stage: int) -> range:
        """The layers of a stage: num_layers / num_stages consecutive ones (validation makes it exact)."""
        per = self.num_layers // self.num_stages
        return range(stage * per, (stage + 1) * per)

    # -- a rank's coordinates ([PP, DP, TP]; experts [PP, DP_exp, EP, TP], folded [PP, DP_exp, EP]) --
    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp % self.dp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.dp)

    def _expert_index(self, rank: int) -> int:
        """Position among the ranks of the stage that EP is carved from: DP x TP folded, else DP."""
        return rank % (self.dp * self.tp) if self.ep_folds_tp else self.dp_rank(rank)

    def ep_rank(self, rank: int) -> int:
        return self._expert_index(rank) % self.ep

    def expert_dp_rank(self, rank: int) -> int:
        return self._expert_index(rank) // self.ep

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
        expert_tp = (lambda r: ()) if self.ep_folds_tp else (lambda r: (tp(r),))  # folded: TP inside EP
        return [
            RankGroups("TP", self._members(lambda r: (pp(r), dp(r)))),
            RankGroups("PP", self._members(lambda r: (dp(r), tp(r)))),
            RankGroups("DP", self._members(lambda r: (pp(r), tp(r)))),
            RankGroups("EP", self._members(lambda r: (pp(r), self.expert_dp_rank(r), *expert_tp(r)))),
            RankGroups("expert-DP", self._members(lambda r: (pp(r), self.ep_rank(r), *expert_tp(r)))),
        ]

    def nodes_spanned(self, ranks: list[int]) -> int:
        """How many nodes (hardware.devices_per_node consecutive ranks each) a group's ranks sit on."""
        return len({r // self.devices_per_node for r in ranks})

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
        """Sizes of the dense mesh's dims (dp = dp_replicate * dp_shard) and the sparse one's
        (dp * tp = dp_replicate * efsdp * ep), torchtitan's names."""
        shard = self.hybrid_shard_degree or self.dp
        return {"dp_replicate": self.dp // shard, "dp_shard": shard, "tp": self.tp,
                "efsdp": shard * self.tp // self.ep, "ep": self.ep}

    def meshes(self, device_type: str) -> Meshes:
        """The DeviceMesh views and their sub-meshes (Meshes): one 1-D mesh of every rank unflattened into
        the dense and the sparse view, as torchtitan builds them (distributed/parallel_dims.py:292-330).
        Collective the first time: every rank builds the same meshes in the same order."""
        if "meshes" not in self._built:
            from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

            if not hasattr(DeviceMesh, "_unflatten"):  # torch < 2.10
                self._built["meshes"] = self._flattened_meshes(device_type)
                return self._built["meshes"]
            shape = self.mesh_shape()
            flat = init_device_mesh(device_type, (self.world,), mesh_dim_names=("world",))
            world = flat._unflatten(0, (self.pp, shape["dp_replicate"], shape["dp_shard"], self.tp),
                                    ("pp", "dp_replicate", "dp_shard", "tp"))
            sparse = flat._unflatten(0, (self.pp, shape["dp_replicate"], shape["efsdp"], self.ep),
                                     ("pp", "dp_replicate", "efsdp", "ep"))
            dp = world["dp_replicate", "dp_shard"]._flatten("data_parallel")
            tokens = world["dp_replicate", "dp_shard", "tp"]._flatten("stage")
            if self.hybrid_shard_degree:
                dense, experts = world["dp_replicate", "dp_shard"], sparse["dp_replicate", "efsdp"]
            else:
                dense, experts = dp, sparse["dp_replicate", "efsdp"]._flatten("expert_shard")
            self._built["meshes"] = Meshes(world=world, sparse=sparse, dense=dense, experts=experts,
                                           ep=sparse["ep"], tp=world["tp"], dp=dp, tokens=tokens,
                                           pp=world["pp"])
        return self._built["meshes"]

    def checkpoint_mesh(self, device_type: str):
        """A 1-D DeviceMesh of every rank, on which a sharded checkpoint declares its canonical DTensors
        (moe.checkpoint.sharded). Collective the first time (every rank, at its first save or load)."""
        if "checkpoint_mesh" not in self._built:
            from torch.distributed.device_mesh import init_device_mesh

            self._built["checkpoint_mesh"] = init_device_mesh(device_type, (self.world,),
                                                              mesh_dim_names=("checkpoint",))
        return self._built["checkpoint_mesh"]

    def forget_world(self) -> None:
        """Drop the process groups and meshes made so far: their world has ended (destroy_process_group), and
        a later world in this process (a multirun of simulations; settle returns one ParallelDims per
        config) must build its own, not name groups that world never registered."""
        self._built.clear()

    def _flattened_meshes(self, device_type: str) -> Meshes:
        """The same views on torch without DeviceMesh._unflatten (2.9, trn1's and older GPU images'): one mesh
        of the finest dims both views share, each view flattened from it, as torchtitan built them before
        _unflatten (v0.1.0 torchtitan/distributed/parallel_dims.py _build_mesh_with_ep: dp_shard split into
        dp_shard_mod_ep x dp_shard_in_ep). EP spans whole TP groups (ep a multiple of tp: dp_shard = efsdp x
        ep/tp) or lies inside each (tp a multiple of ep: tp = tp/ep x ep), which validation guarantees."""
        from torch.distributed.device_mesh import init_device_mesh

        shape, tp, ep = self.mesh_shape(), self.tp, self.ep
        if ep % tp == 0:
            fine = {"efsdp": shape["efsdp"], "ep_in_dp": ep // tp, "tp": tp}
            dp_shard, efsdp, ep_dims, tp_dims = ("efsdp", "ep_in_dp"), ("efsdp",), ("ep_in_dp", "tp"), ("tp",)
        else:
            fine = {"dp_shard": shape["dp_shard"], "tp_out_ep": tp // ep, "ep": ep}
            dp_shard, efsdp = ("dp_shard",), ("dp_shard", "tp_out_ep")
            ep_dims, tp_dims = ("ep",), ("tp_out_ep", "ep")
        fine = {"pp": self.pp, "dp_replicate": shape["dp_replicate"], **fine}
        mesh = init_device_mesh(device_type, tuple(fine.values()), mesh_dim_names=tuple(fine))

        def view(names: tuple[str, ...], flat_name: str):
            return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten(flat_name)

        dp = view(("dp_replicate", *dp_shard), "data_parallel")
        if self.hybrid_shard_degree:
            for names, flat_name in ((dp_shard, "dp_shard"), (efsdp, "efsdp")):
                view(names, flat_name)  # a name of the root mesh, for the 2-D slices below
            dense, experts = mesh["dp_replicate", "dp_shard"], mesh["dp_replicate", "efsdp"]
        else:
            dense, experts = dp, view(("dp_replicate", *efsdp), "expert_shard")
        tokens = view(("dp_replicate", *dp_shard, *tp_dims), "stage")
        return Meshes(world=mesh, sparse=mesh, dense=dense, experts=experts, ep=view(ep_dims, "ep"),
                      tp=view(tp_dims, "tp"), dp=dp, tokens=tokens, pp=mesh["pp"])

