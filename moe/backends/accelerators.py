"""What each `hardware.accelerator` needs of the machine, by name: what moe.train.environment asks before a
run builds anything (the CPU: a well-formed OMP_NUM_THREADS if one is set). trn1's is its backend's
(moe.backends.neuron.accelerator); CUDA's and TorchNeuron's serve the torch backends. Nothing here imports
torch until a check runs."""
from __future__ import annotations

import importlib.util

from moe.backends.neuron.accelerator import check_installed as _check_nxd
from moe.backends.threads import cpu_threads
from moe.errors import ConfigError


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


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


def _check_cpu_threads(hardware) -> None:
    """A malformed OMP_NUM_THREADS, which would choose a CPU run's threads, is refused before the run dir."""
    cpu_threads(1)


ACCELERATOR_CHECKS = {"neuron": _check_nxd, "torch_neuron": _check_torch_neuron, "gpu": _check_cuda,
                      "cpu": _check_cpu_threads}


def _no_fp8_experts_on_torch_neuron() -> None:
    raise ConfigError("moe_opt.fp8_experts", True, "set moe_opt.fp8_experts=false on trn2",
                      problem="needs torch._scaled_grouped_mm, a CUDA kernel TorchNeuron does not have (its "
                              "emulation, for CPU smoke runs, would cost a trn2 run more than bf16 saves)")


# moe_opt.fp8_experts: what the accelerator must offer (the CPU runs the emulation; trn1: the rules refuse it)
FP8_EXPERT_CHECKS = {"gpu": _check_fp8_experts, "torch_neuron": _no_fp8_experts_on_torch_neuron}
