"""STAND-IN for neuronx_distributed.parallel_layers.mappings (names only)."""


def scatter_to_sequence_parallel_region(input_, sequence_dimension=0, process_group=None):
    raise RuntimeError("stand-in: needs a Neuron device")
