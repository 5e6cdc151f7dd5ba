"""cfg -> validated plan -> DataModule + LitMoE + strategy -> Trainer.fit -> run dir.

`train.py` is a thin Hydra entry point around `train(cfg, run_dir)`; tests call it too.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moe.errors import UserError
from moe.parallel.plan import make_plan
from moe.validate import validate


def train(cfg: DictConfig, run_dir: str | Path) -> Path | None:
    """Validate, then either print the dry-run plan or train into `run_dir`."""
    from moe.data.arrow_io import apply_prepared_meta
    from moe.hf_io import apply_init_from_hf

    apply_init_from_hf(cfg)  # model.init_from_hf=DIR: architecture from DIR/config.json
    apply_prepared_meta(cfg)  # data=prepared: seq_len from DIR/meta.json
    validate(cfg)
    if cfg.dry_run:
        print(make_plan(cfg).render())
        return None
    run_dir = Path(run_dir)
    import lightning as L
    import torch

    from moe.spike_guard import check_guard_config

    check_guard_config(cfg.trainer)  # trainer.spike_*, before anything is built or written

    from moe.checkpointing import check_resume_compatible, find_resume_checkpoint, with_atomic_io
    from moe.data import MoEDataModule
    from moe.lit_module import LitMoE
    from moe.spike_guard import RollbackRequested
    from moe.strategies import build_strategy

    ckpt_dir = run_dir / "checkpoints"
    resume_from = find_resume_checkpoint(ckpt_dir) if cfg.resume else None  # newest that verifies
    rolled_back = False
    while True:  # once, plus once per loss-spike rollback (moe/spike_guard.py)
        if resume_from:
            check_resume_compatible(resume_from, cfg)
        bundle = build_strategy(cfg)
        os.environ.update(bundle.env)
        if bundle.num_threads:
            torch.set_num_threads(bundle.num_threads)
        L.seed_everything(cfg.seed, workers=True, verbose=False)

        datamodule = MoEDataModule(
            cfg.data, micro_batch_size=cfg.trainer.micro_batch_size,
            accumulate_grad_batches=cfg.trainer.accumulate_grad_batches, max_steps=cfg.trainer.max_steps,
            seed=cfg.seed, limit_val_batches=cfg.trainer.limit_val_batches,
        )
        datamodule.check_model(cfg.model)
        module = bundle.module_factory(cfg) if bundle.module_factory else LitMoE(cfg)  # Neuron: NxD's module
        if cfg.model.init_from_hf and not resume_from:  # fine-tuning: start from DIR's weights
            from moe.hf_io import load_hf_weights

            load_hf_weights(module.model, cfg.model.init_from_hf)
        trainer = L.Trainer(**dict(
            accelerator=bundle.accelerator, strategy=bundle.strategy, precision=bundle.precision,
            plugins=with_atomic_io(bundle.plugins, bundle.strategy) or None,
            devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes,
            max_steps=cfg.trainer.max_steps, accumulate_grad_batches=cfg.trainer.accumulate_grad_batches,
            gradient_clip_val=cfg.optimizer.grad_clip or None, gradient_clip_algorithm="norm",
            val_check_interval=cfg.trainer.val_check_interval * cfg.trainer.accumulate_grad_batches,
            check_val_every_n_epoch=None, limit_val_batches=cfg.trainer.limit_val_batches,
            num_sanity_val_steps=0, use_distributed_sampler=False,
            logger=build_loggers(cfg, run_dir) or False,
            callbacks=build_callbacks(cfg, run_dir, module, fresh=not cfg.resume and not rolled_back),
            default_root_dir=str(run_dir), enable_progress_bar=cfg.trainer.progress_bar,
            deterministic=cfg.trainer.deterministic, enable_model_summary=False,
        ) | bundle.trainer_overrides)  # Neuron: manual optimization, NxD accumulates and clips
        if trainer.is_global_zero:
            save_tokenizer(datamodule.tokenizer_dir, run_dir / "tokenizer")
            if resume_from:
                print(f"resuming from {resume_from}")
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from else None)
            break
        except RollbackRequested as err:
            rolled_back = True
            step = err.from_step
            resume_from = None if step is None else find_resume_checkpoint(ckpt_dir, step=step)
    if trainer.is_global_zero:
        print(f"run dir: {run_dir}  (metrics.csv, summary.json, checkpoints/)")
    return run_dir


def save_tokenizer(source: Path, target: Path) -> None:
    """Keep the run's tokenizer beside its checkpoints, so inference needs nothing else."""
    import shutil

    target.mkdir(parents=True, exist_ok=True)
    for path in Path(source).iterdir():
        if path.is_file() and (path.name.startswith("tokenizer") or path.name in TOKENIZER_EXTRAS):
            shutil.copy2(path, target / path.name)


