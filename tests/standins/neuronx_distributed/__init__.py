"""STAND-IN for neuronx_distributed (tests only): records what moe.strategies.neuron passes to NxD.

ENV_AT_IMPORT is os.environ as this package saw it when first imported, so a test can check that
the XLA/Neuron variables were set before NxD (and with it torch_xla) started.
"""
import os

STANDIN = True
ENV_AT_IMPORT = dict(os.environ)
RECORD: dict = {}
