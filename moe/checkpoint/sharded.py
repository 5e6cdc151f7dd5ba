"""Sharded checkpoints: each rank writes its own part (experts, FSDP2/TP shards), none holds them all.

A checkpoint is a directory `<name>.ckpt/` written with torch.distributed.checkpoint (DCP):
`.metadata` and `__<rank>_0.distcp` (the model's weights and the torch optimizer's state), plus
`trainer_state.pt` (everything else Lightning keeps: loops, callbacks, hyper-parameters, step).
Every tensor is stored in its canonical shape and order, as one process holds it (all experts,
[q | k | v] rows): a rank declares the pieces it holds at their canonical offsets
(moe.parallel.placement), a piece several ranks hold (replicas) is written once. Loading reads
into the live tensors of the current layout; DCP's planner reads only the chunks that overlap each
rank's pieces, so a run saved at ep=2 resumes at ep=1, ep=2 or ep=4, and under any backend that
writes this format (DDP with EP, DeepSpeed's weights, FSDP2 with TP/EP/HSDP).

Atomic: every rank writes into `<name>.ckpt.partial/`, and rank 0 renames it to `<name>.ckpt`
once all ranks have written (DCP writes its data files in place, so a kill mid-save of an
existing directory would leave a torn checkpoint that loads silently). A directory without
`trainer_state.pt` or `.metadata` is not a checkpoint.

Checksums: each rank records the size and sha256 of the files it wrote in `__<rank>.sha256.json`
(DCP's files carry none). A resume checks every file's size (cheap at any scale: a truncated or
missing shard); infer.py, export and consolidation, which read every byte anyway, check the sha256.

`read_full_checkpoint` streams a directory into one Lightning-style dict on one process (every
expert: for infer.py, export, a resume with ep=1 and `python -m moe.tools.consolidate`);
moe.checkpoint.formats.Sharded detects and verifies the format.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moe.checkpoint.io import (
    FILE_FIELDS,
    CorruptCheckpoint,
    atomic_torch_save,
    check_record,
    file_sha256,
    fsync_dir,
    read_record,
    unwritable,
    write_json_atomic,
)
from moe.checkpoint.trust import check_dcp_metadata, load_trusted
from moe.errors import UserError
from moe.model.expert_layout import LAYOUT_KEY, layout_of, stored, upgraded_state
from moe.model.mlp import RENAMED, upgraded

TRAINER_STATE = "trainer_state.pt"
PARTIAL_SUFFIX = ".partial"
DCP_METADATA = ".metadata"
MANIFEST = "__{rank}.sha256.json"  # per rank: its files' sizes and sha256
MODEL_KEY, OPTIMIZER_KEY = "model", "optim"
PARAM_GROUPS = "optimizer_param_groups"  # in trainer_state.pt: each optimizer's groups, params by name


def rank_file(path: str | Path, rank: int) -> Path:
    """A rank's own file in a sharded checkpoint (DeepSpeed: its ZeRO optimizer partition)."""
    return Path(path) / "per_rank" / f"rank_{rank:05d}.pt"


def _canonical(t, where, mesh):
    """`t` as DCP should see it: itself when it is the whole canonical tensor (written once, by one of
    the ranks holding it), else a DTensor of the canonical shape whose local part is this rank's pieces
    (torch's LocalShardsWrapper: any number of chunks at any offsets); None when it holds no piece."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    from moe.parallel.placement import Where, canonical_shape, pieces

    if not torch.is_tensor(t) or t.dim() == 0 or (where is None and not isinstance(t, DTensor)):
        return t
    where = where or Where()
    parts = pieces(t, where)
    if not parts:
        return None
    local = LocalShardsWrapper([part for part, _ in parts], [offsets for _, offsets in parts])
    shape = torch.Size(canonical_shape(t, where))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _wrapped(module, optimizers: list, mesh) -> dict:
    """The live state of module and optimizers by state-dict key, every tensor canonical
    (moe.parallel.placement), so a checkpoint does not depend on the layout that wrote it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from moe.parallel.placement import where_by_name

    # by state-dict key, which is also the optimizer state's key (get_state_dict strips the AC wrapper's
    # child name, moe.parallel.apply.WRAPPED)
    cfg = getattr(module, "cfg", None)  # a LitMoE; a bare module holds neither experts nor TP shards
    wheres = where_by_name(module, cfg.model, module.backend.dims.tp) if cfg is not None else {}

    def canonical(entries, key: str | None = None) -> dict:
        out = {k: _canonical(v, wheres.get(key or k), mesh) for k, v in entries}
        return {k: v for k, v in out.items() if v is not None}

    if not optimizers:  # the backend keeps the optimizer state itself (DeepSpeed: per_rank files)
        return {MODEL_KEY: canonical(module.state_dict().items())}
    model_sd, optim_sd = get_state_dict(module, optimizers)
    optim_state = {k: canonical(s.items(), key=k) for k, s in optim_sd["state"].items()}
    return {MODEL_KEY: canonical(model_sd.items()),
            OPTIMIZER_KEY: {"state": optim_state, "param_groups": optim_sd["param_groups"]}}


