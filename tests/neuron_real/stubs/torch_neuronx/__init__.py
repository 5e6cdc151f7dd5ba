"""CPU stub of torch-neuronx (NOT the real package). See tests/neuron_real/README.md."""
__version__ = "0.0.0+cpustub"

from _neuron_stub import unavailable_class as _uc

BucketModelConfig = _uc("torch_neuronx.BucketModelConfig")

# The real torch-neuronx registers TorchScript custom classes torch.classes.neuron.* from its C++
# library on import. NxD names two of them in annotations that are evaluated at import time
# (trace/spmd.py:19, trace/nxd_model/*.py). Python stand-ins that raise when instantiated:
import torch as _torch

_ns = _torch.classes.neuron
for _n in ("SPMDModel", "LayoutTransformation"):
    setattr(_ns, _n, _uc(f"torch.classes.neuron.{_n}"))
del _ns, _n
