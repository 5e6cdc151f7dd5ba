"""One optimizer step, in one method: `TrainStep.__call__`, which every backend runs.

LitMoE and NeuronLitMoE train under Lightning's manual optimization: Lightning hands `training_step`
one step's rows (moe.data.datamodule: `micro_batch_size x accumulate_grad_batches` per rank), and the
step below does the rest, top to bottom, as torchtitan's `train_step` does:

    zero_grad -> per micro-batch: seed, forward, loss, backward -> the gradients synchronised -> their norm
    (once) -> the spike guard's decision -> clip -> optimizer step -> expert-bias update -> LR step -> the
    step's numbers for metrics.csv

The step drives a module (`StepModule`: six members, LitMoE's and NeuronLitMoE's) on a backend
(`StepBackend`, moe.backends.base.Backend), and owns what lives for one step: its sums and counts
(moe.module.step_stats), the expert picks of the aux-loss-free balancing (moe.module.expert_bias) and the
record metrics.csv reads. What differs by hardware is a method of the backend, each complete on its own:
`micro_batch_sync` (DDP holds its all-reduce until the last micro-batch, DeepSpeed its reduction, NxD cuts
its graph), `sync_grads` (what the library leaves to us: experts over expert-DP, partial gradients over TP,
AMP's unscale), `grad_norm`, `clip_gradients`, `skip_update` (after which `optimizer.step()` leaves the
weights and the optimizer state as they are), `logged_grad_norm`, `all_reduce`. A pipelined model runs
every micro-batch's forward and backward inside its schedule (`module.schedule`, moe.module.pipelined).
Checkpoints, pre-emption, the progress bar and metrics.csv's row are callbacks after the step
(moe.train.callbacks): the periphery.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from moe.config.schema import TrainConfig
from moe.module.step_stats import StepStats, logs_step, step_means
from moe.parallel.apply import clear_replays, moe_layers


@dataclass
class StepRecord:
    """What metrics.csv's row of a step reads (moe.train.metrics.RunMetrics)."""

    step: int  # 1-based: the optimizer step just taken
    logged: bool  # whether metrics.csv gets a row: then everything below was read back
    means: dict | None = None  # losses and routing statistics averaged over every rank
    grad_norm: float = math.nan  # before clipping (DeepSpeed, NxD: their optimizer's; skipped: the guard's)
    tokens_per_expert: list = field(default_factory=list)  # [moe_layer][expert] of this rank's last forward
    tokens_per_forward: int = 0  # the tokens of that forward


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


class Schedule(Protocol):
    """A pipeline's schedule (moe.module.pipelined, NxD's in moe/backends/neuron/module.py)."""

    def forward_backward(self, module: StepModule, micro_batches: list[dict], stats: StepStats,
                         count_picks: Callable[[list], None]) -> torch.Tensor:
        """Every micro-batch's forward and backward; their numbers into `stats`, each micro-batch's routing
        to `count_picks`; the step's mean loss where this rank holds it, else 0."""


class StepModule(Protocol):
    """The module the step drives (LitMoE, NeuronLitMoE: moe.module.shared_hooks): a LightningModule under
    manual optimization, around the model it trains."""

    trainer: Any  # Lightning's Trainer: the step's number, the rank, the LR schedule (lr_scheduler_configs)
    model: nn.Module  # what trains: its MoE layers are monitored, their replays cleared, their bias balanced
    schedule: Schedule | None  # a pipeline's, which runs every micro-batch itself; None: the step does

    def micro_batch_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None, list,
                                                     torch.Tensor | None]:
        """(training loss, LM loss, each MoE layer's RoutingStats, multi-token-prediction loss or None) of one
        micro-batch."""

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Lightning's backward, through its strategy and precision (AMP's scaling, DeepSpeed's engine)."""

    def optimizers(self) -> Any:
        """Lightning's wrapper of the optimizer: its `step()` goes through the strategy and the precision
        plugin and counts the step (the Trainer's global_step)."""


class StepBackend(Protocol):
    """What the step asks of the hardware's backend (moe.backends.base.Backend, its docs say each one)."""

    cfg: TrainConfig

    def micro_batch_sync(self, module, last: bool) -> contextlib.AbstractContextManager: ...
    def sync_grads(self, module) -> None: ...
    def grad_norm(self, module) -> torch.Tensor: ...
    def clip_gradients(self, module, norm: torch.Tensor, max_norm: float) -> None: ...
    def skip_update(self, module) -> None: ...
    def logged_grad_norm(self, module, norm: torch.Tensor) -> float: ...
    def all_reduce(self, module, tensor: torch.Tensor, op: str, stage_only: bool = False) -> torch.Tensor: ...


class Guard(Protocol):
    """The spike guard (moe.train.guard.SpikeGuard)."""

    def skips(self, step: int, trainer, grad_norm: torch.Tensor, step_loss: Callable[[], float]) -> bool: ...


