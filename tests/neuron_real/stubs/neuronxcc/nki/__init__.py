from _neuron_stub import lazy_decorator as _ld

jit = _ld("neuronxcc.nki.jit")
