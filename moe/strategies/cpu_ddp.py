"""CPU: one process per device, DDP over gloo; a single device runs without DDP."""
from __future__ import annotations

import os

from moe.strategies.base import StrategyBundle


def build_ddp(cfg) -> StrategyBundle:
    from lightning.pytorch.strategies import DDPStrategy

    world = cfg.trainer.devices * cfg.trainer.num_nodes
    strategy = DDPStrategy(process_group_backend=cfg.hardware.backend) if world > 1 else "auto"
    precision = cfg.trainer.precision or cfg.hardware.precision
    threads = max(1, (os.cpu_count() or 1) // cfg.trainer.devices)  # ranks share the cores
    return StrategyBundle(accelerator=cfg.hardware.accelerator, strategy=strategy, precision=precision,
                          env={"OMP_NUM_THREADS": str(threads), **cfg.hardware.env}, num_threads=threads)
