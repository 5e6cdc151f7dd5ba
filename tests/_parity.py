"""Helpers for the multi-process parity tests: one single-process baseline per session, metrics readers.

Parity setting: 2 processes with micro-batch B each against 1 process with micro-batch 2B,
same seed. The data stream gives rank r the positions r, r+2, ... (moe/data/sampler.py), so
step n of both runs sees the same 2B sequences. Routing is dropless (capacity depends on the
tokens per forward); the load-balance statistics are global over the data-parallel group
(ep2 on 2 ranks: the EP group is every rank; dp2: moe_opt.aux_loss_group=dp), so the loss
is the single-process loss, not an approximation of it.

The learning rate is 1e-3, not the tiny preset's 3e-3: at 3e-3 the tiny model's loss jumps
around step 10-15 and a top-k near-tie flipped by float rounding (summation order differs
across ranks) grows ~10x a step, from 1e-7 to 1e-3 by step 19, in any two runs whose
reductions differ. At 1e-3 the two runs stay within 1e-6 for all 20 steps (measured).
"""
from __future__ import annotations

from pathlib import Path

from tests.conftest import FAST_RUN, run_entry, trained_rows

STEPS = 20
PARITY = ("moe_opt=dropless", f"trainer.max_steps={STEPS}", "optimizer.warmup_steps=5",
          "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
          "trainer.limit_val_batches=0", "trainer.checkpoint_every_n_steps=10",
          "trainer.keep_last_checkpoints=3", "seed=1234")
TWO_RANKS = ("trainer.devices=2", "trainer.micro_batch_size=2")
TOL = 1e-4  # fp32


def train(run_dir: Path, *overrides: str, resume: bool = False):
    """Run train.py into run_dir; returns the CompletedProcess (raises with the log on failure)."""
    return run_entry("train.py", f"hydra.run.dir={run_dir}", *FAST_RUN, *PARITY,
                     f"resume={str(resume).lower()}", *overrides, timeout=1200, check=True)


rows = trained_rows


def losses(run_dir: Path) -> list[float]:
    return [float(r["loss"]) for r in trained_rows(run_dir)]


def single_process_baseline(tmp_path_factory) -> Path:
    """The 1-process, micro-batch 4 run every parity test compares with (trained once per session)."""
    run_dir = tmp_path_factory.getbasetemp() / "parity_single"
    if not (run_dir / "summary.json").exists():
        train(run_dir, "trainer.devices=1", "trainer.micro_batch_size=4")
    return run_dir


def assert_same_losses(run_dir: Path, reference: Path, tol: float = TOL, steps: int = STEPS) -> float:
    """Every one of `steps` steps' loss within tol of the reference run; returns the largest difference."""
    got, want = losses(run_dir), losses(reference)
    assert len(got) == len(want) == steps, (len(got), len(want))
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    worst = max(diffs)
    assert worst <= tol, f"max |loss diff| {worst:.3g} > {tol} at step {diffs.index(worst) + 1}"
    return worst
