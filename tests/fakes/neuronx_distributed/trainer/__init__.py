"""FAKE neuronx_distributed.trainer (tests/fakes/README.md)."""
from .checkpoint import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint  # noqa: F401
from .trainer import initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config  # noqa: F401
