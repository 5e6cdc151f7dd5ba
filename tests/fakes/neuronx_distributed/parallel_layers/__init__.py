"""FAKE neuronx_distributed.parallel_layers (tests/fakes/README.md)."""
from . import loss_functions, mappings, parallel_state  # noqa: F401
from .layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from .loss_functions import parallel_cross_entropy

PARALLEL_MODULES = [ColumnParallelLinear, RowParallelLinear, ParallelEmbedding]
PARALLEL_FUNCTIONS = [parallel_cross_entropy]
