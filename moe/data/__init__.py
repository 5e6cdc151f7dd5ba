"""Data: tokenizer, formats, packing, Arrow IO and the training DataModule.

Names import lazily so `data_prep.py` does not pay for Lightning and `train.py` does
not pay for tokenizer training code it never calls.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "MoEDataModule": "moe.data.datamodule",
    "prepare": "moe.data.prep_pipeline",
    "PrepConfig": "moe.config.data_prep",
    "load_prepared": "moe.data.arrow_io",
    "PackedBlocks": "moe.data.arrow_io",
    "StreamSampler": "moe.data.sampler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moe.data' has no attribute {name!r}")
