"""STAND-IN for torch_xla.core.xla_model (names only)."""


def mark_step():
    raise RuntimeError("stand-in: needs a Neuron device")


def xla_device():
    raise RuntimeError("stand-in: needs a Neuron device")
