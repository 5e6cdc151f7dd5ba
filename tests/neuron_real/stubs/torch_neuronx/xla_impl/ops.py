from _neuron_stub import lazy_decorator as _ld
from _neuron_stub import unavailable_class as _uc


def nki_jit(*args, **kwargs):
    """Stub of torch_neuronx.xla_impl.ops.nki_jit: used as `nki_jit()(kernel)` at import time
    (parallel_layers/mappings.py:224-226, modules/moe/nki_import.py:47). Kernels raise when called."""
    return _ld("torch_neuronx.xla_impl.ops.nki_jit")(*args, **kwargs)


Argmax = _uc("torch_neuronx.xla_impl.ops.Argmax")
Softmax = _uc("torch_neuronx.xla_impl.ops.Softmax")
TopK = _uc("torch_neuronx.xla_impl.ops.TopK")
