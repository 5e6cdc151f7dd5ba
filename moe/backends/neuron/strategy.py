"""neuronx-distributed's Lightning strategy and precision plugin, with what our run needs from them.

Read against neuronx-distributed v2.28.0 (src/neuronx_distributed/lightning/) and Lightning 2.5:

- Checkpoints are the NxD format (moe.backends.neuron.nxd_checkpoint.NxD): NxD's own `save_checkpoint`/
  `load_checkpoint` (trainer/checkpoint.py:654, :838), as NxD Training does (nlp_overrides.py:535-640),
  not NeuronCheckpointIO: that one names files without the expert-parallel rank and, with ZeRO-1
  off, writes DP rank 0 only (parallel_layers/checkpointing.py:70-142). A checkpoint is a directory
  `<name>.ckpt/` holding model/, optim/ and user_content.pt (the rest of Lightning's checkpoint),
  complete once NxD has written its `done` file; saves are asynchronous and NxD keeps the newest
  trainer.keep_last_checkpoints of them. Nothing is saved while neuron_parallel_compile extracts
  graphs.
- fp32 master weights under expert parallelism: NxD's expert-parallel ZeRO-1 builds its state_dict from
  its two inner ZeRO-1 optimizers' without their master weights (optimizer/zero_redundancy_optimizer.py:
  294-330; the inner ones save them with use_master_weights_in_ckpt, torch_xla/distributed/
  zero_redundancy_optimizer.py:501-508 at v2.9.0), so a resumed run would
  restart them from the bf16 weights. They are saved under MASTER_WEIGHTS in each rank's optimizer
  file and copied back into the shards after NxD's load: the run continues as it would have.
- The precision plugin: NxD's optimizer_step calls optimizer.step() and never the closure
  (lightning/precision_plugin.py:18-26); ours runs Lightning's closure, then NxD's, then ends the step's
  XLA graph.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch_xla.core.xla_model as xm
from neuronx_distributed.lightning import NeuronXLAPrecisionPlugin, NeuronXLAStrategy

from moe.backends.neuron.env import extracting_graphs
from moe.backends.neuron.nxd_checkpoint import NxD, optimizer_shard

MASTER_WEIGHTS = "moe_master_weights"  # our key in an expert-parallel ZeRO-1 optimizer file


class MoENeuronStrategy(NeuronXLAStrategy):
    def __init__(self, nxd_config: dict, keep_checkpoints: int):
        super().__init__(nxd_config=nxd_config)
        self.checkpoint_format = NxD(keep=keep_checkpoints,
                                     zero1=nxd_config["optimizer_config"]["zero_one_enabled"])
        self._loading: Path | None = None

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if extracting_graphs():
            return
        optimizer_state = checkpoint["optimizer_states"][0]
        if parts := self._master_weight_parts(self.optimizers[0]):
            master = [[shard.data for shard in shards(part)] for part in parts]
            optimizer_state = {**optimizer_state, MASTER_WEIGHTS: master}
        checkpoint = {**checkpoint, "optimizer_states": [optimizer_state]}
        self.checkpoint_format.save(None, checkpoint, Path(filepath))

    def remove_checkpoint(self, filepath) -> None:
        """NxD keeps the newest `keep_checkpoints` (num_kept_ckpts, the format's `keep`) itself."""

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Lightning's part of the checkpoint; weights and optimizer state load into the live objects
        below."""
        self._loading = Path(checkpoint_path)
        return self.checkpoint_format.load(None, self._loading)

    def load_model_state_dict(self, checkpoint: dict, strict: bool = True) -> None:
        self.checkpoint_format.load_weights(self._loading, self.lightning_module.model, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict) -> None:
        from neuronx_distributed.parallel_layers import parallel_state as ps

        for optimizer in self.optimizers:
            self.checkpoint_format.load_optimizer(self._loading, optimizer)
            if parts := self._master_weight_parts(optimizer):
                ranks = (ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                         ps.get_pipeline_model_parallel_rank())
                path = optimizer_shard(self._loading, *ranks)
                saved = torch.load(path, map_location="cpu", weights_only=True)[MASTER_WEIGHTS]
                for part, tensors in zip(parts, saved, strict=True):
                    for shard, tensor in zip(shards(part), tensors, strict=True):
                        shard.data.copy_(tensor)

    def _master_weight_parts(self, optimizer) -> list:
        """The inner ZeRO-1 optimizers of an expert-parallel ZeRO-1 holding fp32 master weights, else []."""
        if not self.nxd_config["mixed_precision_config"]["use_master_weights"]:
            return []
        parts = zero1_parts(optimizer)
        return parts if len(parts) == 2 else []

    def teardown(self) -> None:
        self.checkpoint_format.finalize()  # an asynchronous save still running gets its `done` file
        super().teardown()


def zero1_parts(optimizer) -> list:
    """The ZeRO-1 optimizers inside NxD's optimizer wrapper (trainer/optimizer.py:10-13) that hold weight
    shards: the two inner ones (dense, experts) of NeuronEPZero1Optimizer (optimizer/
    zero_redundancy_optimizer.py:163-183), the ZeRO-1 optimizer itself without EP, none without ZeRO-1."""
    inner = optimizer.optimizer
    if hasattr(inner, "ep_zero_optimizer"):
        return [inner.non_ep_zero_optimizer, inner.ep_zero_optimizer]
    return [inner] if hasattr(inner, "base_optimizer") else []


def shards(zero1) -> list:
    """A ZeRO-1 optimizer's master-weight shards, in its param groups' order."""
    return [shard for group in zero1.base_optimizer.param_groups for shard in group["params"]]


class NeuronPrecision(NeuronXLAPrecisionPlugin):
    """NxD's plugin (lightning/precision_plugin.py:18-26), with the optimizer step's XLA graph executed at its
    end. A step the spike guard skips is the backend's (NeuronBackend.skip_update), not this plugin's."""

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure()  # manual optimization: Lightning's do-nothing closure
        result = optimizer.step()
        xm.mark_step()
        return result
