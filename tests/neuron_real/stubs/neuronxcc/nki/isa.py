"""Stub of neuronxcc.nki.isa (only used inside NKI kernel bodies)."""
