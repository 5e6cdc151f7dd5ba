"""composed cfg -> settle (derive, validate, freeze: Settled) -> backend -> DataModule + module -> Trainer.fit
-> run dir.

`train.py` is a thin Hydra entry point around `train(cfg, run_dir)` (and the dry run and simulation,
which plan instead of training); tests call it too. A config is settled once per process:
train.py's preflight settles the config it composes, and `train` reuses that when Hydra hands it
the same config (Hydra composes again to make its run dir; its API takes no composed config).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moe.config.schema import TrainConfig
from moe.config.validate import validate
from moe.errors import (
    COLLECTIVE_FAILED_EXIT,
    CollectiveFailed,
    UserError,
    log_to_files,
    stop_when_a_log_file_cannot_be_written,
)
from moe.parallel.dims import ParallelDims


@dataclass(frozen=True)
class Settled:
    """What a run settles from the config as composed: the config it runs with (frozen dataclasses), its
    ParallelDims, and the notes for the user (train says them once)."""

    config: TrainConfig
    dims: ParallelDims
    notes: tuple[str, ...] = ()


_SETTLED: dict[str, Settled] = {}  # config as composed -> what settle made of it


def settle(cfg: DictConfig) -> Settled:
    """What a run settles before anything else (train, train.py's preflight and its plans): what the
    machine must offer, then `settled_of`; `cfg`, the config as composed, is left as it is. Once per
    process: a config equal to one settled before gets that one's Settled."""
    from moe.checkpoint.trust import set_allow_pickle
    from moe.config.derived import planning
    from moe.train.environment import check_environment

    set_allow_pickle(cfg.allow_pickle)  # every checkpoint this process reads: weights-only unless allowed
    key = OmegaConf.to_yaml(cfg)
    if key not in _SETTLED:
        # CUDA for hardware=gpu (and its FP8 kernel for moe_opt.fp8_experts), Neuron for trn1, logger
        # packages, a W&B key
        check_environment(cfg.hardware, cfg.logger, cfg.moe_opt, planning(cfg.dry_run, cfg.simulate))
        _SETTLED[key] = settled_of(cfg)
    return _SETTLED[key]


def settled_of(cfg: DictConfig) -> Settled:
    """`cfg` settled, on any machine: a copy of it with what it implies (model.init_from_hf /
    upcycle_from_hf's architecture and tokenizer, moe.hf.start; a prepared dataset's seq_len,
    moe.data.arrow_io.prepared_facts), every rule of validate on that copy (in the table's order, each in
    the words of the config as composed), the copy frozen, and its ParallelDims. `cfg` is not edited."""
    from moe.config.schema import freeze
    from moe.data.arrow_io import prepared_facts
    from moe.hf.start import hf_start

    start = hf_start(cfg.model, cfg.moe_opt, cfg.data)
    changes = {**{f"model.{key}": value for key, value in start.model.items()},
               **{f"data.{key}": value for key, value in {**start.data, **prepared_facts(cfg.data)}.items()}}
    merged = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(merged, key, value, merge=False)  # replaced whole, as setting the key would
    validate(merged)
    config = freeze(OmegaConf.to_object(merged))  # the one place the run's config is frozen
    return Settled(config, ParallelDims.from_config(config), (start.note,) if start.note else ())


def train(cfg: DictConfig, run_dir: str | Path, in_run_eval=None) -> Path:
    """Settle the config, then train into `run_dir`, holding its lock (moe.train.run_lock) from before the
    first thing the run writes to its end. in_run_eval: what evaluates the model in the run when
    trainer.eval_every_n_steps asks, called as `in_run_eval(cfg.trainer, tokenizer_dir, seed)`
    (moe.eval.in_run.InRunEval, which train.py passes: evaluation is a later stage than the run)."""
    stop_when_a_log_file_cannot_be_written()  # train.log on a full disk: one paragraph, exit 2
    settled = settle(cfg)
    locks: list = []
    try:  # settled: from here the run reads frozen dataclasses and never edits its config
        return _train(settled.config, settled.dims, settled.notes, Path(run_dir), locks, in_run_eval)
    finally:
        for lock in locks:
            lock.release()


def _train(cfg: TrainConfig, dims: ParallelDims, notes: tuple[str, ...], run_dir: Path, locks: list,
           in_run_eval=None) -> Path:
    from moe.ranks import is_rank_zero
    from moe.train.console import say
    from moe.train.run_lock import RunLock

    for note in notes:
        say(note)
    from moe.module.optim import warmup_note

    if note := warmup_note(cfg.optimizer, cfg.trainer.max_steps):
        say(note)
    import lightning as L
    import torch

    import moe.backends.checkpoint_formats  # noqa: F401  (every backend's own format, registered on import)
    from moe.backends import build_backend
    from moe.checkpoint.formats import step_hint
    from moe.checkpoint.lightning_io import with_atomic_io
    from moe.checkpoint.picker import find_resume_checkpoint, resolved_name
    from moe.config.settled import as_container
    from moe.config.size import flops_per_token
    from moe.data import MoEDataModule
    from moe.data.tokenizer import copy_tokenizer_files
    from moe.train.callbacks import build_callbacks, build_loggers, key_config
    from moe.train.console import bar_shown, configure_output
    from moe.train.environment import apply_torch_settings
    from moe.train.guard import RollbackRequested, SpikeGuard
    from moe.train.launch_world import port_in_use, port_taken, rendezvous_port
    from moe.train.launches import NothingToTrain, check_relaunch, record_launch
    from moe.train.local_ranks import LOCAL_RANKS
    from moe.train.preemption import Preempted

    configure_output(cfg.trainer.progress_bar)  # moe/train/console.py: one line each, a line per step

    ckpt_dir = run_dir / "checkpoints"
    resume_from = find_resume_checkpoint(ckpt_dir) if cfg.resume else None  # newest that verifies
    try:  # train.py's preflight asked before Hydra wrote; a run started in-process (a sweep job) asks here
        changed = check_relaunch(run_dir, as_container(cfg), cfg.data, cfg.trainer.max_steps, resume_from)
    except NothingToTrain as done:
        if is_rank_zero():
            say(f"note: {done}")
        return run_dir
    reports = key_config(cfg, dims)
    rolled_back = False
    while True:  # once, plus once per loss-spike rollback (moe/train/guard.py)
        backend = build_backend(cfg, dims)
        os.environ.update(backend.env())
        apply_torch_settings(cfg.hardware)
        threads = backend.threads()
        if threads:
            torch.set_num_threads(threads.count)
            if is_rank_zero() and not rolled_back:
                say(f"threads: {threads.count} per process ({threads.reason})")
        L.seed_everything(cfg.seed, workers=True, verbose=False)

        datamodule = MoEDataModule(
            cfg.data, micro_batch_size=cfg.trainer.micro_batch_size,
            accumulate_grad_batches=cfg.trainer.accumulate_grad_batches, max_steps=cfg.trainer.max_steps,
            seed=cfg.seed, limit_val_batches=cfg.trainer.limit_val_batches, dims=dims,
            val_micro_batches=backend.val_micro_batches(),
        )
        datamodule.check_model(cfg.model)
        evaluator = None
        if cfg.trainer.eval_every_n_steps:  # its tasks and lm_eval checked before the run starts
            if in_run_eval is None:
                raise UserError("trainer.eval_every_n_steps", cfg.trainer.eval_every_n_steps,
                                "train through train.py, or call train(cfg, run_dir, "
                                "in_run_eval=moe.eval.in_run.InRunEval)",
                                problem="asks for in-run evaluation, and train() was given no evaluator")
            evaluator = in_run_eval(cfg.trainer, datamodule.tokenizer_dir, cfg.seed)
        if not locks and is_rank_zero():  # the checks that need no run dir have passed: the run starts
            locks.append(RunLock(run_dir, cfg.lock_wait_s))
            record_launch(run_dir, as_container(cfg), cfg.data, step_hint(resume_from) if resume_from else 0,
                          changed, reports, world=dims.world)
        guard = SpikeGuard.from_config(cfg.trainer, run_dir, fresh=not cfg.resume and not rolled_back)
        module = backend.build_module(resuming=bool(resume_from), guard=guard)
        parts = backend.trainer_parts()
        trainer = L.Trainer(
            accelerator=parts.accelerator, strategy=parts.strategy, precision=parts.precision,
            plugins=with_atomic_io(parts.plugins, parts.strategy) or None,
            devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes,
            max_steps=cfg.trainer.max_steps,  # a batch is a step's rows: the step accumulates and clips
            val_check_interval=cfg.trainer.val_check_interval,
            # the data module cuts validation to limit_val_batches a source (a mixture: each of data.sources)
            check_val_every_n_epoch=None,
            limit_val_batches=cfg.trainer.limit_val_batches * max(1, len(cfg.data.sources or [])),
            num_sanity_val_steps=0, use_distributed_sampler=False,
            logger=build_loggers(cfg.logger) or False,
            callbacks=build_callbacks(
                cfg.trainer, cfg.callbacks, run_dir, dims, backend, guard,
                flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len),
                peak_tflops=cfg.hardware.peak_tflops, key_config=reports, evaluator=evaluator),
            default_root_dir=str(run_dir), enable_progress_bar=bar_shown(cfg.trainer.progress_bar),
            enable_checkpointing=False,  # the run's own StepCheckpoint (moe.train.step_checkpoint), if any
            deterministic=cfg.trainer.deterministic, enable_model_summary=False,
        )
        if trainer.is_global_zero:  # the run's tokenizer, all inference needs: a resumed run's stays as it is
            if not resume_from or not (run_dir / "tokenizer").is_dir():
                copy_tokenizer_files(datamodule.tokenizer_dir, run_dir / "tokenizer")
            if resume_from:
                say(f"resuming from {resume_from}{resolved_name(resume_from)} "
                    f"at step {step_hint(resume_from)}")
        lost_peer = functools.partial(_lost_peer, timeout=cfg.parallel.collective_timeout_s,
                                      ckpt_dir=ckpt_dir)
        resume_path = str(resume_from) if resume_from else None
        try:
            with LOCAL_RANKS.watched(lost_peer):  # a launched rank's loss ends the run with exit 3
                trainer.fit(module, datamodule=datamodule, ckpt_path=resume_path)
            break
        except Preempted as err:
            if trainer.is_global_zero:
                say(f"{err}; relaunch the same command to resume from {ckpt_dir}")
            raise SystemExit(err.exit_code) from err
        except (CollectiveFailed, RuntimeError, torch.distributed.DistError) as err:
            if port_in_use(err):  # the rendezvous could not open its port (taken since the preflight looked)
                LOCAL_RANKS.stop(trainer)
                raise port_taken(rendezvous_port()) from err
            failed = err if isinstance(err, CollectiveFailed) else _collective_failure(err)
            if failed is None:
                raise
            message = lost_peer(str(failed))
            print(message, file=sys.stderr, flush=True)
            log_to_files(message)
            LOCAL_RANKS.stop()  # a stalled one would keep this process from exiting until its own timeout
            raise SystemExit(COLLECTIVE_FAILED_EXIT) from err
        except RollbackRequested as err:
            rolled_back = True
            step = err.from_step
            resume_from = None if step is None else find_resume_checkpoint(ckpt_dir, step=step)
    if trainer.is_global_zero:
        say(f"run dir: {run_dir}  (metrics.csv, summary.json, checkpoints/)")
    return run_dir


