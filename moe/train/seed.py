"""Randomness that a resumed run replays exactly: torch reseeded before every training micro-batch."""
from __future__ import annotations

import hashlib

import lightning as L
import torch


def step_seed(seed: int, rank: int, step: int, micro: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{rank}/{step}/{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class StepSeed(L.Callback):
    """Reseed torch before every training micro-batch from (seed, rank, step, micro-batch).

    Router jitter draws from torch's global generator; whatever else draws from it (a data
    loader starting, validation) differs between a resumed and an uninterrupted run. Seeding
    per micro-batch makes each step's noise a function of where it is in the run, so a resume
    replays it exactly without saving generator states (fairseq seeds per update the same way).
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._step, self._micro = None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        self._micro = self._micro + 1 if step == self._step else 0
        self._step = step
        torch.manual_seed(step_seed(self.seed, trainer.global_rank, step, self._micro))
