"""Stub: data types only (no kernels; see package docstring)."""
from collections import namedtuple
from enum import Enum

# Constructed in ExpertMLPsV2.__init__ (modules/moe/expert_mlps_v2.py:90) and as a dataclass
# default (modules/moe/blockwise.py:156).
SkipMode = namedtuple("SkipMode", ["skip_token", "skip_weight"])


class BlockShardStrategy(Enum):
    HI_LO = 0
    PING_PONG = 1
