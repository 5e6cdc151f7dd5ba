"""The environment a trn1 run sets before torch_xla starts (XLA reads it once), from the config.

Precision presets (hardware.neuron_precision), as neuronx-distributed's and NxD Training's
recipes set them (NxD examples/training/mixtral/mixtral_pretrain/run_mixtral_pretrain_ptl.py:
352-358; NxDT examples/training_orchestrator.py:109-113):

    bf16_sr  XLA_USE_BF16=1 XLA_DOWNCAST_BF16=0 NEURON_RT_STOCHASTIC_ROUNDING_EN=1, no master weights
             (the Llama 2 7B trn1 recipe: converges like mixed precision, faster and smaller)
    mixed    XLA_USE_BF16=0 XLA_DOWNCAST_BF16=1 NEURON_RT_STOCHASTIC_ROUNDING_EN=0, fp32 master
             weights and fp32 gradient accumulation (NxD keeps both only with ZeRO-1)
    fp32     XLA_USE_BF16=0 XLA_DOWNCAST_BF16=0 NEURON_RT_STOCHASTIC_ROUNDING_EN=0, --auto-cast none

Compiler flags: hardware.neuron_cc_flags and the preset's flag. For a model with MoE layers,
NxD's Mixtral recipe drops `--distribution-strategy=llm-training` ("because of a compiler bug")
and adds `--enable-saturate-infinity` (inf -> max float, against NaN), both here too
(run_mixtral_pretrain_ptl.sh:31-33; NxDT hf_mixtral_8x7b_config.yaml compiler_flags).

Devices: NxD's accelerator accepts `devices` of 1 or TPU_NUM_DEVICES (default 8;
neuronx_distributed/lightning/accelerator.py:58-71, :98-113), and one device then fails in
Lightning's XLAStrategy.setup_distributed. NxD's recipe exports TPU_NUM_DEVICES =
TPU_CHIPS_PER_HOST_BOUNDS = NEURON_RT_NUM_CORES = the cores per node (run_mixtral_pretrain_ptl.sh:
145-147); here they are trainer.devices.
"""
from __future__ import annotations

import os

from moe.config.derived import neuron_precision
from moe.config.schema import HardwareConfig, ModelConfig, TrainerConfig
from moe.config.size import param_breakdown


def _xla(use_bf16: str, downcast_bf16: str, stochastic_rounding: str) -> dict[str, str]:
    return {"XLA_USE_BF16": use_bf16, "XLA_DOWNCAST_BF16": downcast_bf16,
            "NEURON_RT_STOCHASTIC_ROUNDING_EN": stochastic_rounding}


NEURON_PRECISION = {
    "bf16_sr": {"env": _xla("1", "0", "1"), "cc_flags": "--enable-mixed-precision-accumulation",
                "master_weights": False},
    "mixed": {"env": _xla("0", "1", "0"), "cc_flags": "--enable-mixed-precision-accumulation",
              "master_weights": True},
    "fp32": {"env": _xla("0", "0", "0"), "cc_flags": "--auto-cast none", "master_weights": False},
}
MOE_DROPS_FLAGS = ("--distribution-strategy=llm-training",)
MOE_ADDS_FLAGS = ("--enable-saturate-infinity",)
# neuron_parallel_compile sets it while it extracts graphs (SDK torch-neuronx release notes)
EXTRACT_GRAPHS_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"


def extracting_graphs() -> bool:
    """True under neuron_parallel_compile: a short run whose values are not real (nothing is saved)."""
    return os.environ.get(EXTRACT_GRAPHS_ENV, "") not in ("", "0")


def cc_flags(hardware: HardwareConfig, model: ModelConfig) -> str:
    """NEURON_CC_FLAGS: the hardware's, the preset's, hardware.env's own and the shell's, each once."""
    user_env = {str(k): str(v) for k, v in hardware.env.items()}
    parts = [hardware.neuron_cc_flags, NEURON_PRECISION[neuron_precision(hardware, model)]["cc_flags"],
             user_env.get("NEURON_CC_FLAGS", ""), os.environ.get("NEURON_CC_FLAGS", "")]
    flags = list(dict.fromkeys(f for part in parts for f in (part or "").split()))
    if param_breakdown(model).num_moe_layers:
        flags = [f for f in flags if f not in MOE_DROPS_FLAGS] + [f for f in MOE_ADDS_FLAGS if f not in flags]
    return " ".join(flags)


def neuron_env(hardware: HardwareConfig, model: ModelConfig, trainer: TrainerConfig) -> dict[str, str]:
    """The preset's variables, hardware.env on top, the compiler flags and the device counts."""
    devices = str(trainer.devices)
    return {**NEURON_PRECISION[neuron_precision(hardware, model)]["env"],
            **{str(k): str(v) for k, v in hardware.env.items()},
            "NEURON_CC_FLAGS": cc_flags(hardware, model),
            "TPU_NUM_DEVICES": devices, "TPU_CHIPS_PER_HOST_BOUNDS": devices, "NEURON_RT_NUM_CORES": devices}
