"""FAKE neuronx_distributed.parallel_layers.mappings: at tensor parallelism 1 every region is the identity."""


def scatter_to_sequence_parallel_region(input_, sequence_dimension=0, process_group=None):
    return input_


def gather_from_sequence_parallel_region(input_, sequence_dimension=0, to_model_parallel=True, process_group=None,
                                         tile_cc=False):
    return input_


def reduce_scatter_to_sequence_parallel_region(input_, sequence_dimension=0, process_group=None, dtype=None):
    return input_
