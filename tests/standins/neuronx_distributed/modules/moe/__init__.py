"""STAND-IN for neuronx_distributed.modules.moe (names only, never run)."""


class _NeedsDevice:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("stand-in: NxD MoE modules need a Neuron device")


class MoE(_NeedsDevice):
    """Stand-in name: constructing it raises, as without a Neuron device."""


class RouterTopK(_NeedsDevice):
    """Stand-in name: constructing it raises, as without a Neuron device."""


class ExpertMLPs(_NeedsDevice):
    """Stand-in name: constructing it raises, as without a Neuron device."""
