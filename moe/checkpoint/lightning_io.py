"""Lightning's CheckpointIO over moe.checkpoint.formats, for the strategies that write one file from one
process (one device; DDP without expert parallelism): a thin adapter.

Saving is the portable format's write (temporary file, fsync, rename, sha256 sidecar); loading reads
whatever format is on disk whole (weights-only: moe.checkpoint.trust, whatever `weights_only` Lightning
passes): a resume where this rank holds every expert; removing is the format's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from moe.checkpoint.formats import PORTABLE, format_at


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: the portable format's atomic write; any format read whole; the format's
    remove (a file with its sidecar)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        PORTABLE.write_in_run(checkpoint, Path(path))

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        return format_at(Path(path)).read(Path(path))

    def remove_checkpoint(self, path) -> None:
        format_at(Path(path)).remove(Path(path))


def with_atomic_io(plugins: list, strategy: Any = None) -> list:
    """`plugins` plus an AtomicCheckpointIO, unless the strategy or plugins bring their own CheckpointIO."""
    plugins = list(plugins or [])
    if any(isinstance(p, CheckpointIO) for p in plugins) or getattr(strategy, "_checkpoint_io", None):
        return plugins
    return [*plugins, AtomicCheckpointIO()]
