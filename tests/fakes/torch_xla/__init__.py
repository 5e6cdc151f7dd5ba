"""FAKE torch_xla for CPU tests (tests/fakes/README.md): the device is the CPU, collectives are torch.distributed."""
FAKE = True
