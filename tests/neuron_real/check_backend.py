"""One trn1 layout on neuronx-distributed's real code (CPU mode), against one process of plain torch.

    torchrun --nproc_per_node 4 tests/neuron_real/check_backend.py parallel.tp=2 parallel.ep=2 ...

Builds NeuronLitMoE through our NeuronBackend exactly as train.py does (NxD's config, meta-device
init, param_init_fn, NxD's parallel layers and MoE, its pipeline when pp > 1, its expert parallelism
when ep > 1), trains two optimizer steps on fixed batches and compares them with
moe.module.lit_moe.LitMoE on one process holding every data-parallel rank's batches, same seed:

- each step's loss (the last pipeline stage's, with pp > 1), on every rank;
- each step's local gradients: a tensor-parallel shard against moe.backends.neuron.nxd_checkpoint.local_shard
  of the reference gradient (this expert-parallel rank's experts), a sequence-parallel parameter
  summed over the group, data-parallel ranks averaged (expert gradients over the expert-data-
  parallel group, as NxD reduces them);
- the gradient norm NxD's optimizer reports and every local parameter after each of its steps
  (data-parallel and EP-aware reduction, clipping, AdamW, ZeRO-1 when parallel.zero_stage=1), a
  parameter within TOLERANCE of model.init_range at least: a bias starts at zero, so after a step its
  largest value is the step (lr), and AdamW turns a gradient element near its eps into a step that
  float32 rounding moves by 1e-5 of lr (seen on the q/k/v biases: 1e-9 where a wrong gradient moves it
  by up to lr, 1e-4);
- then the validation loss of a batch of every data-parallel rank (run_eval with a pipeline).

Under expert parallelism the routing statistics of a micro-batch are summed over its EP group
(moe/backends/neuron/nxd_moe_layer.py), so the reference sums them over the same micro-batches
(`GroupStats`). Exits 0 when every tensor agrees within TOLERANCE of its largest value; a failure
names the tensor, the step and the difference.
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
from moe.config.settled import settled_config
from moe.config.validate import validate
from moe.parallel.dims import ParallelDims

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-5  # relative to each tensor's largest value
STEPS = 2
# AdamW as KARAKURI's recipe sets it (optimizer=adamw_karakuri_8x7b: eps 1e-5, lr of order 1e-4), no
# warm-up: a step moves each weight by up to lr = 3e-3 of the weights' scale (0.03), 300 times the
# tolerance, so a wrong gradient shows. AdamW divides each gradient element by about its own size
# plus eps: with eps 1e-8 float32 rounding in a near-zero element's last bits moves its weight by a
# different fraction of lr (3e-5 of the scale after one step, seen here), an amplifier eps 1e-5 damps.
OPTIMIZER = ["optimizer=adamw_karakuri_8x7b", "optimizer.lr=1e-4", "optimizer.warmup_steps=0"]
failures: list[str] = []


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def validated_dims(cfg) -> ParallelDims:
    """Every rule of moe.config.validate, then the run's ParallelDims (as train's settle)."""
    validate(cfg)
    return ParallelDims.from_config(cfg)


def close(name: str, got: torch.Tensor, want: torch.Tensor, floor: float = 1e-6) -> None:
    """Equal within TOLERANCE of the reference tensor's largest value (at least `floor`)."""
    scale = max(want.abs().max().item(), floor)
    diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else float("inf")
    if diff > TOLERANCE * scale:
        failures.append(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}, max diff {diff:.3e} "
                        f"= {diff / scale:.2e} of its scale {scale:.3e}")


def batch(cfg, seed: int) -> dict:
    """One data-parallel rank's batch of a step: accumulate_grad_batches micro-batches."""
    g = torch.Generator().manual_seed(seed)
    rows = cfg.trainer.micro_batch_size * cfg.trainer.accumulate_grad_batches
    ids = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def micro_batches(data: dict, count: int) -> list[dict]:
    chunks = zip(*(v.chunk(count) for v in data.values()), strict=True)
    return [dict(zip(data, values, strict=True)) for values in chunks]


class GroupStats:
    """The reference's routing statistics summed over an EP group's micro-batches, as each rank's
    NxDMoELayer sums them over its EP group: a first pass records every micro-batch's local sums per
    MoE layer (routing_stats' `group_sum` hook), the second adds the group's other micro-batches' to
    each, so the values (and the local gradients) are the ones the ranks compute."""

    def __init__(self, model, ep: int):
        from moe.parallel.apply import moe_layers

        self.ep, self.recorded, self.recording, self.current = ep, {}, True, (0, 0)
        for i, layer in enumerate(moe_layers(model)):
            layer.stats_sum = lambda sums, i=i: self.sum(i, sums)

    def sum(self, layer: int, sums: torch.Tensor) -> torch.Tensor:
        dp_rank, micro = self.current
        if self.recording:
            self.recorded[dp_rank, micro, layer] = sums.clone()
            return sums
        first = dp_rank - dp_rank % self.ep  # the EP group: ep consecutive data-parallel ranks
        others = [self.recorded[r, micro, layer] for r in range(first, first + self.ep) if r != dp_rank]
        return sums + sum(others, torch.zeros_like(sums))


