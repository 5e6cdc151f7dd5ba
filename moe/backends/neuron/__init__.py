"""Trainium (hardware=trn1) through neuronx-distributed."""
from __future__ import annotations

from moe.backends.base import Backend, TrainerParts


class NeuronBackend(Backend):
    name = "neuron"
    norm_after_step = True  # NxD's optimizer computes the global norm in its step

    def __init__(self, cfg, layout):
        super().__init__(cfg, layout)
        from moe.backends.neuron.strategy import build_neuron

        self._parts, self.nxd_config, self._env = build_neuron(cfg)

    def trainer_parts(self) -> TrainerParts:
        return self._parts

    def env(self) -> dict[str, str]:
        return dict(self._env)

    def build_module(self):
        from moe.backends.neuron.module import NeuronLitMoE

        return NeuronLitMoE(self.cfg, self.nxd_config, backend=self)

    def grad_norm_after_step(self, module) -> float | None:
        return module.last_grad_norm()
