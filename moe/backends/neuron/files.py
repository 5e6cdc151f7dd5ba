"""The files of a neuronx-distributed checkpoint directory, readable without NxD.

`nxd.save_checkpoint(dir, tag, ...)` (neuronx-distributed v2.28.0,
src/neuronx_distributed/trainer/checkpoint.py:654-835) writes `<dir>/<tag>/`:
model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt (one per tensor- and pipeline-parallel rank;
`_get_path`, :54-63), with expert parallelism model/dp_rank_00_ep_rank_EE_tp_rank_TT_pp_rank_PP.pt
(one per expert-, tensor- and pipeline-parallel rank, written by the first rank of each
expert-data-parallel group, :793-808: every file holds the dense tensors and that EP rank's
experts), optim/..., user_content.pt (rank 0) and, once every rank has finished, `done`
(:175-238). Our tags are the checkpoint names (`step-000100.ckpt`), so a checkpoint is a directory.
Files are plain torch.save (moe.backends.neuron.strategy saves with use_xser=False).

`read_checkpoint` puts one back together as the Lightning checkpoint the other backends write
(state_dict `model.<our name>` of full tensors, hyper_parameters, global_step), so inference,
export and moe/tools/consolidate.py read trn1 runs like any other. It holds the whole model in
host memory once (Mixtral 8x7B: 93 GB in bf16; a trn1.32xlarge has 512 GiB).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from omegaconf import OmegaConf

from moe.backends.neuron.shards import EXPERT_TENSORS, full_tensor, layout_of, our_name

DONE = "done"
USER_CONTENT = "user_content.pt"
MODEL_SHARD = re.compile(r"dp_rank_00(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt")
SPMD_RANK = "spmd_rank."  # NxD's SPMDRank under EP (moe/backends/neuron/layers.py): ranks, not weights


def model_shard(checkpoint_dir: Path, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> Path:
    """The model file of one (EP,) TP and PP rank; ep_rank None: a checkpoint without expert parallelism."""
    ep = "" if ep_rank is None else f"_ep_rank_{ep_rank:02d}"
    return Path(checkpoint_dir) / "model" / f"dp_rank_00{ep}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"


def optimizer_shard(checkpoint_dir: Path, dp_rank: int, tp_rank: int, pp_rank: int) -> Path:
    """A ZeRO-1 optimizer file: one per data-, tensor- and pipeline-parallel rank (`_get_path("optim",
    dp=True)`, trainer/checkpoint.py:54-63, :763-769)."""
    name = f"dp_rank_{dp_rank:02d}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"
    return Path(checkpoint_dir) / "optim" / name


def is_complete(checkpoint_dir: Path) -> bool:
    """An NxD checkpoint directory every rank finished writing."""
    return (Path(checkpoint_dir) / DONE).is_file() and (Path(checkpoint_dir) / USER_CONTENT).is_file()


def newest_complete(checkpoints_dir: Path) -> Path | None:
    """The complete NxD checkpoint of the highest step in a run's checkpoints/ folder, if any."""
    found = [p for p in Path(checkpoints_dir).glob("*.ckpt") if p.is_dir() and is_complete(p)]
    return max(found, key=lambda p: int(torch.load(p / USER_CONTENT, weights_only=False)["global_step"]),
               default=None)


def read_checkpoint(checkpoint_dir: Path) -> dict:
    """The checkpoint as one Lightning checkpoint dict with full (unsharded) tensors."""
    checkpoint_dir = Path(checkpoint_dir)
    ckpt = torch.load(checkpoint_dir / USER_CONTENT, map_location="cpu", weights_only=False)
    model_cfg = OmegaConf.create(ckpt["hyper_parameters"]["cfg"]["model"])
    shards: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # our name -> (ep rank, tp rank) -> shard
    for path in sorted((checkpoint_dir / "model").glob("*.pt")):
        match = MODEL_SHARD.fullmatch(path.name)
        if match is None:
            raise ValueError(f"{path}: not a model shard of a neuronx-distributed checkpoint")
        ep_rank, tp_rank = int(match.group(1) or 0), int(match.group(2))
        for name, tensor in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items():
            if SPMD_RANK not in name:
                shards.setdefault(our_name(name), {})[ep_rank, tp_rank] = tensor
    ckpt["state_dict"] = {f"model.{name}": _join(by_rank, layout_of(name, model_cfg),
                                                 name.endswith(EXPERT_TENSORS))
                          for name, by_rank in shards.items()}
    return ckpt



def _join(by_rank: dict[tuple[int, int], torch.Tensor], layout, experts: bool) -> torch.Tensor:
    """The full tensor from its shards: TP pieces joined by `full_tensor`, then for expert tensors the
    EP ranks' experts in rank order (dense tensors are the same in every EP rank's file)."""
    ep_ranks = sorted({ep for ep, _ in by_rank}) if experts else [0]
    tp_ranks = sorted({tp for _, tp in by_rank})
    per_ep = [full_tensor([by_rank[ep, tp] for tp in tp_ranks], layout) for ep in ep_ranks]
    return torch.cat(per_ep) if experts else per_ep[0]