def reference_step(ref, stats: GroupStats, data: list[dict], micro: int) -> list[list[torch.Tensor]]:
    """Forward and backward of every data-parallel rank's micro-batches on one process (the gradient of
    the mean loss over ranks and micro-batches); returns each rank's micro-batch losses."""
    dp = len(data)
    with torch.no_grad():
        stats.recording = True
        for r, rank_data in enumerate(data):
            for m, mb in enumerate(micro_batches(rank_data, micro)):
                stats.current = (r, m)
                ref.micro_batch_loss(mb)
    stats.recording = False
    losses = []
    for r, rank_data in enumerate(data):
        losses.append([])
        for m, mb in enumerate(micro_batches(rank_data, micro)):
            stats.current = (r, m)
            loss = ref.micro_batch_loss(mb)[0]
            (loss / (micro * dp)).backward()
            losses[-1].append(loss.detach())
    return losses


def main(overrides: list[str]) -> int:
    checkpoint_dir = overrides.pop(1) if overrides[:1] == ["--checkpoint"] else None
    overrides = overrides[1:] if checkpoint_dir else overrides
    from neuronx_distributed.parallel_layers import parallel_state as ps

    from moe.backends.ddp.backend import DDPBackend
    from moe.backends.neuron.backend import NeuronBackend
    from moe.backends.neuron.nxd_checkpoint import EXPERT_TENSORS, NXD_LAYOUT, local_shard, our_name, split_of
    from moe.model.expert_layout import stored
    from moe.module import LitMoE

    dist.init_process_group("gloo")  # Lightning's strategy does this in a run
    base = ["data.seq_len=32", "trainer.micro_batch_size=1", "trainer.accumulate_grad_batches=2", *OPTIMIZER]
    cfg = compose_cfg("hardware=trn1", f"trainer.devices={dist.get_world_size()}", "parallel.zero_stage=0",
                      *base, *overrides)
    backend = NeuronBackend(settled_config(cfg), validated_dims(cfg))
    module = backend.build_module()
    parts = backend.trainer_parts()  # NxD's setup reads its trainer's strategy (lightning/module.py:112)
    trainer = L.Trainer(accelerator=parts.accelerator, strategy=parts.strategy, plugins=parts.plugins,
                        devices=cfg.trainer.devices, logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    module.setup("fit")
    [optimizer], [schedule] = module.configure_optimizers()
    tp, tp_rank = ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_size(), ps.get_data_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_size(), ps.get_expert_model_parallel_rank()
    pp = ps.get_pipeline_model_parallel_size()
    last_stage = ps.get_pipeline_model_parallel_rank() == pp - 1
    micro = cfg.trainer.accumulate_grad_batches
    local = {our_name(n): p for n, p in module.model.named_parameters() if p.requires_grad}

    ref_overrides = [o for o in overrides if not o.startswith(("parallel.", "hardware."))]
    ref_cfg = settled_config(compose_cfg(*base, *ref_overrides))
    ref = LitMoE(DDPBackend(ref_cfg, ParallelDims.from_config(ref_cfg)))  # eager, one process
    ref_opt = ref.configure_optimizers()
    ref_optimizer, ref_schedule = ref_opt["optimizer"], ref_opt["lr_scheduler"]["scheduler"]
    stats = GroupStats(ref.model, ep)
    reference = dict(ref.model.named_parameters())

    def mine(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full reference tensor: its experts (in NxD's layout, as the trn1
        initialisation turns ours), its tensor-parallel shard."""
        if name.endswith(EXPERT_TENSORS):
            tensor = stored().convert(tensor.chunk(ep)[ep_rank], NXD_LAYOUT)
        return local_shard(tensor, split_of(name, cfg.model), tp_rank, tp)

    for step in range(STEPS):
        data = [batch(cfg, seed=100 * step + r) for r in range(dp)]
        if pp > 1:
            loss = module.model.run_train(**data[dp_rank])
        else:
            losses = []
            for mb in micro_batches(data[dp_rank], micro):  # as NeuronLitMoE.training_step accumulates
                mb_loss = module.model(mb["input_ids"], mb["labels"])[0]
                (mb_loss / micro).backward()
                losses.append(mb_loss.detach())
            loss = torch.stack(losses).mean()
        ref_losses = reference_step(ref, stats, data, micro)
        if last_stage:
            close(f"step {step} loss", loss.detach(), torch.stack(ref_losses[dp_rank]).mean())
        elif loss is not None:
            failures.append("a stage that is not the last returned a loss")

        for name, param in local.items():
            grad = (param.main_grad if param.grad is None else param.grad).detach().clone()
            if getattr(param, "sequence_parallel_enabled", False) and tp > 1:  # NxD's optimizer sums these
                dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
            if dp > 1:  # and averages over data parallelism, experts over their expert-data-parallel group
                expert = getattr(param, "expert_model_parallel", False)  # (parallel_layers/grads.py:285-300)
                dist.all_reduce(grad, group=ps.get_expert_data_parallel_group() if expert else
                                ps.get_data_parallel_group())
                grad /= dp
            close(f"step {step} grad {name}", grad, mine(name, reference[name].grad))

        optimizer.step()
        clip = torch.nn.utils.clip_grad_norm_(list(ref.model.parameters()), cfg.optimizer.grad_clip)
        ref_optimizer.step()
        close(f"step {step} grad norm", torch.as_tensor(float(optimizer.grad_norm)), clip)
        for name, param in local.items():  # at least init_range (docstring)
            close(f"step {step} param {name}", param.detach(), mine(name, reference[name].detach()),
                  floor=cfg.model.init_range)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        schedule["scheduler"].step()
        ref_schedule.step()

    check_validation(module, ref, cfg, dp, dp_rank, pp, last_stage)
    if checkpoint_dir:
        check_checkpoint(module, reference, cfg, checkpoint_dir, mine)
    print(f"[rank {dist.get_rank()}] tp {tp} pp {pp} dp {dp} ep {ep}: {len(local)} parameters, "
          f"{STEPS} steps, {type(optimizer.optimizer).__name__}, {'FAILED' if failures else 'OK'}",
          flush=True)
    for failure in failures[:20]:
        print(f"[rank {dist.get_rank()}]   {failure}", flush=True)
    return 1 if failures else 0


def check_checkpoint(module, reference: dict, cfg, directory: str, mine) -> None:
    """The trained weights through NxD's checkpoint format and back (`--checkpoint DIR`): written by
    NxD's save_checkpoint as a run writes them (moe/backends/neuron/nxd_checkpoint.py NxD.save), joined
    into one portable file by moe.tools.convert_nxd (read_checkpoint: what infer.py and export read too)
    and compared with the reference's on rank 0; then every rank's weights zeroed, loaded back by NxD's
    load_checkpoint (NxD.load_weights, as a resumed run loads them) and compared with its piece again."""
    from omegaconf import OmegaConf

    from moe.backends.neuron.nxd_checkpoint import NxD, our_name
    from moe.tools.consolidate import convert

    path = os.path.join(directory, "step-000002.ckpt")
    user = {"global_step": STEPS, "hyper_parameters": {"cfg": OmegaConf.to_container(cfg, resolve=True)}}
    weights = {"state_dict": module.model.state_dict(), "optimizer_states": [None]}  # no optimizer files
    NxD(keep=1).save(None, {**weights, **user}, path)
    NxD.finalize()
    dist.barrier()
    if dist.get_rank() == 0:
        portable = convert(path, os.path.join(directory, "portable.ckpt"))  # moe.tools.convert_nxd
        state = torch.load(portable, map_location="cpu", weights_only=False)["state_dict"]
        joined = {k.removeprefix("model."): v for k, v in state.items()}
        if set(joined) != set(reference):
            failures.append(f"checkpoint names: {sorted(set(joined) ^ set(reference))}")
        for name, value in joined.items():
            if name in reference:
                close(f"checkpoint {name}", value, reference[name].detach(), floor=cfg.model.init_range)
    with torch.no_grad():
        for param in module.model.parameters():
            param.zero_()
    NxD().load_weights(path, module.model)
    for name, param in module.model.named_parameters():
        want = mine(our_name(name), reference[our_name(name)].detach())
        close(f"loaded {our_name(name)}", param.detach(), want, floor=cfg.model.init_range)


def check_validation(module, ref, cfg, dp: int, dp_rank: int, pp: int, last_stage: bool) -> None:
    """The validation loss of one batch per data-parallel rank (a step's micro-batches), as train.py's
    validation computes it (NeuronLitMoE.validation_step: run_eval with a pipeline)."""
    micro = cfg.trainer.accumulate_grad_batches
    data = batch(cfg, seed=999 + dp_rank)
    module.model.eval()
    ref.model.eval()
    with torch.no_grad():
        if pp > 1:
            got = module.model.run_eval(**data)
        else:
            got = torch.stack([module.model(mb["input_ids"], mb["labels"])[1]
                               for mb in micro_batches(data, micro)]).mean()
        want = torch.stack([ref.micro_batch_loss(mb)[1] for mb in micro_batches(data, micro)]).mean()
    if last_stage:
        close("validation loss", got, want)
    module.model.train()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
