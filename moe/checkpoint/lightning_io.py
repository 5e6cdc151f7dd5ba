"""Lightning's CheckpointIO over moe.checkpoint: atomic saves with a sidecar, any format loaded.

A thin adapter: saving is moe.checkpoint.io.atomic_torch_save (temporary file, fsync, rename, sha256
sidecar), loading a file is weights-only (moe.checkpoint.trust: whatever `weights_only` Lightning
passes), loading a sharded directory reads it whole (a resume where this rank holds every expert:
one process, or ep=1).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from moe.checkpoint.formats import Sharded
from moe.checkpoint.io import TMP_SUFFIX, atomic_torch_save, meta_path, remove
from moe.checkpoint.trust import load_trusted
from moe.model.mlp import upgraded


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: temp file, fsync, rename, sha256 sidecar; removes sidecars with files."""

    def __init__(self) -> None:
        super().__init__()
        self._cleaned: set[Path] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        if path.parent not in self._cleaned:  # temp files of saves killed in an earlier launch
            for stale in path.parent.glob(f"*{TMP_SUFFIX}"):
                remove(stale)
            self._cleaned.add(path.parent)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        sharded = Sharded()
        if sharded.detect(path):
            return sharded.read(path)
        checkpoint = load_trusted(path, map_location=map_location)
        checkpoint["state_dict"] = upgraded(checkpoint["state_dict"])  # older parameter names
        return checkpoint

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        remove(meta_path(path))


def with_atomic_io(plugins: list, strategy: Any = None) -> list:
    """`plugins` plus an AtomicCheckpointIO, unless the strategy or plugins bring their own CheckpointIO."""
    plugins = list(plugins or [])
    if any(isinstance(p, CheckpointIO) for p in plugins) or getattr(strategy, "_checkpoint_io", None):
        return plugins
    return [*plugins, AtomicCheckpointIO()]
