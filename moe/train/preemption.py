"""SIGTERM and SIGUSR1 (SLURM pre-emption and time limits, Kubernetes eviction): save, exit non-zero.

Lightning's own SIGTERM handling stops the fit and exits 0 without a checkpoint, so a supervisor
reports success and the steps since the last save are lost. Here a signal only sets a flag; at
the next optimizer-step boundary every rank learns of it (one max all-reduce per step, so a
signal delivered to rank 0 alone, as a launcher gets it, reaches all), the step just finished is
checkpointed, a validation pass due at that step still runs, and `Preempted` unwinds the fit
before the next batch. train.py then exits 128 + the signal number (143
for SIGTERM, 138 for SIGUSR1), never 0, and relaunching the same command resumes at that step.

Under SLURM, SIGUSR1 also requeues the job (`scontrol requeue $SLURM_JOB_ID`, as Lightning's
SLURMEnvironment does with auto-requeue; ask SLURM for it with `#SBATCH --signal=USR1@90`).
"""
from __future__ import annotations

import os
import signal
import subprocess

import torch
from lightning.pytorch.callbacks import Callback

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):  # noqa: N818  (names what happened, as KeyboardInterrupt does)
    """Raised on every rank after the pre-emption checkpoint; train.py exits `exit_code`."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step} (checkpoint saved)")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class PreemptionCheckpoint(Callback):
    """Turns SIGTERM / SIGUSR1 into a checkpoint at the next optimizer step and a `Preempted` exit."""

    def __init__(self, backend):
        self.backend, self.received, self._previous, self._step_seen = backend, 0, {}, None
        self._stop: Preempted | None = None

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def on_train_start(self, trainer, pl_module) -> None:
        self._step_seen = trainer.global_step
        for signum in SIGNALS:  # replaces Lightning's handlers (registered when fit started)
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step_seen:
            return  # accumulating micro-batches: not a step boundary
        self._step_seen = trainer.global_step
        signum = self.received
        if trainer.world_size > 1:
            signum = int(self.backend.all_reduce(pl_module, torch.tensor([signum]), "max").item())
        if not signum:
            return
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and checkpoint._last_global_step_saved != trainer.global_step:
            candidates = checkpoint._monitor_candidates(trainer)
            checkpoint._save_topk_checkpoint(trainer, candidates)
            checkpoint._save_last_checkpoint(trainer, candidates)
        if signum == signal.SIGUSR1 and trainer.is_global_zero and os.environ.get("SLURM_JOB_ID"):
            requeue()
        self._stop = Preempted(signum, trainer.global_step)
        if trainer.global_step >= trainer.max_steps:
            self._stop = None  # the run is complete: it ends as usual

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._stop is not None:  # after the stopped step's validation, before the next batch trains
            raise self._stop

    def teardown(self, trainer, pl_module, stage) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def requeue() -> None:
    """Put this SLURM job back in the queue (it restarts with the same command, which resumes)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"])
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    print(f"requeue of SLURM job {job}: {'done' if result.returncode == 0 else result.stderr.strip()}",
          flush=True)
