"""STAND-IN for neuronx_distributed.parallel_layers: names only, for imports (never run)."""
from neuronx_distributed.parallel_layers import mappings, parallel_state  # noqa: F401


class ColumnParallelLinear:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("stand-in: NxD parallel layers need a Neuron device")


class RowParallelLinear(ColumnParallelLinear):
    """Stand-in name: constructing it raises, as without a Neuron device."""


class ParallelEmbedding(ColumnParallelLinear):
    """Stand-in name: constructing it raises, as without a Neuron device."""
