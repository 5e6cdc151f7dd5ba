"""What neuronx-distributed can do on trn1 (moe.config.specs.BackendSpec) and what its precision presets
cost, readable without importing NxD or torch."""
from __future__ import annotations

from dataclasses import dataclass

from moe.config.derived import neuron_precision
from moe.config.specs import BackendSpec, StateBytes


@dataclass(frozen=True)
class NeuronSpec(BackendSpec):
    def state_bytes(self, model, parallel, hardware, trainer) -> StateBytes:
        """ZeRO-1 (torch-xla's ZeroRedundancyOptimizer under NxD's) steps on its own copies of the weights'
        shards, in its optimizer dtype (torch_xla/distributed/zero_redundancy_optimizer.py:255-263 at
        v2.9.0): fp32, bf16 under XLA_USE_BF16; `mixed` makes them float64 for XLA_DOWNCAST_BF16 to hold
        in fp32 (NxD trainer/trainer.py:281-283), its master weights, with fp32 gradient accumulation."""
        preset, zero1 = neuron_precision(hardware, model), parallel.zero_stage >= 1
        if preset == "bf16_sr":
            return StateBytes(2, 2, 4 + 2 * zero1, "bf16 + stochastic rounding: bf16 weights, grads and "
                              "AdamW moments" + (", ZeRO-1's bf16 copy" if zero1 else ""))
        if preset == "mixed" and zero1:
            return StateBytes(2, 4, 12, "mixed: bf16 weights, fp32 grad accumulation, fp32 master + moments")
        if preset == "mixed":  # NxD keeps master weights with ZeRO-1 only (nxd_config.py)
            return StateBytes(2, 2, 4, "mixed without ZeRO-1: bf16 weights, grads and AdamW moments")
        return StateBytes(4, 4, 8 + 4 * zero1,
                          "fp32 weights, grads and moments" + (", ZeRO-1's copy" if zero1 else ""))

    def activation_bytes(self, model, hardware, trainer) -> int:
        return 4 if neuron_precision(hardware, model) == "fp32" else 2


SPEC = NeuronSpec(  # what its expert parallelism needs: moe.backends.neuron.rules.check_neuron
    name="neuron", library="neuronx-distributed", max_zero_stage=1, tensor_parallel=True,
    pipeline_parallel=True, hybrid_shard=False, precisions=None,
    fused_attention=False, fused_cross_entropy=False, fused_adamw=False, ac_wraps_moe_layer=True,
    backend="moe.backends.neuron.backend:NeuronBackend", mlp_activations=3, checkpoint_formats=("nxd", "nxd"))
