"""One trn1 layout on neuronx-distributed's real code (CPU mode), against one process of plain torch.

    torchrun --nproc_per_node 2 tests/neuron_real/check_backend.py parallel.tp=2 moe_opt=nxd ...

Builds NeuronLitMoE through our NeuronBackend exactly as train.py does (NxD's config, meta-device
init, param_init_fn, NxD's parallel layers and MoE, its pipeline when pp > 1), runs one training
step on a fixed batch, and compares with moe.train.module.LitMoE on one process, same seed:

- the loss (the last pipeline stage's, with pp > 1), on every rank;
- every local gradient: a tensor-parallel shard against moe.backends.neuron.shards.local_shard of
  the reference gradient, a sequence-parallel parameter summed over the group, others equal;
- after NxD's optimizer step (data-parallel average, sequence-parallel reduce, clipping, AdamW),
  every local parameter, and the gradient norm NxD reports.

Exits 0 when all agree within 2e-5 of each tensor's scale (parameters after the step: or a tenth of
the learning rate, AdamW's first step being about lr whatever the gradient).
"""

from __future__ import annotations

import os
import sys

import cpu_mode  # noqa: F401  (applies the harness patches, README.md)
import lightning as L
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

import moe.config  # noqa: F401
from moe.config.validate import validate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 2e-5
failures: list[str] = []


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 0.0) -> None:
    """Equal within TOLERANCE of the tensor's largest value, or within atol."""
    scale = max(want.abs().max().item(), 1e-3)
    diff = (got.float() - want.float()).abs().max().item()
    if got.shape != want.shape or diff > max(TOLERANCE * scale, atol):
        failures.append(
            f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}, diff {diff:.2e} (scale {scale:.2e})"
        )


def batch(cfg, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(
        0, cfg.model.vocab_size, (2 * cfg.trainer.accumulate_grad_batches, cfg.data.seq_len), generator=g
    )
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def main(overrides: list[str]) -> int:
    from neuronx_distributed.parallel_layers import parallel_state as ps

    from moe.backends.neuron import NeuronBackend
    from moe.backends.neuron.shards import layout_of, local_shard, our_name
    from moe.train.module import LitMoE

    dist.init_process_group("gloo")  # Lightning's strategy does this in a run
    cfg = compose_cfg(
        "hardware=trn1", "trainer.devices=2", "parallel.zero_stage=0", "data.seq_len=32", *overrides
    )
    backend = NeuronBackend(cfg, validate(cfg))
    module = backend.build_module()
    parts = backend.trainer_parts()  # NxD's setup reads its trainer's strategy (lightning/module.py:112)
    trainer = L.Trainer(
        accelerator=parts.accelerator,
        strategy=parts.strategy,
        plugins=parts.plugins,
        devices=cfg.trainer.devices,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.strategy.connect(module)
    module.trainer = trainer
    module.setup("fit")
    optimizer = module.configure_optimizers()[0][0]
    tp, tp_rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_size(), ps.get_data_parallel_rank()
    last_stage = ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_model_parallel_size() - 1
    mine = batch(cfg, seed=dp_rank)

    if backend.layout.pp > 1:
        loss = module.model.run_train(input_ids=mine["input_ids"], labels=mine["labels"])
    else:
        loss = module.model(mine["input_ids"], mine["labels"])[0]
        loss.backward()
    local = {our_name(n): p for n, p in module.model.named_parameters()}

    # the reference: one process, every data-parallel rank's batch, micro-batches as NxD cuts them
    ref = LitMoE(compose_cfg("data.seq_len=32", *[o for o in overrides if not o.startswith("parallel.")]))
    ref_optimizer = ref.configure_optimizers()["optimizer"]
    micro = cfg.trainer.accumulate_grad_batches
    my_losses = []
    for r in range(dp):
        data = batch(cfg, seed=r)
        for ids, labels in zip(data["input_ids"].chunk(micro), data["labels"].chunk(micro), strict=True):
            ref_loss = ref.losses({"input_ids": ids, "labels": labels})[0]
            (ref_loss / (micro * dp)).backward()
            if r == dp_rank:
                my_losses.append(ref_loss.detach())
    if last_stage:
        close("loss", loss.detach(), torch.stack(my_losses).mean())
    elif loss is not None:
        failures.append("a stage that is not the last returned a loss")

    reference = dict(ref.model.named_parameters())
    for name, param in local.items():
        grad = param.grad.detach().clone()
        if getattr(param, "sequence_parallel_enabled", False) and tp > 1:  # NxD's optimizer sums these
            dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        if dp > 1:  # and averages over data parallel
            dist.all_reduce(grad, group=ps.get_data_parallel_group())
            grad /= dp
        close(
            f"grad {name}", grad, local_shard(reference[name].grad, layout_of(name, cfg.model), tp_rank, tp)
        )

    optimizer.step()
    clip = torch.nn.utils.clip_grad_norm_(list(ref.model.parameters()), cfg.optimizer.grad_clip)
    ref_optimizer.step()
    close("grad norm", torch.as_tensor(float(optimizer.grad_norm)), clip)
    # AdamW's first step moves every weight by about lr whatever its gradient's size, so a gradient
    # within rounding of zero may move either way: a tenth of a step is the tolerance
    step_size = ref_optimizer.param_groups[0]["lr"]
    for name, param in local.items():
        close(
            f"param {name}",
            param.detach(),
            local_shard(reference[name].detach(), layout_of(name, cfg.model), tp_rank, tp),
            atol=0.1 * step_size,
        )
    print(
        f"[rank {dist.get_rank()}] tp {tp} pp {ps.get_pipeline_model_parallel_size()} dp {dp}: "
        f"{len(local)} parameters, loss {'-' if loss is None else f'{float(loss):.6f}'}, "
        f"{'OK' if not failures else 'FAILED'}",
        flush=True,
    )
    for failure in failures[:20]:
        print(f"[rank {dist.get_rank()}]   {failure}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
