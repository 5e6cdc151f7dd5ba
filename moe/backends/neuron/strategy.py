"""Trainium (hardware=trn1): neuronx-distributed's Lightning strategy, configured from our groups.

- `neuron_env(cfg)`: the XLA/Neuron environment (precision preset, compiler flags, runtime
  knobs from the hardware group). `build_neuron` puts it in os.environ *before* importing
  neuronx_distributed (which starts torch_xla), because XLA reads it once at start-up.
- `nxd_config_kwargs(cfg)`: the arguments of `neuronx_distributed.trainer.neuronx_distributed_config`
  (tp, pp, ep, sequence parallel, ZeRO-1, grad clipping, activation checkpointing, mixed
  precision / master weights, pipeline schedule).
- `build_neuron(cfg)`: NeuronXLAStrategy(nxd_config, ..., NeuronCheckpointIO(save_load_xser=True)),
  NeuronXLAPrecisionPlugin, and the NeuronLTModule factory of `moe.strategies.neuron_model`
  (the model is built by NxD's `initialize_parallel_model`).

neuronx_distributed is imported lazily; without it `python train.py hardware=trn1` stops at
once with what to install (dry runs never get here).

Precision presets (hardware.neuron_precision), as neuronx-distributed-training maps them
(examples/training_orchestrator.py, SDK 2.26):

    bf16_sr  XLA_USE_BF16=1 XLA_DOWNCAST_BF16=0 NEURON_RT_STOCHASTIC_ROUNDING_EN=1, no master weights
             (seed 001: converges like mixed precision, faster and smaller; plain bf16 diverged)
    mixed    XLA_USE_BF16=0 XLA_DOWNCAST_BF16=1 NEURON_RT_STOCHASTIC_ROUNDING_EN=0, fp32 master
             weights and fp32 gradient accumulation (NxD needs ZeRO-1 for both)
    fp32     XLA_USE_BF16=0 XLA_DOWNCAST_BF16=0 NEURON_RT_STOCHASTIC_ROUNDING_EN=0, --auto-cast none
"""
from __future__ import annotations

import os

from moe.backends.base import TrainerParts
from moe.errors import ConfigError, UserError


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
# parallel.activation_checkpointing -> what NxD wraps (names in moe.strategies.neuron_model)
NXD_CHECKPOINT_CLASSES = {"none": None, "full": ["NxDBlock"], "moe_only": ["NxDMoE"],
                          "selective": ["NxDSwiGLU", "NxDMoE"]}
INSTALL_HINT = ("run on a trn1 instance with the Neuron SDK: the Deep Learning AMI Neuron (its "
                "aws_neuronx_venv_pytorch), or `pip install torch-neuronx neuronx-distributed "
                "--extra-index-url https://pip.repos.neuron.amazonaws.com`; here, use hardware=cpu, or "
                "dry_run=true to check the trn1 plan")


def _preset(cfg) -> dict:
    name = cfg.hardware.neuron_precision
    if name not in NEURON_PRECISION:
        raise ConfigError("hardware.neuron_precision", name, f"use one of {', '.join(NEURON_PRECISION)}",
                          problem="is not a Neuron precision preset")
    return NEURON_PRECISION[name]


def neuron_env(cfg) -> dict[str, str]:
    """Environment for XLA and the Neuron compiler/runtime: the preset, then hardware.env on top.

    NEURON_CC_FLAGS joins hardware.neuron_cc_flags, the preset's flag, hardware.env's own
    NEURON_CC_FLAGS and any value already in the shell, each once.
    """
    preset = _preset(cfg)
    user_env = {str(k): str(v) for k, v in cfg.hardware.env.items()}
    flags: list[str] = []
    for part in (cfg.hardware.neuron_cc_flags, preset["cc_flags"], user_env.pop("NEURON_CC_FLAGS", ""),
                 os.environ.get("NEURON_CC_FLAGS", "")):
        for flag in (part or "").split():
            if flag not in flags:
                flags.append(flag)
    return {**preset["env"], **user_env, "NEURON_CC_FLAGS": " ".join(flags)}


