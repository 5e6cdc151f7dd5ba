"""STAND-IN for neuronx_distributed.lightning: classes that record their constructor arguments."""
from neuronx_distributed import RECORD


class _Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        RECORD[type(self).__name__] = kwargs


class NeuronXLAStrategy(_Recorder):
    pass


class NeuronCheckpointIO(_Recorder):
    pass


class NeuronXLAPrecisionPlugin(_Recorder):
    pass


class NeuronLTModule:
    """Stand-in base class: stores the NxD module arguments (no Lightning behaviour)."""

    def __init__(self, **kwargs):
        RECORD["NeuronLTModule"] = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)
