"""What plain PyTorch DDP can do (moe.config.specs.BackendSpec), readable without importing torch."""
from __future__ import annotations

from moe.config.specs import LIGHTNING_PRECISIONS, BackendSpec

SPEC = BackendSpec(
    name="ddp", library="PyTorch DDP", max_zero_stage=0, tensor_parallel=False, pipeline_parallel=False,
    hybrid_shard=False, precisions=LIGHTNING_PRECISIONS, backend="moe.backends.ddp.backend:DDPBackend",
    whole_model_per_rank=True)
