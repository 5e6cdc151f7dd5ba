"""Each rank's peak memory in a trn1 layout on neuronx-distributed's real code (CPU mode), against the
planner.

    torchrun --nproc_per_node 8 tests/neuron_real/measure_memory.py experiment=karakuri_8x7b_trn1 ...

The planner (moe/tools/plan.py, what `dry_run=true` prints) sizes a trn1 run from config arithmetic.
NxD's layers cannot be built off a Neuron/XLA device at the full layout's world (its CPU mode makes
a gloo group for every process group of the world, parallel_layers/parallel_state.py:797-801, so
512 ranks would mean 512 processes), so this measures the preset's structure at reduced width: the
model NeuronBackend builds, NxD's pipeline, expert parallelism and ZeRO-1, two optimizer steps of
train.py's micro-batches, counting the bytes of every live tensor (`LiveBytes`: parameters, ZeRO-1's
shards and optimizer state, gradients, activations, communication buffers), and compares the largest
rank's peak with the planner's total for the same config. Run it with hardware.neuron_precision=fp32:
on CPU tensors XLA's bf16 variables do nothing, so fp32 is what runs here and what the planner must be
asked about.

Exits 0 when the planner is within TOLERANCE of the measured peak.
"""

from __future__ import annotations

import sys
import weakref

import cpu_mode  # noqa: F401  (applies the harness patches, README.md)
import lightning as L
import torch
import torch.distributed as dist
from check_backend import batch, compose_cfg, validated_dims
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from moe.tools.plan import GIB, make_plan

TOLERANCE = 0.20
STEPS = 2


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU tensors alive (each storage once): those given, and every one an op makes while it
    is entered; `peak` is the most at once. torch's MemTracker does this too, but per module call, which a
    pipeline stage running once per micro-batch (and NxD's frozen SPMDRank parameters) trips up."""

    def __init__(self, tensors):
        super().__init__()
        self.seen, self.current, self.peak = WeakIdKeyDictionary(), 0, 0
        for tensor in tensors:
            self.count(tensor)

    def count(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        if storage in self.seen:
            return
        self.seen[storage] = size = storage.nbytes()
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self.release, size)

    def release(self, size: int) -> None:
        self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self.count(tensor)
        return out


def main(overrides: list[str]) -> int:
    from neuronx_distributed.parallel_layers import parallel_state as ps

    from moe.backends.neuron.backend import NeuronBackend
    from moe.backends.neuron.strategy import shards, zero1_parts
    from moe.config.settled import settled_config

    dist.init_process_group("gloo")
    cfg = compose_cfg(*overrides, f"trainer.devices={dist.get_world_size()}")
    dims = validated_dims(cfg)
    backend = NeuronBackend(settled_config(cfg), dims)
    module = backend.build_module()
    parts = backend.trainer_parts()
    trainer = L.Trainer(accelerator=parts.accelerator, strategy=parts.strategy, plugins=parts.plugins,
                        devices=cfg.trainer.devices, logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    module.setup("fit")
    [optimizer], _ = module.configure_optimizers()

    wrapped = module.model.module  # NxDModel's NxDPPModel or NxDCausalLM (trainer/model.py)
    stages = getattr(wrapped, "local_stage_modules", [wrapped])  # this rank's stage(s) under a pipeline
    tracker = LiveBytes([*(t for m in stages for t in (*m.parameters(), *m.buffers())),
                         *(shard for zero1 in zero1_parts(optimizer) for shard in shards(zero1))])
    dp_rank = ps.get_data_parallel_rank()
    with tracker:
        for step in range(STEPS):
            data = batch(cfg, seed=100 * step + dp_rank)
            if dims.pp > 1:
                module.model.run_train(**data)
            else:
                module.model(data["input_ids"], data["labels"])[0].backward()
            optimizer.step()
            optimizer.zero_grad()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (dist.get_rank(), tracker.peak))
    if dist.get_rank() != 0:
        return 0
    rank, measured = max(peaks, key=lambda p: p[1])
    plan = make_plan(cfg, dims).memory
    error = (plan.total * GIB - measured) / measured
    parts = {"parameters": plan.params, "gradients": plan.grads, "optimizer": plan.optimizer,
             "activations": plan.activations, "step": plan.step}
    planned = ", ".join(f"{what} {gib * 1024:.1f}" for what, gib in parts.items())
    print(f"summary: tp {dims.tp} x pp {dims.pp} x dp {dims.dp} (ep {dims.ep}), "
          f"{cfg.model.num_layers} layers, micro-batch {cfg.trainer.micro_batch_size} x {cfg.data.seq_len}: "
          f"largest peak rank {rank} {measured / 2**20:.1f} MiB; planner {plan.total * 1024:.1f} MiB "
          f"({planned}): {100 * error:+.1f}%", flush=True)
    for r, total in sorted(peaks):
        print(f"  rank {r}: peak {total / 2**20:.1f} MiB", flush=True)
    return 0 if abs(error) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
