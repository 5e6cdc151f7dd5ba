"""The DeviceMesh of the torch-native backend (hardware.strategy=fsdp2), from the run's Layout.

One world mesh, torchtitan's shape (torchtitan/distributed/parallel_dims.py): dims
`dp_replicate x dp_shard_mod_ep x ep x tp`, tp fastest. Its rank order is the Layout's (dense
ranks [DP, TP], DP = expert-DP x EP with EP consecutive), so the EP and expert-DP groups are those
of every other backend. Sub-meshes, each flattened from the world mesh (FSDP2 and the TP styles
need one root mesh):

    dense     FSDP2 of attention, dense MLPs, norms, router, embeddings: every data-parallel rank,
              2-D (dp_replicate, dp_shard) for HSDP when parallel.hybrid_shard_degree is set
    experts   FSDP2 of each rank's experts: every rank that holds the same experts, i.e. its expert-DP
              ranks and its TP group (experts are not split by TP; every TP rank computes them on the
              same tokens, so FSDP2 shards their storage over the TP ranks too), 2-D
              (dp_replicate, expert_shard) under HSDP
    ep        the all-to-all of tokens
    tp        DTensor tensor parallelism of attention and dense MLPs

The shard group of HSDP holds whole EP groups (ep divides hybrid_shard_degree), as torchtitan
requires, so an expert's replicas are sharded inside a node-sized group and replicated across them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from moe.config.layout import Layout


@dataclass
class Meshes:
    world: object  # DeviceMesh (dp_replicate, dp_shard_mod_ep, ep, tp)
    dense: object  # 1-D "dp" or 2-D ("dp_replicate", "dp_shard")
    experts: object  # 1-D "expert_shard" or 2-D ("dp_replicate", "expert_shard")
    ep: object  # 1-D "ep"
    tp: object  # 1-D "tp"
    dp: object  # 1-D "data_parallel": every data-parallel rank (statistics, Lightning's sampler size)


def mesh_shape(layout: Layout) -> dict[str, int]:
    """Sizes of the world mesh's dims: dp = dp_replicate * dp_shard_mod_ep * ep."""
    shard = layout.hybrid_shard_degree or layout.dp
    return {"dp_replicate": layout.dp // shard, "dp_shard_mod_ep": shard // layout.ep, "ep": layout.ep,
            "tp": layout.tp}


def build_meshes(layout: Layout, device_type: str) -> Meshes:
    """Collective: every rank builds the same meshes in the same order."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(layout)
    world = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    dp = world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("data_parallel")
    if layout.hybrid_shard_degree:
        world["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        world["dp_shard_mod_ep", "tp"]._flatten("expert_shard")
        with warnings.catch_warnings():  # torchtitan's 2-D HSDP mesh; torch 2.13 warns it will change
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            dense = world["dp_replicate", "dp_shard"]
            experts = world["dp_replicate", "expert_shard"]
    else:
        dense = dp
        experts = world["dp_replicate", "dp_shard_mod_ep", "tp"]._flatten("expert_shard")
    return Meshes(world=world, dense=dense, experts=experts, ep=world["ep"], tp=world["tp"], dp=dp)
