"""STAND-IN for neuronx_distributed.modules.moe (names only, never run)."""


class _NeedsDevice:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("stand-in: NxD MoE modules need a Neuron device")


class MoE(_NeedsDevice):
    pass


class RouterTopK(_NeedsDevice):
    pass


class ExpertMLPs(_NeedsDevice):
    pass
