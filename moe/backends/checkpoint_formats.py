"""Every checkpoint format a backend's library writes in a layout of its own, registered with the checkpoint
layer (moe.checkpoint.formats.register) when this module is imported.

The checkpoint layer reads every format without knowing a backend; a backend that brings a format keeps
it in its package and adds it here. Every command that reads checkpoints imports this module first
(train's resume and its preflight, infer.py ckpt= and its export, consolidation), so a run's newest
checkpoint is found in any process, whichever backend, if any, it builds.
"""
from __future__ import annotations

from moe.backends.neuron.nxd_checkpoint import NXD
from moe.checkpoint.formats import Format, register

BACKEND_FORMATS: tuple[Format, ...] = (NXD,)

for _format in BACKEND_FORMATS:
    register(_format)
