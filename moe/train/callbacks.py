"""The Trainer's callbacks and loggers: the run's own (always on), then the ones the config adds.

Always: RunMetrics (metrics.csv, summary.json), SpikeGuard (its ledger and state; the step asks it),
LocalRanks (the ranks this process launched, watched by the run rather than by Lightning), StepCheckpoint,
PreemptionCheckpoint and, when trainer.progress_bar and stdout is a terminal, a progress bar over
optimizer steps: the periphery, after each step (moe.module.train_step). Then every
node of `callbacks.<name>` and `logger.<name>`, instantiated by Hydra from its `_target_`
(lightning-hydra-template style):

    python train.py logger=wandb                       # conf/logger/wandb.yaml
    python train.py callbacks=lr_monitor               # conf/callbacks/lr_monitor.yaml
    python train.py +callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStopping \\
        +callbacks.early_stop.monitor=val_loss
"""
from __future__ import annotations

from pathlib import Path

from moe.config.derived import precision_of
from moe.config.settled import value_at
from moe.config.size import param_breakdown
from moe.errors import UserError, first_line
from moe.parallel.dims import ParallelDims


def build_callbacks(trainer, callbacks: dict, run_dir: Path, dims: ParallelDims, backend, guard, *,
                    flops_per_token: float, peak_tflops: float, key_config: dict, evaluator=None) -> list:
    """The run's callbacks, then `callbacks.<name>`'s. guard: the run's moe.train.guard.SpikeGuard, which
    the module's step asks too; flops_per_token, peak_tflops (one device's) and key_config (the values a
    report compares runs by): RunMetrics's MFU and summary; evaluator: in-run evaluation
    (moe.eval.in_run.InRunEval, trainer.eval_every_n_steps), which RunMetrics runs and logs; None: none."""
    from moe.train.console import StepProgressBar, bar_shown
    from moe.train.garbage import StepGarbageCollection
    from moe.train.local_ranks import LOCAL_RANKS
    from moe.train.metrics import RunMetrics
    from moe.train.preemption import PreemptionCheckpoint
    from moe.train.step_checkpoint import StepCheckpoint

    own = [
        RunMetrics(
            run_dir, log_every_n_steps=trainer.log_every_n_steps, tokens_per_step=dims.tokens_per_step,
            flops_per_token=flops_per_token, peak_flops_total=peak_tflops * 1e12 * dims.world,
            key_config=key_config, guard=guard, evaluator=evaluator,
        ),
        guard,
        LOCAL_RANKS,  # the ranks this process launched, if any: watched by the run (moe.train.local_ranks)
    ]
    if trainer.save_checkpoints:
        own += [
            steps := StepCheckpoint(run_dir / "checkpoints", trainer.checkpoint_every_n_steps,
                                    **backend.checkpoint_options()),
            PreemptionCheckpoint(backend, steps),  # saves the step through StepCheckpoint unless it just did
        ]
    if bar_shown(trainer.progress_bar):
        own.append(StepProgressBar(leave=True))
    if trainer.gc_every_n_steps:
        own.append(StepGarbageCollection(trainer.gc_every_n_steps))
    return own + instantiate_group(callbacks, "callbacks")


def build_loggers(logger: dict) -> list:
    """Experiment trackers from `logger.<name>`; metrics.csv is written regardless (logger=csv adds none)."""
    return instantiate_group(logger, "logger")


def instantiate_group(nodes: dict, group: str) -> list:
    """Instantiate every node of config group `group` (`<group>.<name>`); a missing package or a bad argument
    is one clear error."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    made = []
    for name, node in (nodes or {}).items():
        field, target = f"{group}.{name}", node.get("_target_")
        try:
            made.append(instantiate(node))
        except InstantiationException as err:
            cause = err.__cause__ or err
            missing = isinstance(cause, ImportError)
            fix = (f"install what {target} needs (pip install -e '.[loggers]' -c constraints.txt), "
                   f"or drop it: ~{field}" if missing else
                   f"fix {field}'s arguments to match {target}, or drop it: ~{field}")
            first = first_line(cause, 240)
            raise UserError(field, target, fix, problem=f"could not be built ({first})") from err
    return made


def key_config(cfg, dims: ParallelDims) -> dict:
    """The values a report compares runs by."""
    sizes = param_breakdown(cfg.model)
    keys = ["model.name", "model.num_experts", "model.top_k", "moe_opt.name", "moe_opt.capacity_factor",
            "moe_opt.eval_capacity_factor", "moe_opt.min_capacity", "moe_opt.drop_policy",
            "moe_opt.aux_loss_coeff", "moe_opt.z_loss_coeff", "moe_opt.score_function", "moe_opt.num_groups",
            "moe_opt.group_top_k", "moe_opt.group_score_experts", "moe_opt.enable_expert_bias",
            "moe_opt.load_balancing_type",
            "parallel.name", "parallel.tp", "parallel.pp", "parallel.ep",
            "hardware.name", "trainer.devices", "trainer.num_nodes", "trainer.micro_batch_size",
            "trainer.accumulate_grad_batches", "trainer.max_steps", "data.name", "data.seq_len",
            "optimizer.lr", "optimizer.min_lr", "seed", "run_name"]
    values = {key: value_at(cfg, key) for key in keys}
    values.update({"params_total": sizes.total, "params_active": sizes.active,
                   "precision": precision_of(cfg.trainer, cfg.hardware),
                   "global_batch_size": dims.global_batch})
    return values
