"""neuronx-distributed's (trn1) checkpoint format, readable without NxD: its files, how each tensor
of our model is split over its tensor- and expert-parallel ranks, and `NxD`, the Format the checkpoint
layer reads it through (registered with moe.checkpoint.formats by moe.backends.checkpoint_formats).

`nxd.save_checkpoint(dir, tag, ...)` (neuronx-distributed v2.28.0,
src/neuronx_distributed/trainer/checkpoint.py:654-835) writes `<dir>/<tag>/`:
model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt (one per tensor- and pipeline-parallel rank;
`_get_path`, :54-63), with expert parallelism model/dp_rank_00_ep_rank_EE_tp_rank_TT_pp_rank_PP.pt
(one per expert-, tensor- and pipeline-parallel rank, written by the first rank of each
expert-data-parallel group, :793-808: every file holds the dense tensors and that EP rank's
experts), optim/..., user_content.pt (rank 0) and, once every rank has finished, `done`
(:175-238). Our tags are the checkpoint names (`step-000100.ckpt`), so a checkpoint is a directory.
Files are plain torch.save (`NxD` saves with use_xser=False).

A parameter's `Split` is (dim, groups): the full tensor is cut along `dim` into consecutive groups
(e.g. [q | k | v] rows of the fused qkv weight, [gate | up] columns of an expert), each group is
split into tp contiguous pieces, and rank r holds its piece of every group, concatenated. Splits are of
NxD's tensors: experts in NXD_LAYOUT, converted from and to ours (moe.model.expert_layout) on read. With
equal groups this is NxD's `create_local_weight(full, partition_dim, per_partition_size, stride)`
with stride = the number of groups (neuronx_distributed/parallel_layers/layers.py:88-107, v2.28.0):
chunks rank::tp of the full weight cut into stride * tp pieces. Unequal groups (GQA's q and kv)
have no NxD stride equivalent; the fused qkv layer's forward splits its local output by the
local sizes (moe.model.model.Attention), so only our own code reads that layout. Pure tensor
arithmetic, shared by the parameter initialisation on trn1 (each rank builds only its shard of the
full value, moe/backends/neuron/layers.py) and `read_checkpoint` (shards -> full tensors).

Names: our state-dict names (moe.model.model.MoETransformer) and, under NxD, the names of the same
tensors in `NxDCausalLM` (moe/backends/neuron/causal_lm.py), where the model sits under `model.`
and the MoE layer's tensors are NxD's own (neuronx_distributed/modules/moe: router.linear_router,
expert_mlps.mlp_op.gate_up_proj / down_proj).

`read_checkpoint` puts a checkpoint back together as the Lightning checkpoint the other backends write
(state_dict `model.<our name>` of full tensors, hyper_parameters, global_step), so inference,
export and consolidation read trn1 runs like any other. It holds the whole model in host memory
once (Mixtral 8x7B: 93 GB in bf16; a trn1.32xlarge has 512 GiB).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from moe.checkpoint.formats import Format, Live, lightning_state, load
from moe.checkpoint.io import CorruptCheckpoint
from moe.checkpoint.trust import load_trusted
from moe.config.derived import dense_width, head_dim_of
from moe.model.expert_layout import EXPERT_LAYOUT, IN_OUT, LAYOUT_KEY, upgraded_checkpoint

# our name suffix -> the NxD MoE module's name for the same tensor (experts: gate_up, down)
MOE_NAMES = {
    "ffn.router.weight": "ffn.moe.router.linear_router.weight",
    "ffn.router.bias": "ffn.moe.router.linear_router.bias",  # model.router_bias: RouterTopK(bias=True)
    **dict(zip(EXPERT_LAYOUT.suffixes, ("ffn.moe.expert_mlps.mlp_op.gate_up_proj.weight",
                                        "ffn.moe.expert_mlps.mlp_op.down_proj.weight"), strict=True)),
}
PREFIX = "model."  # NxDCausalLM.model
# stacked [E / ep, ...] expert tensors (our names): expert-parallel ranks hold consecutive experts
EXPERT_TENSORS = EXPERT_LAYOUT.layer_names
# NxD's expert weights are [E, in, out] whatever ours are: ExpertFusedColumnParallelLinear's weight_shape
# (E, input_size, output_size / tp), partition dim 2, and ExpertFusedRowParallelLinear's (E, input_size / tp,
# output_size), partition dim 1 (src/neuronx_distributed/modules/moe/moe_parallel_layers.py:232-238,
# :365-371, v2.28.0; the matmul is einsum "e...h,ehi->e...i", :93). Its gate_up_proj fuses [gate | up]
# along the out dim, as ours does.
NXD_LAYOUT = IN_OUT


@dataclass(frozen=True)
class Split:
    """How a tensor is split over tensor-parallel ranks; dim None: replicated on every one."""

    dim: int | None
    groups: tuple[int, ...] = ()  # sizes along dim; empty: one group, the whole dim


REPLICATED = Split(None)


def split_of(name: str, model_cfg) -> Split:
    """How the tensor called `name` (our name) is split over tensor-parallel ranks, in NxD's layout."""
    m = model_cfg
    head_dim = head_dim_of(m)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Split(0)  # vocabulary rows: ParallelEmbedding, ColumnParallelLinear
    if name.endswith(("attn.qkv_proj.weight", "attn.qkv_proj.bias")):  # a bias shards with its rows
        q, kv = m.num_heads * head_dim, m.num_kv_heads * head_dim
        return Split(0, (q, kv, kv))
    if name.endswith("attn.sinks"):
        return Split(0)  # one per head: this rank's heads'
    if name.endswith(("attn.o_proj.weight", "ffn.down_proj.weight")):
        return Split(1)  # RowParallelLinear: input columns (its bias is whole, added once after the reduce)
    if name.endswith("ffn.gate_up_proj.weight"):
        f = dense_width(m)
        return Split(0, (f, f))  # [gate | up] rows
    if EXPERT_LAYOUT.is_gate_up(name):  # column-parallel: [gate | up] outputs, in NxD's layout
        return Split(NXD_LAYOUT.out_dim, (m.intermediate_size, m.intermediate_size))
    if EXPERT_LAYOUT.is_expert_tensor(name):  # down, row-parallel: its inputs
        return Split(NXD_LAYOUT.in_dim)
    return REPLICATED  # norms (a per-head QK-norm's too), the router and its bias, o_proj's bias


