"""NeuronLitMoE: neuronx-distributed's NeuronLTModule training our model, objective and optimizer groups.

The model is `layers.build_model` (our MoETransformer with NxD layers under NxDCausalLM), built
by NxD in `setup` (NeuronLTModule.setup -> initialize_parallel_model, src/neuronx_distributed/
lightning/module.py:103-112, v2.28.0); the loss is moe.model.loss's; the optimizer groups are
moe.module.optim's, over this rank's parameters, under NxD's optimizer wrapper (ZeRO-1, clipping).

Manual optimization, as NxD requires (its precision plugin never runs a closure), and as every backend
trains: training_step is the one optimizer step of moe.module.train_step over a step's rows. With
pipeline parallelism NxD runs forward and backward of every micro-batch of a step in `run_train`
(`NxDPipelineSchedule`), which takes the whole step's batch on the CPU (lightning/strategy.py:151-153)
and returns the loss on the last stage only, None on the others (pipeline/model.py:1974-2000).
Metrics are sums and counts (moe.module.step_stats), so a stage without the loss simply counts none;
with the pipeline the LM loss is not returned separately, and metrics.csv derives it from the loss and
the router terms.
"""
from __future__ import annotations

import torch
import torch_xla.core.xla_model as xm
from neuronx_distributed.lightning import NeuronLTModule
from neuronx_distributed.trainer import initialize_parallel_optimizer

from moe.backends.neuron.causal_lm import pop_routing
from moe.backends.neuron.layers import build_model
from moe.module.optim import build_scheduler, param_groups
from moe.module.shared_hooks import SharedHooks
from moe.module.step_stats import StepStats


class NeuronLitMoE(SharedHooks, NeuronLTModule):
    def __init__(self, nxd_config: dict, backend, guard=None):
        run_cfg = backend.cfg  # the backend's frozen dataclasses: read, not edited (as LitMoE)
        sp = backend.dims.sequence_parallel
        super().__init__(
            nxd_config=nxd_config, opt_cls=torch.optim.AdamW, scheduler_cls=None,
            model_fn=lambda: build_model(run_cfg.model, run_cfg.moe_opt, run_cfg.seed, sp),
            grad_accum_steps=run_cfg.trainer.accumulate_grad_batches,
            train_batch_size=run_cfg.trainer.micro_batch_size, manual_opt=True,
        )
        self.train_on(backend, guard)
        self.pp = backend.dims.pp
        self.schedule = NxDPipelineSchedule() if self.pp > 1 else None

    def configure_optimizers(self):
        """moe.module.optim's groups over this rank's parameters, NxD's optimizer, our schedule."""
        opt, zero1 = self.cfg.optimizer, self.cfg.parallel.zero_stage == 1
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]  # local under PP
        # With ZeRO-1, NxD's max_grad_norm is ignored: torch-xla's ZeroRedundancyOptimizer clips at its
        # own max_norm (default 1.0), which the optimizer keyword arguments reach (trainer/trainer.py:
        # 250-301); without ZeRO-1 NxDOptimizer clips at optimizer_config["max_grad_norm"].
        clip = {"max_norm": float(opt.grad_clip)} if zero1 and opt.grad_clip > 0 else {}
        optimizer = initialize_parallel_optimizer(
            self.nxd_config, torch.optim.AdamW,
            param_groups(params, opt.weight_decay, opt.no_decay_norms_and_biases),
            lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, **clip)
        optimizer.zero_grad()
        scheduler = build_scheduler(optimizer, opt, self.cfg.trainer.max_steps)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def on_train_start(self) -> None:
        """The learning rate of the schedule's step: a resumed run's optimizer may not hold it. NxD's
        expert-parallel ZeRO-1 loads its two inner optimizers' state, not its own param groups
        (optimizer/zero_redundancy_optimizer.py:332-380), and copies their learning rate inward at every
        step (:276-280): resumed, it would take a step at the rate it was built with (tests/neuron_real
        saw the step after a resume off by 2e-3 in the loss). Elsewhere this changes nothing."""
        for config in self.trainer.lr_scheduler_configs:
            for group, lr in zip(config.scheduler.optimizer.param_groups, config.scheduler.get_last_lr(),
                                 strict=True):
                group["lr"] = lr

    def training_step(self, rows: dict, batch_idx: int):
        """The step (SharedHooks), in an XLA graph of its own: what ran before it is executed first."""
        xm.mark_step()
        return super().training_step(rows, batch_idx)

    def micro_batch_loss(self, batch: dict):
        """(training loss, LM loss, each MoE layer's RoutingStats, None: no multi-token prediction on trn1) of
        one micro-batch (NxDCausalLM's). NxD's MoE layers compute their statistics on every forward
        (moe/backends/neuron/nxd_moe_layer.py)."""
        loss, lm = self.model(batch["input_ids"], batch["labels"])
        return loss, lm, pop_routing(self.model.modules()), None

    def validation_step(self, batch: dict, batch_idx: int):
        """LM loss (router terms are not computed in eval); metrics sum it over ranks. With pipeline
        parallelism a validation batch holds a whole step's micro-batches (NeuronBackend.
        val_micro_batches), which run_eval cuts into num_microbatches (pipeline/model.py:1074-1077)."""
        if self.pp > 1:
            lm = self.model.run_eval(input_ids=batch["input_ids"], labels=batch["labels"])
        else:
            _, lm = self.model(batch["input_ids"], batch["labels"])
        if lm is not None:
            self.val_stats.add_losses(lm, lm)
        return lm



class NxDPipelineSchedule:
    """NxD's pipeline runs every micro-batch of the step in `run_train` (pipeline/model.py:1974-2000)."""

    def forward_backward(self, module, micro_batches: list[dict], stats: StepStats,
                         count_picks) -> torch.Tensor:
        """The step's loss on the last stage; the routing of this stage's MoE layers (no expert picks to
        count: no aux-loss-free balancing on trn1)."""
        ids, labels = (torch.cat([b[k] for b in micro_batches]) for k in ("input_ids", "labels"))
        loss = module.model.run_train(input_ids=ids, labels=labels)  # None off the last stage
        if loss is not None:
            stats.add_losses(loss)
        stats.add_routing(pop_routing(module.model.modules()), ids.numel() // len(micro_batches))
        return loss.detach() if loss is not None else torch.zeros(())
