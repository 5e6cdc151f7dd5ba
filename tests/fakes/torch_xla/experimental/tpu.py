"""FAKE: Lightning asks whether XLA has TPUs (XLAAccelerator.is_available); this machine has none."""


def version():
    raise OSError("fake torch_xla: no TPU here")
