from _neuron_stub import unavailable as _u

inline_asm_bytes = _u("neuronxcc.nki._private.private_api.inline_asm_bytes")
sendrecv = _u("neuronxcc.nki._private.private_api.sendrecv")
