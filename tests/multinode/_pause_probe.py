"""A callback train.py instantiates in a test (`+callbacks.pause._target_=...PauseAt`, with its step, node and
path): on one node's first attempt (torchrun's GROUP_RANK, TORCHELASTIC_RESTART_COUNT=0), its first worker
writes its pid to `path` once optimizer step `step` has ended and waits there, so that a test can SIGKILL it
at a known step instead of racing the run; its peers go on into the next step's collectives and wait for it.
A restarted worker (TORCHELASTIC_RESTART_COUNT > 0) never pauses."""
from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L

GIVE_UP_S = 600.0  # not killed by then: the test that asked for the pause has gone


class PauseAt(L.Callback):
    def __init__(self, step: int, node: int, path: str):
        self.step, self.node, self.path = step, node, Path(path)

    def _mine(self) -> bool:
        return (os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("LOCAL_RANK") == "0"
                and os.environ.get("GROUP_RANK") == str(self.node))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or not self._mine():
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(os.getpid()))
        tmp.rename(self.path)  # whole when the test sees it
        deadline = time.monotonic() + GIVE_UP_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
        raise RuntimeError(f"PauseAt: not killed within {GIVE_UP_S:.0f} s of pausing after step {self.step}")
