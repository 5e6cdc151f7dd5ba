"""STAND-IN for neuronx_distributed.lightning: classes that record their constructor arguments."""
from neuronx_distributed import RECORD


class _Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        RECORD[type(self).__name__] = kwargs


class NeuronXLAStrategy(_Recorder):
    """Stand-in name: records the arguments the Neuron plugin passes."""


class NeuronCheckpointIO(_Recorder):
    """Stand-in name: records the arguments the Neuron plugin passes."""


class NeuronXLAPrecisionPlugin(_Recorder):
    """Stand-in name: records the arguments the Neuron plugin passes."""


class NeuronLTModule:
    """Stand-in base class: stores the NxD module arguments (no Lightning behaviour)."""

    def __init__(self, **kwargs):
        RECORD["NeuronLTModule"] = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)