def save_sharded(path: str | Path, module, optimizers: list, mesh, trainer_state: dict, is_global_zero: bool,
                 per_rank: dict | None = None):
    """Collective: every rank writes its shard (and `per_rank`, its own file) into path.partial; rank 0
    renames it to `path`."""
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    if is_global_zero:
        shutil.rmtree(partial, ignore_errors=True)
        rank_file(partial, 0).parent.mkdir(parents=True)
    dist.barrier()
    state = _wrapped(module, optimizers, mesh)
    failure = None
    try:  # DCP gathers every rank's write errors and raises on all of them (CheckpointException)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True, overwrite=False))
        if per_rank is not None:
            torch.save(per_rank, rank_file(partial, dist.get_rank()))
        if is_global_zero:
            groups = [state[OPTIMIZER_KEY]["param_groups"]] if optimizers else []
            atomic_torch_save({**trainer_state, PARAM_GROUPS: groups}, partial / TRAINER_STATE)
        write_manifest(partial, dist.get_rank(), with_metadata=is_global_zero)
    except (OSError, CheckpointException, UserError) as err:  # disk full, quota, permissions
        failure = err
    failed = [None] * dist.get_world_size()
    dist.all_gather_object(failed, failure is not None)  # a rank that failed alone must stop every rank
    if any(failed):
        if is_global_zero:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(failure, UserError):
            raise failure
        raise unwritable(path, failure or OSError("another rank could not write its shard"))
    if is_global_zero:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        os.rename(partial, path)
        fsync_dir(path.parent)
    dist.barrier()


def write_manifest(partial: Path, rank: int, with_metadata: bool) -> None:
    """This rank's files (DCP's `__<rank>_*.distcp`, per_rank/, rank 0 also `.metadata`): size and sha256."""
    files = sorted(partial.glob(f"__{rank}_*.distcp"))
    files += [f for f in (rank_file(partial, rank),) if f.is_file()]
    files += [partial / DCP_METADATA] if with_metadata else []
    record = {str(f.relative_to(partial)): {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
              for f in files}
    write_json_atomic(partial / MANIFEST.format(rank=rank), record)


def check_manifests(path: Path, deep: bool = False) -> None:
    """Raise CorruptCheckpoint unless every file the ranks recorded is there at its size (and, `deep`,
    its sha256), and every DCP data file is recorded. Directories written before manifests pass."""
    manifests = sorted(path.glob(MANIFEST.format(rank="*")))
    if not manifests:
        return
    recorded: dict[str, dict] = {}
    for manifest in manifests:
        entries = read_record(manifest, {})
        recorded.update({name: check_record(entry, FILE_FIELDS, f"{manifest.name}: {name}")
                         for name, entry in entries.items()})
    for name in sorted({p.name for p in path.glob("*.distcp")} - set(recorded)):
        raise CorruptCheckpoint(f"has {name}, which no rank recorded writing (a torn save)")
    for name, want in recorded.items():
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size != want["bytes"]:
            found = "is missing" if size is None else f"is {size} bytes but was written as {want['bytes']}"
            raise CorruptCheckpoint(f"is not whole: {name} {found}")
        if deep and file_sha256(file) != want["sha256"]:
            raise CorruptCheckpoint(f"is corrupt: {name} does not match the sha256 recorded when it was "
                                    "written")


def load_sharded(path: str | Path, module, optimizers: list, mesh) -> dict:
    """Collective: fill the live module and optimizers from `path`, resharded to this layout; returns
    the trainer state (with empty weights, which are already in place)."""
    path, count = Path(path), len(optimizers)
    check_dcp_metadata(path / DCP_METADATA)  # DCP unpickles it unrestricted
    if optimizers and not _has_optimizer_state(path):  # DeepSpeed's are in its per_rank partitions
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"{path} holds no torch optimizer state (written by DeepSpeed): weights restored, "
                       "Adam moments start from zero")
        optimizers = []
    rest = load_trusted(path / TRAINER_STATE, map_location="cpu")
    _check_layout(path, rest)
    state = _under_saved_names(path, _wrapped(module, optimizers, mesh))
    dcp.load(state, checkpoint_id=str(path))  # into the live tensors: every piece is a view of one
    if optimizers:
        for live, saved in zip(optimizers[0].param_groups, state[OPTIMIZER_KEY]["param_groups"], strict=True):
            live.update({k: v for k, v in saved.items() if k != "params"})  # lr, betas, weight decay...
    rest.pop(PARAM_GROUPS, None)
    return {**rest, "state_dict": {}, "optimizer_states": [{}] * count}


