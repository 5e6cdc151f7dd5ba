"""Stub of neuronxcc.nki.language (NKI kernel language).

Only names that NxD evaluates at import time are defined (dtype constants used as default
arguments of NKI kernels). They are opaque placeholders, not real NKI dtypes.
"""
from _neuron_stub import unavailable as _u
from _neuron_stub import unavailable_class as _uc


class _Dtype(str):
    """An NKI dtype constant's name; NxD only passes these around as default arguments."""


int32 = _Dtype("nl.int32")
bfloat16 = _Dtype("nl.bfloat16")
float16 = _Dtype("nl.float16")
float32 = _Dtype("nl.float32")
uint8 = _Dtype("nl.uint8")

# Imported by modules/moe/moe_fused_tkg.py:9 and moe_fused_tkg_mx.py:11 (kernel-grid helper).
nc = _u("neuronxcc.nki.language.nc")

# Annotation in modules/moe/moe_fused_tkg.py:82-87.
ndarray = _uc("neuronxcc.nki.language.ndarray")
