"""Loss-spike and NaN guard: a step with a non-finite loss or gradient, or a loss far above its
running mean, is counted, logged and, as configured, skipped or rolled back.

Decided once per optimizer step by `skips`, which the step calls (moe.module.train_step) after the
gradients are synchronised, from the step's loss averaged over micro-batches and ranks and the global
gradient norm, so every rank decides the same; with both checks off (trainer.skip_nonfinite=false,
trainer.spike_factor=0) only the rollback ledger's steps are skipped, and the loss is not read. As a
callback it keeps what lives beside the step: the rollback ledger at the run's start, its state in every
checkpoint, the step last saved.
Skipping an update is the backend's (Backend.skip_update): the weights and the optimizer state stay
bit for bit as they are (no weight decay either); the step counter, the schedule and the data stream
move on as if the step had run, so the data order of later steps never changes.

Rollback (PaLM's recipe): the spike step M and every step since the last checkpoint N are
recorded in `<run_dir>/rollbacks.json`, `RollbackRequested` unwinds `Trainer.fit`, and
`moe.train.run.train` fits again from checkpoint N; steps N+1..M then consume their batches
without updating. The ledger outlives a crash, so a relaunch honours it too.
"""
from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

import lightning as L

from moe.checkpoint.io import write_json_atomic
from moe.errors import UserError
from moe.inputs import load_json

LEDGER = "rollbacks.json"
COUNT_KEYS = ("skipped_steps", "spikes", "nonfinite_steps", "rollbacks")


class RollbackRequested(Exception):
    """Raised inside fit: restart from the checkpoint at `from_step` (None: from scratch)."""

    def __init__(self, spike_step: int, from_step: int | None):
        self.spike_step, self.from_step = spike_step, from_step
        start = "the start" if from_step is None else f"step {from_step}"
        super().__init__(f"loss spike at step {spike_step}: rolling back to {start}, skipping steps "
                         f"{(from_step or 0) + 1}..{spike_step}")


def read_ledger(run_dir: Path) -> list[dict]:
    """The run's rollbacks so far; a ledger that is not what this module writes (a crash of the disk, a hand
    edit) is a UserError naming it: guessing would train batches a rollback skipped, or skip good ones."""
    path = Path(run_dir) / LEDGER
    if not path.exists():
        return []
    fix = (f"restore {LEDGER} from a copy; or, to forget the rollbacks (the batches they skipped are then "
           "trained again), delete it, or start the run afresh with resume=false")
    record = load_json(path, "hydra.run.dir", str(run_dir), fix)
    events = record.get("rollbacks") if isinstance(record, dict) else None
    if not isinstance(events, list) or not all(
            isinstance(e, dict) and isinstance(e.get("spike_step"), int) and
            isinstance(e.get("from_step"), int) for e in events):
        raise UserError("hydra.run.dir", str(run_dir), fix, problem=f"cannot be read: {path} holds no list "
                        "of rollbacks (spike_step, from_step), as the loss-spike guard writes")
    return events


def skipped_by_rollbacks(events: list[dict]) -> set[int]:
    return {s for e in events for s in range(e["from_step"] + 1, e["spike_step"] + 1)}


