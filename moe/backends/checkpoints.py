"""A Lightning strategy's checkpoints through moe.checkpoint.formats: saved in the format its backend
declares (BackendSpec.checkpoint_formats), loaded by the format found on disk.

Mixed in before the Lightning strategy class (DDP with EP, FSDP2, DeepSpeed). No strategy chooses or
detects a format itself: a save is `format.save`, a load `format_at(path).load`, both collective. A
format the run writes itself loads in place (every rank reads its pieces into the live tensors); any
other is read whole, and the strategy's layout takes its part of it: Lightning's load plus the
backend's expert slicing (moe.backends.base.Backend.on_load_checkpoint), FSDP2's placement into its
DTensors (moe.parallel.placement.load_full_checkpoint).
"""
from __future__ import annotations

from pathlib import Path

from moe.checkpoint.formats import Format, Live, format_at, in_place


class FormatCheckpoints:
    """Lightning strategy mixin: save / load / remove through moe.checkpoint.formats (module docstring)."""

    # the checkpoint holds the torch optimizers' state (False: the backend saves its own, Live.per_rank)
    optimizer_in_checkpoint = True

    def __init__(self, *args, checkpoint_format: Format, dims, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_format, self.dims = checkpoint_format, dims

    def checkpoint_live(self, per_rank: dict | None = None) -> Live:
        return Live(module=self.lightning_module,
                    optimizers=list(self.optimizers) if self.optimizer_in_checkpoint else [],
                    dims=self.dims, device_type=self.root_device.type, rank=self.global_rank,
                    is_global_zero=self.is_global_zero, barrier=lambda: self.barrier("moe_checkpoint"),
                    writes=self.checkpoint_format, per_rank=per_rank)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = Path(self.broadcast(str(filepath)))
        self.checkpoint_format.save(self.checkpoint_live(), checkpoint, path)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        return format_at(path).load(self.checkpoint_live(), path)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            format_at(Path(filepath)).remove(Path(filepath))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not in_place(checkpoint):
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not in_place(checkpoint):
            super().load_optimizer_state_dict(checkpoint)
