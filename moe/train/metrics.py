"""Run outputs: metrics.csv (a row per logged optimizer step), summary.json, throughput and MFU.

metrics.csv is the run's record: reports, sweeps and the capacity advisor read it.
Validation rows carry only `step` and `val_loss` (a mixture's, data.sources, also `val_loss/<source>`);
in-run evaluation's rows (trainer.eval_every_n_steps, moe.eval.in_run) only `step` and `eval/<task>/<metric>`,
columns the file gains at the first evaluation (the file is rewritten then, once) and keeps on resume.
On resume, rows past the restored step are dropped first, so a step retrained after a crash is never
counted twice.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
import resource
import time
from pathlib import Path

import lightning as L
import torch

from moe.checkpoint.io import write_json_atomic
from moe.config.schema import source_label
from moe.errors import write_failed
from moe.model.moe import expert_kernel
from moe.outputs import atomic_path
from moe.train.console import STEP_LOGGER, log_step

METRIC_COLUMNS = [
    "step", "loss", "lm_loss", "mtp_loss", "aux_loss", "z_loss", "drop_fraction", "max_expert_load",
    "mean_expert_load", "router_entropy", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss",
    "tokens_per_expert", "tokens_per_forward", "skipped_steps", "spikes",
]


def metric_columns(data) -> list[str]:
    """metrics.csv's columns: a mixture (data.sources) adds each source's validation loss."""
    return METRIC_COLUMNS + [f"val_loss/{source_label(s)}" for s in data.sources or []]


def peak_memory_mib() -> float:
    """Peak memory of this process: accelerator allocations where there is one, else host RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


