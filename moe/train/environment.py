"""What a run needs from the machine, checked before anything is built or written.

A run that asks for a GPU on a machine without CUDA, a logger whose package is missing, or
Weights & Biases online without a key would otherwise fail minutes in, inside Lightning, with a
traceback. Dry runs and simulations are exempt: they plan a cluster run on this machine.
"""
from __future__ import annotations

import netrc
import os
from pathlib import Path

from moe.backends.accelerators import ACCELERATOR_CHECKS, FP8_EXPERT_CHECKS, installed
from moe.errors import ConfigError

LOGGER_PACKAGES = {  # a logger's _target_ -> the packages it can use (any one of them)
    "lightning.pytorch.loggers.TensorBoardLogger": ("tensorboard", "tensorboardX"),
    "lightning.pytorch.loggers.WandbLogger": ("wandb",),
    "lightning.pytorch.loggers.MLFlowLogger": ("mlflow",),
}
WANDB_HOST = "api.wandb.ai"


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