def local_shard(full: torch.Tensor, split: Split, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full`."""
    if split.dim is None:
        return full
    groups = split.groups or (full.shape[split.dim],)
    pieces = [g.chunk(tp, dim=split.dim)[rank] for g in full.split(list(groups), dim=split.dim)]
    return torch.cat(pieces, dim=split.dim)


def full_tensor(shards: list[torch.Tensor], split: Split) -> torch.Tensor:
    """The full tensor from every rank's piece (rank order); the inverse of `local_shard`."""
    if split.dim is None:
        return shards[0]
    dim, tp = split.dim, len(shards)
    n_groups = len(split.groups) or 1
    local_groups = (tuple(g // tp for g in split.groups) if split.groups
                    else (shards[0].shape[dim],))
    per_rank = [s.split(list(local_groups), dim=dim) for s in shards]
    groups = [torch.cat([per_rank[r][g] for r in range(tp)], dim=dim) for g in range(n_groups)]
    return torch.cat(groups, dim=dim)


def our_name(name: str) -> str:
    """NxDCausalLM's name -> ours (MOE_NAMES renamed, PREFIX dropped)."""
    name = name.removeprefix(PREFIX)
    for ours, theirs in MOE_NAMES.items():
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


# -- the files --------------------------------------------------------------------------------------
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


def read_checkpoint(checkpoint_dir: Path) -> dict:
    """The checkpoint as one Lightning checkpoint dict with full (unsharded) tensors."""
    checkpoint_dir = Path(checkpoint_dir)
    ckpt = load_trusted(checkpoint_dir / USER_CONTENT, map_location="cpu")
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
    ckpt["state_dict"] = {f"model.{name}": _join(by_rank, split_of(name, model_cfg),
                                                 EXPERT_LAYOUT.is_expert_tensor(name))
                          for name, by_rank in shards.items()}
    ckpt[LAYOUT_KEY] = list(NXD_LAYOUT.dims)  # what the shards hold, whatever user_content says
    return upgraded_checkpoint(ckpt)


def _join(by_rank: dict[tuple[int, int], torch.Tensor], split: Split, experts: bool) -> torch.Tensor:
    """The full tensor from its shards: TP pieces joined by `full_tensor`, then for expert tensors the
    EP ranks' experts in rank order (dense tensors are the same in every EP rank's file)."""
    ep_ranks = sorted({ep for ep, _ in by_rank}) if experts else [0]
    tp_ranks = sorted({tp for _, tp in by_rank})
    per_ep = [full_tensor([by_rank[ep, tp] for tp in tp_ranks], split) for ep in ep_ranks]
    return torch.cat(per_ep) if experts else per_ep[0]


# -- the format -----------------------------------------------------------------------------------
class NxD(Format):
    """neuronx-distributed's directory (the files above), complete once every rank wrote `done`."""

    name = "neuronx-distributed directory"
    key = "nxd"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return path.is_dir() and ((path / USER_CONTENT).exists() or (path / "model").is_dir())

    def complete(self, path: Path) -> bool:
        return is_complete(path)

    def verify(self, path: Path, deep: bool = False) -> int | None:
        if not self.complete(path):
            raise CorruptCheckpoint("was not finished by every rank (no `done` file: the run stopped while "
                                    "saving it)")
        return int(load(Path(path) / USER_CONTENT)["global_step"])

    def read(self, path: Path) -> dict:
        return read_checkpoint(path)

    def lightning_file(self, path: Path) -> Path:
        return Path(path) / USER_CONTENT

    # Written and loaded by neuronx-distributed itself, collectively (its ranks, its asynchronous writer):
    # trainer/checkpoint.py save_checkpoint (:654), load_checkpoint (:838), finalize_checkpoint (:970),
    # v2.28.0, as NxD Training does (nlp_overrides.py:535-640). The tag is the checkpoint's name, the
    # directory its folder.
    def __init__(self, keep: int = 1, zero1: bool = False) -> None:
        """How a run writes it (the trn1 strategy's own instance): NxD keeps the newest `keep` checkpoints
        of the folder; `zero1` when its optimizer is ZeRO-1."""
        self.keep, self.zero1 = keep, zero1

    def save(self, live: Live | None, checkpoint: dict, path: Path) -> None:
        """`checkpoint`'s weights, its one optimizer state and the rest (user_content.pt), every rank its
        shards (NxD knows the ranks); `done` once every rank has finished."""
        from neuronx_distributed import save_checkpoint

        path = Path(path)
        save_checkpoint(str(path.parent), tag=path.name, model=checkpoint["state_dict"],
                        optimizer=checkpoint["optimizer_states"][0], user_content=lightning_state(checkpoint),
                        use_xser=False,  # plain torch.save files: read_checkpoint reads them without NxD
                        num_kept_ckpts=self.keep, async_save=True, zero1_optimizer=self.zero1)

    def load(self, live: Live | None, path: Path) -> dict:
        """Lightning's part (user_content.pt); the weights and the optimizer state load into the live
        objects after (load_weights, load_optimizer)."""
        from neuronx_distributed import load_checkpoint

        path = Path(path)
        rest = load_checkpoint(str(path.parent), tag=path.name)
        return {**rest, "state_dict": {}, "optimizer_states": [{}]}  # Lightning checks both keys exist

    def load_weights(self, path: Path, model, strict: bool = True) -> None:
        from neuronx_distributed import load_checkpoint

        path = Path(path)
        load_checkpoint(str(path.parent), tag=path.name, model=model, strict=strict)

    def load_optimizer(self, path: Path, optimizer) -> None:
        from neuronx_distributed import load_checkpoint

        path = Path(path)
        load_checkpoint(str(path.parent), tag=path.name, optimizer=optimizer)

    @staticmethod
    def finalize() -> None:
        """Wait for an asynchronous save still running, so it gets its `done` file."""
        from neuronx_distributed import finalize_checkpoint

        finalize_checkpoint()


NXD = NxD()  # how the checkpoint layer reads it (a trn1 run writes through its strategy's own instance)