TOKENIZER_EXTRAS = {"special_tokens_map.json", "chat_template.jinja", "added_tokens.json"}


def objective(run_dir: Path | None) -> float | None:
    """What a sweeper minimises: the run's final validation loss, else its final training loss."""
    summary = Path(run_dir or "") / "summary.json"
    if run_dir is None or not summary.is_file():
        return None
    values = json.loads(summary.read_text())
    return values.get("final_val_loss") or values.get("final_loss")


def tokens_per_step(cfg) -> int:
    dp = cfg.trainer.devices * cfg.trainer.num_nodes // (cfg.parallel.tp * cfg.parallel.pp)
    return cfg.trainer.micro_batch_size * cfg.trainer.accumulate_grad_batches * dp * cfg.data.seq_len


def build_callbacks(cfg, run_dir: Path, module, fresh: bool = False) -> list:
    from lightning.pytorch.callbacks import RichProgressBar

    from moe.callbacks import RunMetrics
    from moe.checkpointing import StepCheckpoint, StepSeed
    from moe.spike_guard import SpikeGuard

    world = cfg.trainer.devices * cfg.trainer.num_nodes
    callbacks = [
        RunMetrics(
            run_dir, log_every_n_steps=cfg.trainer.log_every_n_steps, tokens_per_step=tokens_per_step(cfg),
            flops_per_token=module.model.flops_per_token(cfg.data.seq_len),
            peak_flops_total=cfg.hardware.peak_tflops * 1e12 * world, key_config=key_config(cfg, module),
        ),
        SpikeGuard.from_config(cfg, run_dir, fresh=fresh),  # after RunMetrics: it reads grads first
        StepSeed(cfg.seed),
        StepCheckpoint(  # ModelCheckpoint that also saves the final step
            dirpath=run_dir / "checkpoints", filename="step-{step:06d}", auto_insert_metric_name=False,
            every_n_train_steps=cfg.trainer.checkpoint_every_n_steps, save_last=True,
            save_top_k=cfg.trainer.keep_last_checkpoints, monitor="step", mode="max",
            enable_version_counter=False,  # a step re-saved after a resume overwrites, never step-N-v1
        ),
    ]
    if cfg.trainer.progress_bar:
        callbacks.append(RichProgressBar(leave=True))
    return callbacks


def build_loggers(cfg, run_dir: Path) -> list:
    """Extra experiment trackers; metrics.csv is written regardless (logger=csv adds nothing)."""
    kind = cfg.logger.kind
    if kind == "csv":
        return []
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return [TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", **cfg.logger.extra)]
    if kind == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError as err:
            raise UserError("logger", "wandb", "pip install wandb -c constraints.txt, or use logger=csv",
                            problem="needs the wandb package, which is not installed") from err
        from lightning.pytorch.loggers import WandbLogger

        return [WandbLogger(project=cfg.logger.project, name=cfg.run_name, save_dir=str(run_dir),
                            offline=cfg.logger.offline, **cfg.logger.extra)]
    raise UserError("logger.kind", kind, "use csv, wandb or tensorboard", problem="is not a known logger")


def key_config(cfg, module) -> dict:
    """The values a report compares runs by."""
    total, active = module.model.num_params(active_only=False), module.model.num_params(active_only=True)
    keys = ["model.name", "model.num_experts", "model.top_k", "moe_opt.name", "moe_opt.capacity_factor",
            "moe_opt.eval_capacity_factor", "moe_opt.min_capacity", "moe_opt.drop_policy",
            "moe_opt.aux_loss_coeff", "moe_opt.z_loss_coeff",
            "parallel.name", "parallel.tp", "parallel.pp", "parallel.ep",
            "hardware.name", "trainer.devices", "trainer.num_nodes", "trainer.micro_batch_size",
            "trainer.accumulate_grad_batches", "trainer.max_steps", "data.name", "data.seq_len",
            "optimizer.lr", "optimizer.min_lr", "seed", "run_name"]
    values = {key: OmegaConf.select(cfg, key) for key in keys}
    values.update({"params_total": total, "params_active": active,
                   "precision": cfg.trainer.precision or cfg.hardware.precision,
                   "global_batch_size": tokens_per_step(cfg) // cfg.data.seq_len})
    return values
