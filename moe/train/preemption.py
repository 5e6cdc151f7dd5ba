"""SIGTERM and SIGUSR1 (SLURM pre-emption and time limits, Kubernetes eviction), SIGINT (Ctrl-C): save,
exit non-zero.

Lightning's own SIGTERM handling stops the fit and exits 0 without a checkpoint, so a supervisor
reports success and the steps since the last save are lost. Here a signal only sets a flag; at
the next optimizer-step boundary every rank learns of it (one max all-reduce per step, so a
signal delivered to rank 0 alone, as a launcher gets it, reaches all), the step just finished is
checkpointed, a validation pass due at that step still runs, and `Preempted` unwinds the fit
before the next batch. A signal that arrives during validation stops the run when that pass ends
(the step it validated is checkpointed), not one training step later. train.py then exits 128 + the
signal number (143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT), never 0, and relaunching the same
command resumes at that step. A second SIGINT (Ctrl-C pressed again while the first one's step ends)
stops the process at once, exit 130, without a checkpoint: saves are atomic, so the newest good one
is whole.

Under SLURM, SIGUSR1 also requeues the job (`scontrol requeue $SLURM_JOB_ID`, as Lightning's
SLURMEnvironment does with auto-requeue; ask SLURM for it with `#SBATCH --signal=USR1@90`).
"""
from __future__ import annotations

import os
import signal
import subprocess

import torch
from lightning.pytorch.callbacks import Callback

from moe.faults import maybe_signal_in_validation

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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

    def __init__(self, backend, step_checkpoint):
        """step_checkpoint: the run's moe.train.step_checkpoint.StepCheckpoint, which saves the step."""
        self.backend, self.step_checkpoint, self.received, self._previous = backend, step_checkpoint, 0, {}
        self._stop: Preempted | None = None

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            os.write(2, b"second SIGINT: stopping now, without a checkpoint (the newest one saved is whole); "
                        b"relaunch the same command to resume from it\n")
            os._exit(128 + signal.SIGINT)
        self.received = signum

    def on_train_start(self, trainer, pl_module) -> None:
        for signum in SIGNALS:  # replaces Lightning's handlers (registered when fit started)
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stop_if_signalled(trainer, pl_module)  # a training batch is an optimizer step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        maybe_signal_in_validation(batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        """A signal during validation: stop once the pass ends, not after one more training step."""
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self._stop is None:
            self._stop_if_signalled(trainer, pl_module)

    def _stop_if_signalled(self, trainer, pl_module) -> None:
        """Collective: every rank learns of a signal any rank got; the step is checkpointed and the fit
        stops before the next batch."""
        signum = self.received
        if trainer.world_size > 1:
            signum = int(self.backend.all_reduce(pl_module, torch.tensor([signum]), "max").item())
        if not signum:
            return
        self.step_checkpoint.save(trainer)  # unless this step was just saved
        if signum == signal.SIGUSR1 and trainer.is_global_zero and os.environ.get("SLURM_JOB_ID"):
            requeue(trainer.global_step)  # SLURM ends this job at once: the step's line is printed first
        self._stop = Preempted(signum, trainer.global_step)
        if trainer.global_step >= trainer.max_steps:
            self._stop = None  # the run is complete: it ends as usual

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._stop is not None:  # after the stopped step's validation, before the next batch trains
            raise self._stop

    def teardown(self, trainer, pl_module, stage) -> None:
        if self.received:  # stopping on a signal: a second SIGINT during the shutdown still exits at once
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def requeue(step: int) -> None:
    """Put this SLURM job back in the queue (it restarts with the same command, which resumes)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"])
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    print(f"SIGUSR1 after step {step}: checkpoint saved; requeueing SLURM job {job}", flush=True)
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        outcome = "done" if result.returncode == 0 else result.stderr.strip() or f"exit {result.returncode}"
    except (OSError, subprocess.TimeoutExpired) as err:  # no scontrol here (a container under SLURM)
        outcome = f"not requeued ({err}); resubmit the job to resume from its checkpoint"
    print(f"requeue of SLURM job {job}: {outcome}", flush=True)