class SpikeGuard(L.Callback):
    """`counts` (cumulative over the run) go to metrics.csv and summary.json through RunMetrics."""

    def __init__(self, run_dir: str | Path, factor: float = 3.0, window: int = 50, action: str = "warn",
                 skip_nonfinite: bool = True, max_rollbacks: int = 3, fresh: bool = False,
                 max_nonfinite: int = 10):
        self.run_dir = Path(run_dir)
        self.factor, self.window, self.action = factor, window, action
        self.skip_nonfinite, self.max_rollbacks, self.fresh = skip_nonfinite, max_rollbacks, fresh
        self.max_nonfinite, self.nonfinite_in_a_row = max_nonfinite, 0
        self.losses: deque[float] = deque(maxlen=window)
        self.counts = dict.fromkeys(COUNT_KEYS, 0)
        self.skip_steps: set[int] = set()
        self._last_saved_step: int | None = None
        if not fresh:  # a damaged ledger is refused before the trainer starts (read again at its start)
            read_ledger(self.run_dir)

    @classmethod
    def from_config(cls, trainer, run_dir, fresh: bool) -> SpikeGuard:
        """The guard the trainer section's keys ask for."""
        t = trainer
        return cls(run_dir, t.spike_factor, t.spike_window, t.spike_action, t.skip_nonfinite,
                   t.spike_max_rollbacks, fresh=fresh, max_nonfinite=t.max_nonfinite_steps)

    # -- state (saved in every checkpoint, so a resumed run decides as the uninterrupted one) --
    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "counts": dict(self.counts)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.losses = deque(state_dict.get("losses", []), maxlen=self.window)
        self.counts.update(state_dict.get("counts", {}))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._last_saved_step = trainer.global_step

    def on_train_start(self, trainer, pl_module) -> None:
        step = trainer.global_step
        self._last_saved_step = step if trainer.ckpt_path else None
        ledger = self.run_dir / LEDGER
        if self.fresh and trainer.is_global_zero and ledger.exists():
            ledger.unlink()  # resume=false: this run owns the run dir from scratch
        events = [] if self.fresh else read_ledger(self.run_dir)
        self.skip_steps = {s for s in skipped_by_rollbacks(events) if s > step}
        later = [e for e in events if e["spike_step"] > step]  # decided after the restored checkpoint
        self.counts["spikes"] += len(later)
        self.counts["rollbacks"] += len(later)

    # -- the decision, once per optimizer step -------------------------------------------------
    @property
    def reads_loss(self) -> bool:
        """Whether a step's decision needs its loss: the non-finite check or the spike check is on."""
        return self.skip_nonfinite or bool(self.factor)

    def skips(self, step: int, trainer, grad_norm, step_loss: Callable[[], float]) -> bool:
        """Whether optimizer step `step` (1-based) leaves the weights as they are (the caller then skips
        the update); a rollback raises RollbackRequested, too many non-finite steps in a row a UserError.
        `step_loss()`: the step's loss averaged over micro-batches and every rank."""
        if step in self.skip_steps:
            return self._skip(f"step {step}: update skipped (rolled back past a loss spike)", trainer)
        if not self.reads_loss:
            return False
        # The checks need the loss of every step, before its update, the same on every rank: one all-reduce
        # and one host read a step (shared with metrics.csv's row on a logged step). Without them
        # (trainer.skip_nonfinite=false, trainer.spike_factor=0) nothing is read back on an unlogged step.
        loss = step_loss()
        if self.skip_nonfinite and not (math.isfinite(loss) and math.isfinite(float(grad_norm))):
            self.counts["nonfinite_steps"] += 1
            self.nonfinite_in_a_row += 1
            if self.max_nonfinite and self.nonfinite_in_a_row >= self.max_nonfinite:
                raise self.diverged(step, trainer)
            return self._skip(f"step {step}: non-finite loss or gradient (loss={loss}); update skipped",
                              trainer)
        self.nonfinite_in_a_row = 0
        if self.factor and len(self.losses) == self.window and math.isfinite(loss):
            mean = sum(self.losses) / len(self.losses)
            if loss > self.factor * mean:
                return self._spike(trainer, step, loss, mean)  # a spike never enters the running mean
        if math.isfinite(loss):
            self.losses.append(loss)
        return False

    def diverged(self, step: int, trainer) -> UserError:
        """Every rank sees the same reduced loss, so all stop at once; no checkpoint of this state."""
        saved = f"step {self._last_saved_step}" if self._last_saved_step else "no checkpoint"
        return UserError("trainer.max_nonfinite_steps", self.max_nonfinite,
                         "lower optimizer.lr or raise optimizer.warmup_steps, check the data, or try "
                         "trainer.precision=32-true; relaunching resumes from the newest checkpoint "
                         f"({saved}); raise trainer.max_nonfinite_steps (0 = never stop) to keep going",
                         problem=f"reached: steps {step - self.nonfinite_in_a_row + 1} to {step} all had a "
                                 "non-finite loss or gradient, so the run stopped (nothing was learned "
                                 "since)")

    def _spike(self, trainer, step: int, loss: float, mean: float) -> bool:
        self.counts["spikes"] += 1
        what = f"step {step}: loss {loss:.4f} > {self.factor:g} x running mean {mean:.4f} (loss spike)"
        action = self.action
        if action == "rollback" and self.counts["rollbacks"] >= self.max_rollbacks:
            _say(trainer, f"{what}; spike_max_rollbacks={self.max_rollbacks} reached, skipping instead")
            action = "skip"
        if action == "warn":
            _say(trainer, f"{what}; kept (trainer.spike_action=warn)")
            self.losses.append(loss)
            return False
        if action == "skip":
            return self._skip(f"{what}; update skipped", trainer)
        from_step = self._last_saved_step
        if trainer.is_global_zero:
            events = read_ledger(self.run_dir)
            events.append({"spike_step": step, "from_step": from_step or 0, "loss": loss,
                           "running_mean": mean})
            write_json_atomic(self.run_dir / LEDGER, {"rollbacks": events})
        trainer.strategy.barrier("spike_rollback")
        err = RollbackRequested(step, from_step)
        _say(trainer, f"{what}; {err}")
        raise err

    def _skip(self, message: str, trainer) -> bool:
        self.counts["skipped_steps"] += 1
        _say(trainer, message)
        return True


def _say(trainer, message: str) -> None:
    if trainer.is_global_zero:
        print(f"spike guard: {message}", file=sys.stderr, flush=True)