def _lost_peer(what: str, timeout: float, ckpt_dir: Path) -> str:
    """The paragraph a run that lost a peer rank ends with (exit 3, retryable)."""
    return (f"error: {what}. A peer rank died, or stalled longer than parallel.collective_timeout_s="
            f"{timeout:g} s; checkpoints are written whole or not at all. Relaunch the same command (or run "
            f"it under python -m moe.supervise) to resume from the newest good checkpoint in {ckpt_dir}")


_TRANSPORT = ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out")


def _collective_failure(err: BaseException) -> CollectiveFailed | None:
    """A torch.distributed failure outside the collectives moe.parallel.comm names (FSDP2's, DDP's,
    Lightning's): a CollectiveFailed for it, else None (not a collective's failure)."""
    import torch.distributed as dist

    cause = err
    while cause is not None and not isinstance(cause, CollectiveFailed):
        if isinstance(cause, dist.DistError) or any(mark in str(cause) for mark in _TRANSPORT):
            rank = dist.get_rank() if dist.is_initialized() else 0
            return CollectiveFailed(rank, "a collective of the run (torch.distributed)", cause)
        cause = cause.__cause__ or cause.__context__
    return cause


def objective(run_dir: Path | None) -> float | None:
    """What a sweeper minimises: the run's final validation loss, else its final training loss."""
    summary = Path(run_dir or "") / "summary.json"
    if run_dir is None or not summary.is_file():
        return None
    values = json.loads(summary.read_text())
    return values.get("final_val_loss") or values.get("final_loss")
