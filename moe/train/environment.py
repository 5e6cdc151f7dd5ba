"""What a run needs from the machine, checked before anything is built or written.

A run that asks for a GPU on a machine without CUDA, a logger whose package is missing, or
Weights & Biases online without a key would otherwise fail minutes in, inside Lightning, with a
traceback. Dry runs and simulations are exempt: they plan a cluster run on this machine.
"""
from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path

from moe.errors import ConfigError

LOGGER_PACKAGES = {  # a logger's _target_ -> the packages it can use (any one of them)
    "lightning.pytorch.loggers.TensorBoardLogger": ("tensorboard", "tensorboardX"),
    "lightning.pytorch.loggers.WandbLogger": ("wandb",),
    "lightning.pytorch.loggers.MLFlowLogger": ("mlflow",),
}
WANDB_HOST = "api.wandb.ai"


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_environment(hardware, logger, moe_opt, planning: bool) -> None:
    """Raise a ConfigError naming the field when this machine cannot run the hardware, the loggers or the
    expert kernels asked for (a run that only plans needs none of them)."""
    if planning:
        return
    check_accelerator(hardware)
    fp8_check = FP8_EXPERT_CHECKS.get(hardware.accelerator) if moe_opt.fp8_experts else None
    if fp8_check is not None:
        fp8_check()
    for name, node in (logger or {}).items():
        target = node.get("_target_", "")
        packages = LOGGER_PACKAGES.get(target, ())
        if packages and not any(installed(p) for p in packages):
            raise ConfigError(f"logger.{name}", target,
                              f"pip install {packages[0]} -c constraints.txt "
                              "(or pip install -e '.[loggers]'), "
                              f"or drop it: ~logger.{name}",
                              problem=f"needs {' or '.join(packages)}, which is not installed")
        if target.endswith("WandbLogger") and not node.get("offline", False):
            check_wandb_key(name)


def check_accelerator(hardware) -> None:
    """What hardware.accelerator needs installed or attached (none for the CPU)."""
    check = ACCELERATOR_CHECKS.get(hardware.accelerator)
    if check is not None:
        check(hardware)


def _check_nxd(hardware) -> None:
    from moe.backends.neuron import INSTALL_HINT, NOT_INSTALLED

    missing = [p for p in ("neuronx_distributed", "torch_xla") if not installed(p)]
    if missing:
        raise ConfigError("hardware", hardware.name, INSTALL_HINT,
                          problem=f"{NOT_INSTALLED} (no module {', '.join(missing)})")


def _check_torch_neuron(hardware) -> None:
    from moe.backends.torch_neuron import MODULE

    if not installed(MODULE):
        raise ConfigError("hardware", hardware.name,
                          "run it on trn2 instances with TorchNeuron installed (Neuron SDK 2.29+, native "
                          "PyTorch), or use hardware=cpu_fsdp2 here (the same backend on the CPU); "
                          "dry_run=true or simulate=true plan the trn2 run on this machine",
                          problem=f"needs TorchNeuron ({MODULE}), which is not installed")


def _check_cuda(hardware) -> None:
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None else
               "torch sees no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise ConfigError("hardware", hardware.name,
                          "run it on the GPU nodes (with a CUDA build of torch), or use hardware=cpu here; "
                          "dry_run=true or simulate=true plan the GPU run on this machine",
                          problem=f"needs CUDA GPUs, and {why}")


def _check_fp8_experts() -> None:
    """On a GPU the FP8 expert GEMMs run on the card's kernel or not at all: their emulation, right for a CPU
    smoke run, would cost a GPU run more than bf16 saves."""
    import torch

    from moe.model.fp8 import fp8_kernel
    from moe.ranks import local_rank

    # on this rank's own card: probing cuda:0 from every rank would put a CUDA context on it per rank
    if not fp8_kernel(torch.device("cuda", local_rank() % torch.cuda.device_count())):
        raise ConfigError("moe_opt.fp8_experts", True,
                          "set moe_opt.fp8_experts=false on this card, or run on one with FP8 grouped GEMMs "
                          "(compute capability 9.0+: H100, H200)",
                          problem=f"needs FP8 grouped GEMMs (torch._scaled_grouped_mm), and "
                                  f"{torch.cuda.get_device_name()} with torch {torch.__version__} has none")


ACCELERATOR_CHECKS = {"neuron": _check_nxd, "torch_neuron": _check_torch_neuron, "gpu": _check_cuda}
def _no_fp8_experts_on_torch_neuron() -> None:
    raise ConfigError("moe_opt.fp8_experts", True, "set moe_opt.fp8_experts=false on trn2",
                      problem="needs torch._scaled_grouped_mm, a CUDA kernel TorchNeuron does not have (its "
                              "emulation, for CPU smoke runs, would cost a trn2 run more than bf16 saves)")


# moe_opt.fp8_experts: what the accelerator must offer (the CPU runs the emulation; trn1: the rules refuse it)
FP8_EXPERT_CHECKS = {"gpu": _check_fp8_experts, "torch_neuron": _no_fp8_experts_on_torch_neuron}


def check_wandb_key(name: str) -> None:
    """W&B online needs WANDB_API_KEY or `wandb login` (~/.netrc); WANDB_MODE=offline/disabled also do."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return
    try:
        if netrc.netrc(os.environ.get("NETRC") or Path.home() / ".netrc").authenticators(WANDB_HOST):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ConfigError(f"logger.{name}.offline", False,
                      "export WANDB_API_KEY=... (or run `wandb login` once), or keep the default "
                      f"logger.{name}.offline=true and `wandb sync` the run dir later",
                      problem="sends metrics to Weights & Biases, and no API key is set up on this machine")


def apply_torch_settings(hardware) -> None:
    """Process-wide torch settings the hardware group asks for: hardware.allow_tf32 lets CUDA run fp32
    matmuls on TF32 tensor cores (torch.set_float32_matmul_precision "high"), else full fp32."""
    import torch

    torch.set_float32_matmul_precision("high" if hardware.allow_tf32 else "highest")