def _check_layout(path: Path, trainer_state: dict) -> None:
    """Pieces load in place only into the layout they were written in (a square expert tensor would load
    silently wrong); another layout's checkpoint is upgraded when read whole."""
    saved, live = layout_of(trainer_state), stored()
    if saved.dims != live.dims:
        raise UserError("checkpoint", str(path), "consolidate it (python -m moe.tools.consolidate, which "
                        "stores the experts as this build does) and resume from the file",
                        problem=f"stores the experts {list(saved.dims)}, this build {list(live.dims)}")


def _under_saved_names(path: Path, state: dict) -> dict:
    """`state` keyed as the checkpoint was written: a checkpoint from before moe.model.mlp.RENAMED keeps
    the older parameter names, so its keys are mapped back to them for dcp.load."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if not any(fqn.endswith(tuple(RENAMED)) for fqn in saved):
        return state
    back = {new: old for old, new in RENAMED.items()}

    def saved_name(key: str) -> str:
        return next((key[: -len(new)] + old for new, old in back.items() if key.endswith(new)), key)

    state = dict(state, **{MODEL_KEY: {saved_name(k): v for k, v in state[MODEL_KEY].items()}})
    if OPTIMIZER_KEY in state:
        optim = state[OPTIMIZER_KEY]
        state[OPTIMIZER_KEY] = {**optim, "state": {saved_name(k): v for k, v in optim["state"].items()}}
    return state


def _has_optimizer_state(path: Path) -> bool:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return any(fqn.startswith(OPTIMIZER_KEY + ".") for fqn in metadata.state_dict_metadata)


def read_full_checkpoint(path: str | Path) -> dict:
    """One process: the whole checkpoint as Lightning writes a file (state_dict with every expert,
    optimizer_states in torch's id-keyed form), read tensor by tensor without a process group."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    check_dcp_metadata(path / DCP_METADATA)  # DCP unpickles it unrestricted
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    flat: dict[str, torch.Tensor] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            flat[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if flat:
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    checkpoint = load_trusted(path / TRAINER_STATE, map_location="cpu")
    prefix = MODEL_KEY + "."

    def tensor_of(key: str) -> str:  # `model.<fqn>`, or `optim.state.<fqn>.<moment>` of it
        return key if key.startswith(prefix) else key.rsplit(".", 1)[0]

    flat = upgraded_state(flat, layout_of(checkpoint), tensor_of)  # weights and moments, stored layout
    checkpoint[LAYOUT_KEY] = list(stored().dims)
    checkpoint["state_dict"] = upgraded({k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)})
    checkpoint["optimizer_states"] = [_torch_optimizer_state(groups, flat)
                                      for groups in checkpoint.pop(PARAM_GROUPS, [])]
    return checkpoint


def _torch_optimizer_state(groups: list[dict], flat: dict) -> dict:
    """DCP's name-keyed optimizer state -> torch's: parameters numbered 0.. across groups in order."""
    ids: dict[str, int] = {}
    for group in groups:
        for fqn in group["params"]:
            ids.setdefault(fqn, len(ids))
    state: dict[int, dict] = {}
    prefix = f"{OPTIMIZER_KEY}.state."
    for key, value in flat.items():
        if key.startswith(prefix):
            fqn, name = key[len(prefix):].rsplit(".", 1)
            state.setdefault(ids[fqn], {})[name] = value
    return {"state": state, "param_groups": [{**g, "params": [ids[f] for f in g["params"]]} for g in groups]}
