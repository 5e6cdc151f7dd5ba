from _neuron_stub import lazy_decorator as _ld

# Used as a decorator at class-definition time (modules/moe/blockwise.py:108,116,124).
xla_call = _ld("torch_neuronx.xla_impl.base.xla_call")
