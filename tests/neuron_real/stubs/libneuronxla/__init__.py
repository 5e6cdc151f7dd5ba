"""CPU stub of libneuronxla (NOT the real PJRT plugin). See tests/neuron_real/README.md.

Deliberately has no `neuron_xla_wlo_compile`: NxD imports that name inside try/except
(trace/functions.py:23, trace/model_builder.py:66) and treats its absence as "not supported".
"""
from _neuron_stub import unavailable as _u

__version__ = "0.0.0+cpustub"
neuron_xla_compile = _u("libneuronxla.neuron_xla_compile")
