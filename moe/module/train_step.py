"""One optimizer step, in one method: `TrainStep.__call__`, which every backend runs.

LitMoE and NeuronLitMoE train under Lightning's manual optimization: Lightning hands `training_step`
one step's rows (moe.data.datamodule: `micro_batch_size x accumulate_grad_batches` per rank), and the
step below does the rest, top to bottom, as torchtitan's `train_step` does:

    zero_grad -> per micro-batch: seed, forward, loss, backward -> the gradients synchronised -> their norm
    (once) -> the spike guard's decision -> clip -> optimizer step -> expert-bias update -> LR step -> the
    step's numbers for metrics.csv

What differs by hardware is a method of the backend (moe.backends.base.Backend): `micro_batch_sync` (DDP
holds its all-reduce until the last micro-batch, DeepSpeed its reduction), `sync_grads` (what the
library leaves to us: experts over expert-DP, partial gradients over TP, AMP's unscale), `grad_norm`,
`clip_gradients`, `skip_update`, `all_reduce`. A pipelined model runs every micro-batch's forward and
backward inside its schedule (`module.schedule`, moe.module.pipelined). Checkpoints, pre-emption, the
progress bar and metrics.csv's row are callbacks after the step (moe.train.callbacks): the periphery.
"""
from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass

import torch

from moe.module.step_stats import logs_step, step_means
from moe.parallel.apply import clear_replays


@dataclass
class StepRecord:
    """What metrics.csv's row of a step reads (moe.train.metrics.RunMetrics)."""

    step: int  # 1-based: the optimizer step just taken
    logged: bool  # whether metrics.csv gets a row: then `means` and `grad_norm` were read back
    means: dict | None = None  # losses and routing statistics averaged over every rank
    grad_norm: float = math.nan  # before clipping (DeepSpeed, NxD: their optimizer's; skipped: the guard's)


def step_seed(seed: int, rank: int, step: int, micro: int) -> int:
    """torch's seed before micro-batch `micro` of step `step` (0-based) on `rank`.

    Router jitter draws from torch's global generator; whatever else draws from it (a data loader
    starting, validation) differs between a resumed and an uninterrupted run. Seeding per micro-batch
    makes each step's noise a function of where it is in the run, so a resume replays it exactly without
    saving generator states (fairseq seeds per update the same way)."""
    digest = hashlib.blake2b(f"{seed}/{rank}/{step}/{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def upgrade_loop_state(checkpoint: dict) -> None:
    """Lightning's loop counters of a checkpoint saved before the step was one method (automatic
    optimization; a training batch was a micro-batch), as today's run counts them, in place: its optimizer
    steps become manual optimization's (Lightning's global_step, else a resume would restart at step 0) and
    its batches steps (the validation cadence counts them). NxD's older checkpoints, already manual, only
    have their batches counted anew."""
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not loop or "epoch_loop.manual_optimization.optim_step_progress" not in loop:
        return
    manual = loop["epoch_loop.manual_optimization.optim_step_progress"]
    automatic = loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {})
    automatic = automatic.get("step")
    if manual["total"]["completed"] == 0 and automatic and automatic["total"]["completed"] > 0:
        loop["epoch_loop.manual_optimization.optim_step_progress"] = manual = copy.deepcopy(automatic)
    trainer_cfg = checkpoint.get("hyper_parameters", {}).get("cfg", {}).get("trainer", {})
    accumulate = int(trainer_cfg.get("accumulate_grad_batches", 1) or 1)
    batches = loop.get("epoch_loop.batch_progress")
    steps = manual["total"]["completed"]
    if batches and accumulate > 1 and batches["total"]["completed"] == steps * accumulate:
        for part in ("total", "current"):
            batches[part] = {key: value // accumulate if isinstance(value, int) else value
                             for key, value in batches[part].items()}


