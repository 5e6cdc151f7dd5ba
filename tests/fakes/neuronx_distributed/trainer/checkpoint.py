"""FAKE neuronx_distributed.trainer.checkpoint (v2.28.0 signatures and directory layout, checkpoint.py:54-972).

`<dir>/<tag>/`: `checkpoint` (written first), model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt (by data-
parallel rank 0 of each stage), optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt (every data-parallel
rank with ZeRO-1, rank 0 otherwise), user_content.pt (global rank 0) and `done` once every rank has
finished; with async_save, `done` waits for the next save or finalize_checkpoint. Completed tags
beyond num_kept_ckpts are removed, oldest first. Plain torch.save files (use_xser=False).
"""
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..parallel_layers import parallel_state

_PENDING: list = []  # (tag dir, kept) of asynchronous saves whose `done` is not written yet


def _path(prefix: str, dp: bool = False) -> str:
    dp_rank = parallel_state.get_data_parallel_rank() if dp else 0
    return (f"{prefix}/dp_rank_{dp_rank:02d}_tp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
            f"_pp_rank_{parallel_state.get_pipeline_model_parallel_rank():02d}.pt")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _finish(tag_dir: Path, num_kept) -> None:
    _barrier()
    if dist.get_rank() == 0:
        (tag_dir / "done").write_text("1")
        if num_kept is not None:
            done = sorted((d for d in tag_dir.parent.iterdir() if (d / "done").exists()), key=lambda d: d.stat().st_mtime)
            for old in done[:-num_kept]:
                (old / "done").unlink()
                shutil.rmtree(old)
    _barrier()


def finalize_checkpoint():
    while _PENDING:
        _finish(*_PENDING.pop(0))


def save_checkpoint(checkpoint_dir_str: str, tag: str, model: Any = None, optimizer: Any = None, scheduler=None,
                    user_content=None, num_workers=8, use_xser=False, num_kept_ckpts=None, async_save=False,
                    zero1_optimizer=False, use_zero1_dcp=False, avoid_saving_lower_precision_weights=False) -> None:
    finalize_checkpoint()  # the previous asynchronous save completes first
    tag_dir = Path(checkpoint_dir_str) / tag
    rank = dist.get_rank()
    if rank == 0:
        (tag_dir / "model").mkdir(parents=True, exist_ok=True)
        (tag_dir / "optim").mkdir(parents=True, exist_ok=True)
        (tag_dir / "checkpoint").write_text("1")
    _barrier()
    dp_rank = parallel_state.get_data_parallel_rank()
    if model is not None and dp_rank == 0:
        state = model if isinstance(model, dict) else model.state_dict()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, tag_dir / _path("model"))
    if optimizer is not None and (zero1_optimizer or dp_rank == 0):
        state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        torch.save(state, tag_dir / _path("optim", dp=zero1_optimizer))
    if user_content is not None and rank == 0:
        torch.save(user_content, tag_dir / "user_content.pt")
    if async_save:
        _PENDING.append((tag_dir, num_kept_ckpts))
    else:
        _finish(tag_dir, num_kept_ckpts)


def has_checkpoint(checkpoint_dir_str: str):
    return any((d / "done").exists() for d in Path(checkpoint_dir_str).iterdir())


def load_checkpoint(path: str, tag: str | None = None, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, num_workers: int = 8,
                    strict: bool = True, use_zero1_dcp: bool = False):
    root = Path(path)
    if tag is None:
        tag = sorted((d for d in root.iterdir() if (d / "done").exists()), key=lambda d: d.stat().st_mtime)[-1].name
    tag_dir = root / tag
    if model is not None:
        state = torch.load(tag_dir / _path("model"), map_location="cpu", weights_only=False)
        model.update(state) if isinstance(model, dict) else model.load_state_dict(state, strict=strict)
    if optimizer is not None:
        zero1 = os.path.exists(tag_dir / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt")  # checkpoint.py:899-903
        state = torch.load(tag_dir / _path("optim", dp=zero1), map_location="cpu", weights_only=False)
        optimizer.update(state) if isinstance(optimizer, dict) else optimizer.load_state_dict(state)
    content = tag_dir / "user_content.pt"
    return torch.load(content, map_location="cpu", weights_only=False) if content.exists() else None
