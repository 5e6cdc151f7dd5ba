"""Lightning's accelerator for TorchNeuron, native PyTorch on Trainium 2/3 (hardware=trn2).

TorchNeuron (the `torch-neuronx` of Neuron SDK 2.29+, not the XLA one trn1 uses) registers a
`neuron` device and a `neuron` process-group backend when `torch_neuronx` is imported; each worker
process sees one logical NeuronCore as `torch.device("neuron")` (AWS Neuron docs, "How to use
torch.distributed on Neuron": 64 workers per trn2.48xlarge at the default LNC=2). Lightning has no
accelerator for it; this one maps a process to that device and nothing else: the fsdp2 backend
does the rest with the same DTensor/FSDP2 code as on GPUs.
"""
from __future__ import annotations

import importlib.util

import torch
from lightning.pytorch.accelerators import Accelerator

MODULE = "torch_neuronx"


class TorchNeuronAccelerator(Accelerator):
    def setup_device(self, device: torch.device) -> None:
        import torch_neuronx  # noqa: F401  registers the device and the process-group backend

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices) -> int:
        return int(devices)

    @staticmethod
    def get_parallel_devices(devices) -> list[torch.device]:
        return [torch.device("neuron")] * int(devices)  # one logical NeuronCore per process

    @staticmethod
    def auto_device_count() -> int:
        return 64  # a trn2.48xlarge at LNC=2

    @staticmethod
    def is_available() -> bool:
        return importlib.util.find_spec(MODULE) is not None

    def get_device_stats(self, device) -> dict:
        return {}
