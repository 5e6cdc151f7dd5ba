from _neuron_stub import unavailable as _u

replace_weights = _u("torch_neuronx.xla_impl.torchscript.replace_weights")
