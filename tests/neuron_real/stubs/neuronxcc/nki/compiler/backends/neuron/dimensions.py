from _neuron_stub import unavailable_class as _uc

# Only used to index NKI kernel grids, e.g. kernel[VNC(2)](...) (NKI paths only).
CCPipeline = _uc("neuronxcc.nki.compiler.backends.neuron.dimensions.CCPipeline")
VNC = _uc("neuronxcc.nki.compiler.backends.neuron.dimensions.VNC")
