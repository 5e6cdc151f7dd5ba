"""Kept import path: the MoE layer lives in moe/model/moe.py."""
from moe.model.moe import Experts, MoELayer, Router, RoutingStats, grouped_mm_works

__all__ = ["Experts", "MoELayer", "Router", "RoutingStats", "grouped_mm_works"]
