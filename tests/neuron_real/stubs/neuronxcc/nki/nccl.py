"""Stub of neuronxcc.nki.nccl (only used inside NKI kernels)."""
