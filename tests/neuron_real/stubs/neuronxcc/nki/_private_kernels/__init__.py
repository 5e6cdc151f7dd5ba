"""Stub package. Only plain *data types* that NxD dereferences at import time are defined
(enum members used as dataclass defaults in modules/moe/blockwise.py:156-159). The real NKI
kernels (blockwise_mm, blockwise_mm_bwd, ...) are NOT provided, so NxD's guarded kernel look-ups
(modules/moe/nki_import.py:40-56) return None and NxD falls back to its plain-torch code paths.
"""
from enum import IntEnum


class ExpertAffinityScaleMode(IntEnum):
    NO_SCALE = 0
    POST_SCALE = 1
    PRE_SCALE = 2


class ActFnType(IntEnum):
    SiLU = 0
    GELU = 1
    GELU_Tanh_Approx = 2
    Swish = 3


class RouterActFnType(IntEnum):
    SIGMOID = 0
    SOFTMAX = 1
