"""Stub of neuronxcc.nki.typing: `nt.tensor` appears in NKI kernel signatures (import time)."""
from _neuron_stub import unavailable_class as _uc

tensor = _uc("neuronxcc.nki.typing.tensor")