def nxd_config_kwargs(cfg) -> dict:
    """Arguments of `neuronx_distributed_config` from the parallel, optimizer and trainer groups.

    activation_checkpoint_config holds class *names* here; `build_neuron` swaps in the classes.
    """
    p, opt, preset = cfg.parallel, cfg.optimizer, _preset(cfg)
    if p.zero_stage not in (0, 1):
        raise ConfigError("parallel.zero_stage", p.zero_stage,
                          "use parallel.zero_stage=1 (neuronx-distributed shards optimizer states only) or 0",
                          problem="is not available on Trainium")
    if p.activation_checkpointing not in NXD_CHECKPOINT_CLASSES:
        raise ConfigError("parallel.activation_checkpointing", p.activation_checkpointing,
                          f"use one of {', '.join(NXD_CHECKPOINT_CLASSES)} on hardware=trn1 "
                          "(NxD checkpoints by module class)",
                          problem="has no neuronx-distributed equivalent")
    zero1 = p.zero_stage == 1
    master = preset["master_weights"] and zero1
    pipeline_config = None
    if p.pp > 1:
        pipeline_config = {
            "transformer_layer_cls": "NxDBlock",
            "num_microbatches": p.pipeline_microbatches or cfg.trainer.accumulate_grad_batches,
            "output_loss_value_spec": (True, False),
            "input_names": ["input_ids", "labels"],
            "auto_partition": True,
            "leaf_module_cls": ["RMSNorm"],
            "use_zero1_optimizer": zero1,
            "use_optimizer_wrapper": True,
        }
    return {
        "tensor_parallel_size": p.tp,
        "pipeline_parallel_size": p.pp,
        "expert_parallel_size": p.ep,
        "pipeline_config": pipeline_config,
        "optimizer_config": {"zero_one_enabled": zero1, "grad_clipping": opt.grad_clip > 0,
                             "max_grad_norm": float(opt.grad_clip or 1.0)},
        "activation_checkpoint_config": NXD_CHECKPOINT_CLASSES[p.activation_checkpointing],
        "sequence_parallel": bool(p.sequence_parallel),
        "mixed_precision_config": {"use_master_weights": master, "use_fp32_grad_acc": master,
                                   "use_master_weights_in_ckpt": False},
    }


def build_neuron(cfg) -> tuple[TrainerParts, object, dict]:
    env = neuron_env(cfg)
    kwargs = nxd_config_kwargs(cfg)
    os.environ.update(env)  # before torch_xla starts: XLA reads these once
    try:
        from neuronx_distributed.lightning import (
            NeuronCheckpointIO,
            NeuronXLAPrecisionPlugin,
            NeuronXLAStrategy,
        )
        from neuronx_distributed.trainer import neuronx_distributed_config
    except ImportError as err:
        raise UserError("hardware", cfg.hardware.name, INSTALL_HINT,
                        problem=f"needs neuronx-distributed and torch-neuronx, which are not installed "
                        f"({err})") from err
    from moe.backends.neuron import module as neuron_model

    if kwargs["activation_checkpoint_config"]:
        names = kwargs["activation_checkpoint_config"]
        kwargs["activation_checkpoint_config"] = [getattr(neuron_model, name) for name in names]
    if kwargs["pipeline_config"]:
        pc = kwargs["pipeline_config"]
        pc["transformer_layer_cls"] = getattr(neuron_model, pc["transformer_layer_cls"])
        pc["leaf_module_cls"] = [getattr(neuron_model, n).__name__ for n in pc["leaf_module_cls"]]
    nxd_config = neuronx_distributed_config(**kwargs)
    strategy = NeuronXLAStrategy(
        nxd_config=nxd_config, tensor_parallel_size=cfg.parallel.tp, pipeline_parallel_size=cfg.parallel.pp,
        expert_parallel_size=cfg.parallel.ep, checkpoint_io=NeuronCheckpointIO(save_load_xser=True),
        save_load_xser=True,
    )
    precision = NeuronXLAPrecisionPlugin(mixed_precision_enabled=cfg.hardware.neuron_precision == "mixed")
    parts = TrainerParts(accelerator="auto",  # NeuronXLAStrategy brings its NeuronXLAAccelerator
                         strategy=strategy, precision=None, plugins=[precision],
                         overrides={"accumulate_grad_batches": 1, "gradient_clip_val": None})
    return parts, nxd_config, env