class RunMetrics(L.Callback):
    """Writes metrics.csv's row of each logged optimizer step from the step's record (its means over every
    rank, read back by the step, moe.module.train_step.StepRecord), and summary.json.

    `guard` (moe.train.guard.SpikeGuard, optional) supplies the skipped-step and spike counters; `evaluator`
    (moe.eval.in_run.InRunEval, optional) evaluates the model after the steps it is due, every rank, and
    its numbers go to metrics.csv and every logger like a step's.
    """

    columns = METRIC_COLUMNS  # metrics.csv's; metric_columns of the run's data once training starts

    def __init__(self, run_dir: str | Path, log_every_n_steps: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops_total: float, key_config: dict, guard=None,
                 evaluator=None):
        self.run_dir = Path(run_dir)
        self.guard = guard
        self.evaluator = evaluator
        self.metrics_path = self.run_dir / "metrics.csv"
        self.log_every = max(1, log_every_n_steps)
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops_total = peak_flops_total
        self.key_config = key_config
        self._last_step = 0
        self._last_time = 0.0
        self._timed_steps = 0
        self._timed_seconds = 0.0
        self._start_step = 0
        self._peak_mib = float("nan")

    # -- set-up ---------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = self._start_step = trainer.global_step
        self._last_time = time.perf_counter()
        self.columns = metric_columns(pl_module.cfg.data)
        if trainer.is_global_zero:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            rows = read_metrics(self.metrics_path)
            # the columns an earlier launch added (its evaluations) stay, whether or not this one evaluates
            self.columns += [c for c in (rows[0] if rows else {}) if c not in self.columns]
            self._rewrite([r for r in rows if int(r["step"]) <= trainer.global_step])

    def _rewrite(self, rows: list[dict]) -> None:
        with atomic_path(self.metrics_path, cleaned="the file is as it was") as tmp, \
                tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(rows)

    def _append(self, row: dict) -> None:
        """One row, or none: a refused write is cut back to the rows before it (a resume reads them). A row
        with columns the file lacks (the first evaluation's) rewrites the file whole with them added."""
        new = [key for key in row if key not in self.columns]
        if new:
            self.columns = self.columns + new
            self._rewrite([*read_metrics(self.metrics_path), row])
            return
        size = self.metrics_path.stat().st_size if self.metrics_path.exists() else 0
        try:
            with self.metrics_path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)
        except OSError as err:
            os.truncate(self.metrics_path, size)
            kept = f"cut back to the rows before step {row['step']}"
            raise write_failed(self.metrics_path, err, cleaned=kept) from err

    # -- per step: the row of the step TrainStep just took (moe.module.train_step) -----------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = pl_module.train_step.last
        step = record.step
        now = time.perf_counter()
        seconds = now - self._last_time
        steps_done = step - self._last_step
        self._last_step, self._last_time = step, now
        if step - steps_done > self._start_step:  # the first step after (re)start includes warm-up
            self._timed_steps += steps_done
            self._timed_seconds += seconds
        tokens_per_s = self.tokens_per_step * steps_done / max(seconds, 1e-9)
        if trainer.progress_bar_callback is not None:  # only the bar reads it
            pl_module.log("tok/s", tokens_per_s, prog_bar=True, logger=False, rank_zero_only=True)
        if record.logged:  # nothing read back from the device on a step that is not logged
            self._log_step(trainer, record, tokens_per_s)
        if self.evaluator is not None and self.evaluator.due(step):
            self._evaluate(trainer, pl_module, step)
            self._last_time = time.perf_counter()  # the next step's throughput leaves the evaluation out

    def _log_step(self, trainer, record, tokens_per_s: float) -> None:
        step = record.step
        row = {
            "step": step, **record.means,
            "lr": optimizer_lr(trainer),
            "grad_norm": record.grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token / self.peak_flops_total,
            "val_loss": "",
            "tokens_per_expert": json.dumps(record.tokens_per_expert),
            "tokens_per_forward": record.tokens_per_forward,
        }
        counts = self.guard.counts if self.guard else {}  # cumulative over the run
        row.update(skipped_steps=counts.get("skipped_steps", 0), spikes=counts.get("spikes", 0))
        if trainer.is_global_zero:
            self._append(row)
            log_step(row, trainer.max_steps)
            numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
            for logger in trainer.loggers:
                logger.log_metrics(numeric, step=step)

    def _evaluate(self, trainer, pl_module, step: int) -> None:
        """The evaluation after `step` (every rank runs it on its own replica: the same numbers), its row."""
        values, seconds = self.evaluator(pl_module, trainer)
        if trainer.is_global_zero:
            self._append({"step": step, **values})
            said = ", ".join(f"{key.removeprefix('eval/')} {value:.4f}" for key, value in values.items())
            logging.getLogger(STEP_LOGGER).info(f"step {step}/{trainer.max_steps} eval ({seconds:.1f} s): "
                                                f"{said}")
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)

    def on_validation_end(self, trainer, pl_module) -> None:
        """The pass's LM loss over every rank's validation batches (the module's, computed at its end)."""
        val_loss = pl_module.val_loss
        if trainer.is_global_zero and not trainer.sanity_checking and not math.isnan(val_loss):
            per_source = {f"val_loss/{name}": loss for name, loss in pl_module.val_source_losses.items()}
            self._append({"step": trainer.global_step, "val_loss": val_loss, **per_source})
            said = "".join(f", {name} {loss:.4f}" for name, loss in per_source.items())
            logging.getLogger(STEP_LOGGER).info(f"step {trainer.global_step}/{trainer.max_steps} "
                                                f"val_loss {val_loss:.4f}{said}")

    # -- end of run ---------------------------------------------------------------------------
    def on_train_end(self, trainer, pl_module) -> None:
        peak = pl_module.backend.all_reduce(pl_module, torch.tensor(peak_memory_mib()), "max")
        self._peak_mib = float(peak)

    def on_fit_end(self, trainer, pl_module) -> None:
        """summary.json marks a finished run, so the final checkpoint (StepCheckpoint.on_train_end) must exist
        and have fitted on disk first: Lightning calls on_fit_end once the whole stage, every callback's
        on_train_end included, has run (lightning 2.6 trainer/trainer.py:1079-1088), whatever the callbacks'
        order."""
        if trainer.is_global_zero:
            summary = self.summary(trainer.global_step, self._peak_mib)
            summary["expert_kernel"] = expert_kernel(pl_module.model)
            summary.update(self.guard.counts if self.guard else {})
            write_json_atomic(self.run_dir / "summary.json", summary)

    def summary(self, steps: int, peak_mib: float) -> dict:
        from moe.train.launches import read_launches, reports_by_steps

        changed = reports_by_steps(read_launches(self.run_dir), steps)
        rows = read_metrics(self.metrics_path)
        train = [r for r in rows if r["loss"] not in ("", None)]
        val = [float(r["val_loss"]) for r in rows if r["val_loss"] not in ("", None)]
        losses = [float(r["loss"]) for r in train]
        measured = self._timed_steps > 0
        throughput = self.tokens_per_step * self._timed_steps / self._timed_seconds if measured else None
        if throughput is None and train:  # a run resumed at its end: keep the logged figure
            throughput = float(train[-1]["tokens_per_s"])
        last = train[-1] if train else {}
        return {
            "steps": steps,
            "tokens_seen": steps * self.tokens_per_step,
            "initial_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "best_loss": min(losses) if losses else None,
            "final_val_loss": val[-1] if val else None,
            "best_val_loss": min(val) if val else None,
            "drop_fraction": _num(last.get("drop_fraction")),
            "max_expert_load": _num(last.get("max_expert_load")),
            "mean_expert_load": _num(last.get("mean_expert_load")),
            "tokens_per_s": throughput,
            "mfu": throughput * self.flops_per_token / self.peak_flops_total if throughput else None,
            "peak_memory_mib": peak_mib,
            # a value is stated only where every step the run kept trained with it; one a relaunch changed is
            # stated per range of steps (launches.json holds each launch's whole config)
            "config": {key: value for key, value in self.key_config.items() if key not in changed},
            "config_by_steps": changed,
        }


def optimizer_lr(trainer) -> float:
    return float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else float("nan")


def _num(value):
    if value in ("", None):
        return None
    number = float(value)
    return None if math.isnan(number) else number
