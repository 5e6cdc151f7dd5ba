"""Which process this is, before any process group exists: from the launcher's environment (torchrun and
Lightning set RANK and LOCAL_RANK, SLURM SLURM_PROCID; Lightning's multi-node form names the node in
NODE_RANK). The checks and messages only one process should run at launch (the run lock, the resume
checkpoint's verification) ask here."""
from __future__ import annotations

import os


def is_rank_zero() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "NODE_RANK"))


def local_rank() -> int:
    """This process's rank on its node (torchrun and Lightning: LOCAL_RANK, SLURM: SLURM_LOCALID), 0 before
    a launcher set one."""
    return int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)


def device_of(module):
    """Where this rank's parameters live: the strategy's device once a Trainer holds the module, else the
    CPU."""
    import torch

    trainer = trainer_of(module)
    return trainer.strategy.root_device if trainer is not None else torch.device("cpu")


def trainer_of(module):
    """The Trainer a LightningModule is attached to, or None: Lightning's `module.trainer` raises where
    there is none (a module built for a test, or restored before fit)."""
    try:
        return module.trainer
    except RuntimeError:
        return None
