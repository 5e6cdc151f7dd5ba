"""CPU stub of neuronx-cc (NOT the real compiler). See tests/neuron_real/README.md."""
__version__ = "0.0.0+cpustub"
