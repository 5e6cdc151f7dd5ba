"""STAND-IN for neuronx_distributed.parallel_layers.parallel_state (names only)."""


def get_tensor_model_parallel_size():
    raise RuntimeError("stand-in: needs a Neuron device")


def get_tensor_model_parallel_rank():
    raise RuntimeError("stand-in: needs a Neuron device")