class TrainStep:
    """The optimizer step of `module` on `backend`, and what lives for one step: its statistics (`stats`),
    the expert picks it counts (`expert_bias`) and, after it, its record (`last`). The guard (None: no guard)
    decides whether the update is taken."""

    def __init__(self, module: StepModule, backend: StepBackend, guard: Guard | None = None):
        self.module, self.backend, self.cfg, self.guard = module, backend, backend.cfg, guard
        self.stats = StepStats()
        self.expert_bias = None  # moe.module.expert_bias.ExpertBiasUpdate, made at the first step that picks
        self.last: StepRecord | None = None

    def __call__(self, rows: dict) -> torch.Tensor:
        """The next optimizer step on this rank's rows of it; returns the step's mean loss (detached)."""
        module, backend, cfg = self.module, self.backend, self.cfg
        trainer = module.trainer
        step, rank = trainer.global_step + 1, trainer.global_rank  # step: 1-based
        optimizer = module.optimizers()
        logged = logs_step(step, cfg.trainer.log_every_n_steps, cfg.trainer.max_steps)
        self.stats = StepStats()
        for layer in moe_layers(module.model):  # the drop, load and entropy numbers only where metrics.csv
            layer.monitor = logged  # reads them (NxD's layers compute theirs on every forward)
        optimizer.zero_grad()

        # 1. forward and backward of every micro-batch (a pipeline's schedule runs them all at once)
        batches = micro_batches(rows, cfg.trainer.micro_batch_size)
        if module.schedule is not None:
            torch.manual_seed(step_seed(cfg.seed, rank, step - 1, 0))
            loss = module.schedule.forward_backward(module, batches, self.stats, self.count_expert_picks)
        else:
            losses = []
            for i, batch in enumerate(batches):
                torch.manual_seed(step_seed(cfg.seed, rank, step - 1, i))  # router jitter replays on resume
                clear_replays(module.model)
                with backend.micro_batch_sync(module, last=i == len(batches) - 1):
                    loss, lm_loss, routing, mtp_loss = module.micro_batch_loss(batch)
                    module.manual_backward(loss / len(batches))
                self.stats.add(loss=loss, lm_loss=lm_loss, routing=routing, tokens=batch["input_ids"].numel(),
                               mtp_loss=mtp_loss)
                self.count_expert_picks(routing)
                losses.append(loss.detach())
            loss = torch.stack(losses).mean()

        # 2. the gradients: synchronised where the library leaves it to us, their global norm once
        backend.sync_grads(module)
        norm = backend.grad_norm(module)

        # 3. the spike guard decides from the step's loss over every rank and the norm; else clip
        skipped = self.guard is not None and self.guard.skips(step, trainer, norm, self.mean_loss)
        if skipped:
            backend.skip_update(module)  # the step below then leaves weights and optimizer state as they are
        elif cfg.optimizer.grad_clip:  # DeepSpeed and NxD clip inside their optimizer's step instead
            backend.clip_gradients(module, norm, float(cfg.optimizer.grad_clip))

        # 4. the update: weights, then the routers' expert bias, then the learning rate
        optimizer.step()
        if self.expert_bias is not None:  # every rank of the stage holds these layers
            self.expert_bias.step(lambda t: backend.all_reduce(module, t, "sum", stage_only=True))
        for config in trainer.lr_scheduler_configs:
            config.scheduler.step()

        # 5. the step's numbers for metrics.csv: read back from the device only on a logged step
        self.last = StepRecord(step=step, logged=logged)
        if logged:
            self.last.means = self.means()
            # a skipped step's optimizer computed no norm (DeepSpeed's says inf, NxD's is the last step's):
            # the guard's, which it decided from
            self.last.grad_norm = float(norm) if skipped else backend.logged_grad_norm(module, norm)
            self.last.tokens_per_expert = self.stats.tokens_per_expert()
            self.last.tokens_per_forward = self.stats.last_tokens_per_forward
        return loss

    def means(self) -> dict[str, float]:
        """The step's losses and routing statistics averaged over every rank: one all-reduce and one host
        read, the first time a step asks (moe.module.step_stats.step_means)."""
        def sum_over_ranks(totals: torch.Tensor) -> torch.Tensor:
            return self.backend.all_reduce(self.module, totals, "sum")

        return step_means(self.stats, sum_over_ranks, self.cfg.model, self.cfg.moe_opt)

    def mean_loss(self) -> float:
        """The step's loss averaged over micro-batches and ranks (what the spike guard decides from)."""
        return self.means()["loss"]

    def count_expert_picks(self, routing: list) -> None:
        """One micro-batch's picks per expert, for the aux-loss-free balancing (moe.module.expert_bias)."""
        if self.cfg.moe_opt.enable_expert_bias:
            if self.expert_bias is None:
                from moe.module.expert_bias import ExpertBiasUpdate

                self.expert_bias = ExpertBiasUpdate(self.module.model, self.cfg.moe_opt.bias_update_rate)
            self.expert_bias.add(routing)
