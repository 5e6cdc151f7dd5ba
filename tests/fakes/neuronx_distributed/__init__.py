"""FAKE neuronx_distributed (NxD v2.28.0 API) for CPU tests: tests/fakes/README.md says what it is and is not."""
FAKE = True

from . import lightning, modules, parallel_layers, pipeline, trainer  # noqa: E402,F401
from .trainer.checkpoint import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402,F401
from .trainer.trainer import (  # noqa: E402,F401
    initialize_parallel_model,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)
