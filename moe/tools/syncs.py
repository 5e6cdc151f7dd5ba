"""Count host syncs: every place the CPU would wait for the GPU (tests/test_host_syncs.py, bench/).

On CUDA a value read back to the host (`.item()`, `.tolist()`, an op whose output shape depends on the
data: nonzero, bincount, masked_select, unique, repeat_interleave without output_size) waits for every
kernel queued before it. A dispatch mode sees the ops; `.tolist()` on a CPU tensor never reaches the
dispatcher, so it is counted at the Python method. Counting on the CPU finds the same places.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = ("_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique")


class CountSyncs(TorchDispatchMode):
    """Ops that read device values back to the host, and `Tensor.tolist` calls, while active; `ops` counts
    every aten op (a measure of launch overhead)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = str(func), kwargs or {}
        self.ops += 1
        sized = "repeat_interleave.Tensor" in name and kwargs.get("output_size") is None  # its shape: a read
        if sized or any(op in name for op in SYNCING_OPS):
            self.syncs.append(name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_syncs():
    """with counting_syncs() as counter: ...; counter.syncs lists every host sync, counter.ops the ops."""
    counter, tolist = CountSyncs(), torch.Tensor.tolist

    def counted_tolist(self):
        counter.syncs.append("Tensor.tolist")
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = tolist
