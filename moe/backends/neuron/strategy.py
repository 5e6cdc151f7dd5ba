"""neuronx-distributed's Lightning strategy and precision plugin, with what our run needs from them.

Read against neuronx-distributed v2.28.0 (src/neuronx_distributed/lightning/) and Lightning 2.5:

- Checkpoints go through NxD's own `save_checkpoint`/`load_checkpoint` (trainer/checkpoint.py:654,
  :838), as NxD Training does (nlp_overrides.py:535-640), not through NeuronCheckpointIO: that
  one names files without the expert-parallel rank and, with ZeRO-1 off, writes DP rank 0 only
  (parallel_layers/checkpointing.py:70-142). A checkpoint is a directory `<name>.ckpt/` holding
  model/, optim/ and user_content.pt (the rest of Lightning's checkpoint), complete once NxD has
  written its `done` file; saves are asynchronous and NxD keeps the newest
  trainer.keep_last_checkpoints of them. Nothing is saved while neuron_parallel_compile extracts
  graphs.
- The precision plugin: NxD's optimizer_step calls optimizer.step() and never the closure, so
  Lightning never fires `on_before_optimizer_step` (lightning/precision_plugin.py:18-26 against
  Lightning's Precision._after_closure): our spike guard and metrics would never run. Ours fires
  the hooks, then steps, or skips the update when the guard said so.
"""
from __future__ import annotations

from pathlib import Path

import neuronx_distributed as nxd
from lightning.pytorch.trainer import call
from neuronx_distributed.lightning import NeuronXLAPrecisionPlugin, NeuronXLAStrategy

from moe.backends.neuron.env import extracting_graphs


class MoENeuronStrategy(NeuronXLAStrategy):
    def __init__(self, nxd_config: dict, keep_checkpoints: int, use_xser: bool = False):
        super().__init__(nxd_config=nxd_config)
        self.keep_checkpoints, self.use_xser = keep_checkpoints, use_xser
        self._loading: Path | None = None

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if extracting_graphs():
            return
        path = Path(filepath)
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        zero1 = self.nxd_config["optimizer_config"]["zero_one_enabled"]
        nxd.save_checkpoint(str(path.parent), tag=path.name, model=checkpoint["state_dict"],
                            optimizer=checkpoint["optimizer_states"][0], user_content=rest,
                            use_xser=self.use_xser, num_kept_ckpts=self.keep_checkpoints, async_save=True,
                            zero1_optimizer=zero1)

    def remove_checkpoint(self, filepath) -> None:
        """NxD keeps the newest `keep_checkpoints` (num_kept_ckpts) itself."""

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Lightning's part of the checkpoint; weights and optimizer state load into the live objects
        below."""
        path = self._loading = Path(checkpoint_path)
        rest = nxd.load_checkpoint(str(path.parent), tag=path.name)
        return {**rest, "state_dict": {}, "optimizer_states": [{}]}  # Lightning checks both keys exist

    def load_model_state_dict(self, checkpoint: dict, strict: bool = True) -> None:
        model = self.lightning_module.model
        nxd.load_checkpoint(str(self._loading.parent), tag=self._loading.name, model=model,
                            strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict) -> None:
        for optimizer in self.optimizers:
            nxd.load_checkpoint(str(self._loading.parent), tag=self._loading.name, optimizer=optimizer)

    def teardown(self) -> None:
        nxd.finalize_checkpoint()  # an asynchronous save still running gets its `done` file
        super().teardown()


class NeuronPrecision(NeuronXLAPrecisionPlugin):
    """NxD's plugin, plus Lightning's `on_before_optimizer_step` hooks before the step
    (Lightning's Precision._after_closure, plugins/precision/precision.py), and a skipped update
    when the backend was told to skip this step (moe.train.guard)."""

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure()  # manual optimization: Lightning's do-nothing closure
        trainer = model.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if model.backend.take_skip():
            optimizer.zero_grad()
            return None
        return optimizer.step()
