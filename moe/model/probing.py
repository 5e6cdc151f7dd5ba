"""Where a kernel probe runs (moe.model.moe.grouped_mm_works, moe.model.fused_swiglu, moe.model.fp8): the
first forward that needs a kernel tries it once against a reference, whatever its caller runs under."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def probing(device_type: str):
    """Autograd on even under no_grad or inference mode (a probe checks the backward too); autocast off
    (inside one, the reference matmuls would run in the autocast dtype and a correct kernel fail the
    comparison); identity saved-tensor hooks, so an enclosing activation checkpoint, whose recomputation
    counts saved tensors, never sees the probe's."""
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with (torch.inference_mode(False), torch.enable_grad(), keep,
          torch.autocast(device_type=device_type, enabled=False)):
        yield
