"""What one training step computes, on every backend: the step and what it drives and asks (train_step.py),
the LightningModule (lit_moe.py: loss and hooks; shared_hooks.py: what NxD's module shares with it), the
optimizer groups and schedule (optim.py), the step's sums and counts (step_stats.py) and the aux-loss-free
bias update (expert_bias.py).

Below the backends in the stage order: a backend builds this module (or its own, NxD's, from these
parts) and the module asks the backend what is special about its gradients and checkpoints.
"""
from moe.module.lit_moe import LitMoE

__all__ = ["LitMoE"]
