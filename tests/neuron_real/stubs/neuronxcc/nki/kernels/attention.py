from _neuron_stub import unavailable_class as _uc

FlashConfig = _uc("neuronxcc.nki.kernels.attention.FlashConfig")
