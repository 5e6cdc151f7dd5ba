from _neuron_stub import unavailable_class as _uc

Packer = _uc("torch_neuronx.xla_impl.structure.Packer")
Flattener = _uc("torch_neuronx.xla_impl.structure.Flattener")
