"""FAKE neuronx_distributed.modules.moe (tests/fakes/README.md)."""
from .expert_mlps import ExpertMLPs  # noqa: F401
from .model import MoE  # noqa: F401
from .routing import RouterTopK  # noqa: F401