def micro_batches(rows: dict, size: int) -> list[dict]:
    """A step's rows cut into its micro-batches of `size` rows, in order."""
    pieces = {key: value.split(size) for key, value in rows.items()}
    return [dict(zip(pieces, parts, strict=True)) for parts in zip(*pieces.values(), strict=True)]


class TrainStep:
    """The optimizer step of `module` (LitMoE or NeuronLitMoE) on its backend.

    The module gives the pieces: its run's `cfg`, `micro_batch_loss(batch) -> (loss, lm_loss, routing)`,
    `schedule` (a pipeline's, else None), `step_stats`, `count_expert_picks` and `expert_bias`,
    `monitor_routing`; the guard (moe.train.guard.SpikeGuard, None: no guard) decides whether the update is
    taken.
    """

    def __init__(self, module, guard=None):
        self.module, self.backend, self.cfg, self.guard = module, module.backend, module.cfg, guard
        self.last: StepRecord | None = None

    def __call__(self, rows: dict) -> torch.Tensor:
        """The next optimizer step on this rank's rows of it; returns the step's mean loss (detached)."""
        module, backend, cfg = self.module, self.backend, self.cfg
        step, rank = module.trainer.global_step + 1, module.trainer.global_rank  # step: 1-based
        optimizer, scheduler = module.optimizers(), module.lr_schedulers()
        logged = logs_step(step, cfg.trainer.log_every_n_steps, cfg.trainer.max_steps)
        module.step_stats.reset()
        module.monitor_routing(logged)  # the drop, load and entropy numbers only where metrics.csv reads them
        optimizer.zero_grad()

        # 1. forward and backward of every micro-batch (a pipeline's schedule runs them all at once)
        batches = micro_batches(rows, cfg.trainer.micro_batch_size)
        if module.schedule is not None:
            torch.manual_seed(step_seed(cfg.seed, rank, step - 1, 0))
            loss = module.schedule.forward_backward(module, batches)
        else:
            losses = []
            for i, batch in enumerate(batches):
                torch.manual_seed(step_seed(cfg.seed, rank, step - 1, i))  # router jitter replays on resume
                clear_replays(module.model)
                with backend.micro_batch_sync(module, last=i == len(batches) - 1):
                    loss, lm_loss, routing = module.micro_batch_loss(batch)
                    module.manual_backward(loss / len(batches))
                module.step_stats.add(loss=loss, lm_loss=lm_loss, routing=routing,
                                      tokens=batch["input_ids"].numel())
                module.count_expert_picks(routing)
                losses.append(loss.detach())
            loss = torch.stack(losses).mean()

        # 2. the gradients: synchronised where the library leaves it to us, their global norm once
        backend.sync_grads(module)
        norm = backend.grad_norm(module)

        # 3. the spike guard decides from the step's loss over every rank and the norm; else clip
        skipped = self.guard is not None and self.guard.skips(step, module, norm)
        if skipped:
            backend.skip_update(module)
        elif cfg.optimizer.grad_clip:  # DeepSpeed and NxD clip inside their optimizer's step instead
            backend.clip_gradients(module, norm, float(cfg.optimizer.grad_clip))

        # 4. the update: weights, then the routers' expert bias, then the learning rate
        optimizer.step()
        if module.expert_bias is not None:  # every rank of the stage holds these layers
            module.expert_bias.step(lambda t: backend.all_reduce(module, t, "sum", stage_only=True))
        scheduler.step()

        # 5. the step's numbers for metrics.csv: read back from the device only on a logged step
        self.last = StepRecord(step=step, logged=logged)
        if logged:
            self.last.means = step_means(module)
            # a skipped step's optimizer computed no norm (DeepSpeed's says inf, NxD's is the last step's):
            # the guard's, which it decided from
            after = backend.norm_after_step and not skipped
            logged_norm = backend.grad_norm_after_step(module) if after else float(norm)
            self.last.grad_norm = math.nan if logged_norm is None else logged_norm
        return loss
