"""Capacity advisor: the smallest capacity factor that would have kept token drops under a target.

A run logs, for each logged step, the router's assignment counts per MoE layer and expert
*before* drops (`tokens_per_expert`) and the number of tokens T of that forward
(`tokens_per_forward`). Those counts do not depend on the capacity factor of the forward
they came from, so drops can be recomputed for any factor with the layer's own rule:

    capacity C(cf) = min(T, max(min_capacity, ceil(k * T * cf / E)))
    dropped        = sum_i max(0, count_i - C(cf))       drop rate = dropped / sum_i count_i

One dropless run is therefore enough to pick a factor, instead of a sweep. Dropping is
monotone in cf, so the smallest factor on a 0.01 grid is found by bisection.

Exact when each logged row is one routing group (the run logs the step's last forward on
rank 0). Under expert parallelism the counts are summed over the EP group while capacity
applies per rank: such rows are split evenly over the ranks, which can only hide drops,
and the advice is marked approximate.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from moe.model.routing import expert_capacity  # the layer's own rule, so advice and training agree exactly

WHAT_IF_FACTORS = (1.0, 1.25, 1.5, 2.0)


@dataclass
class RoutingLog:
    """Router assignment counts before drops, one routing group (forward) per (step, layer)."""

    steps_S: np.ndarray  # logged optimizer steps
    counts_SLE: np.ndarray  # float: assignments per expert; divided evenly when a row held n forwards
    tokens_S: np.ndarray  # T, tokens in the forward the counts came from
    top_k: int
    min_capacity: int
    exact: bool = True  # False: some rows summed several forwards and were split evenly (fewer drops)

    @property
    def num_experts(self) -> int:
        return self.counts_SLE.shape[-1]

    def subset(self, from_step: int = 0, layer: int | None = None, to_step: int | None = None) -> RoutingLog:
        """Logged steps in [from_step, to_step], optionally one MoE layer."""
        last = self.steps_S.max() if to_step is None else to_step
        keep = (self.steps_S >= from_step) & (self.steps_S <= last)
        counts = self.counts_SLE[keep]
        if layer is not None:
            counts = counts[:, layer:layer + 1]
        return RoutingLog(self.steps_S[keep], counts, self.tokens_S[keep], self.top_k, self.min_capacity,
                          self.exact)


def routing_log_from_rows(rows: list[dict], top_k: int, min_capacity: int,
                          tokens_per_forward: int | None = None) -> RoutingLog | None:
    """Build a RoutingLog from metrics.csv rows (dicts of strings). None when nothing was logged.

    T comes from the row's `tokens_per_forward`, else the given `tokens_per_forward`
    (micro_batch_size * seq_len), else sum(counts) / k (the row is taken as one forward).
    """
    steps, counts, tokens = [], [], []
    for row in rows:
        raw = row.get("tokens_per_expert") or ""
        if not raw.strip() or raw.strip() == "[]":
            continue
        counts_LE = np.asarray(json.loads(raw), dtype=np.float64)
        if counts_LE.ndim != 2 or counts_LE.size == 0:
            continue
        t = _int_or_none(row.get("tokens_per_forward")) or tokens_per_forward
        steps.append(int(float(row["step"])))
        counts.append(counts_LE)
        tokens.append(t or 0)
    if not counts:
        return None
    counts_SLE = np.stack(counts)
    tokens_S = np.asarray(tokens, dtype=np.int64)
    assigned_SL = counts_SLE.sum(-1)
    unknown = tokens_S <= 0
    tokens_S[unknown] = np.rint(assigned_SL[unknown].max(-1) / top_k).astype(np.int64)
    # A row that summed n forwards (micro-batches, ranks) holds n * k * T assignments per layer.
    forwards_SL = np.maximum(assigned_SL / (top_k * tokens_S[:, None]), 1.0)
    exact = bool(np.all(np.isclose(forwards_SL, 1.0)))
    return RoutingLog(np.asarray(steps), counts_SLE / forwards_SL[..., None], tokens_S, top_k, min_capacity,
                      exact)


def _int_or_none(value) -> int | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) or number <= 0 else int(number)


def capacities(log: RoutingLog, capacity_factor: float | None) -> np.ndarray:
    """C for each logged forward, shape [S]; T (no limit) when dropless."""
    E, k, minc = log.num_experts, log.top_k, log.min_capacity
    slots = [expert_capacity(int(t), E, k, capacity_factor, minc) for t in log.tokens_S]
    return np.asarray([t if c is None else c for c, t in zip(slots, log.tokens_S, strict=True)],
                      dtype=np.float64)


def dropped_SL(log: RoutingLog, capacity_factor: float | None) -> np.ndarray:
    """Assignments each (step, layer) forward would have dropped at this capacity factor."""
    c_S = capacities(log, capacity_factor)
    return np.clip(log.counts_SLE - c_S[:, None, None], 0.0, None).sum(-1)


def drop_rate(log: RoutingLog, capacity_factor: float | None) -> float:
    """Dropped assignments / all assignments over every logged step and layer."""
    total = log.counts_SLE.sum()
    return float(dropped_SL(log, capacity_factor).sum() / total) if total else 0.0


def smallest_factor(log: RoutingLog, target: float, resolution: float = 0.01) -> float:
    """Smallest multiple of `resolution` whose recomputed drop rate is <= target."""
    def rate(n: int) -> float:
        return drop_rate(log, round(n * resolution, 6))

    # Zero drops once every expert's slot count reaches the busiest expert of the busiest forward.
    need = log.counts_SLE.max(axis=(1, 2)) * log.num_experts / (log.top_k * log.tokens_S)
    hi = max(1, math.ceil(float(need.max()) / resolution) + 1)
    while rate(hi) > target:  # guards float rounding; normally never loops
        hi *= 2
    lo = 0  # invariant: rate(lo) > target or lo == 0; rate(hi) <= target
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rate(mid) <= target else (mid, hi)
    return round(hi * resolution, 6)


@dataclass
class Advice:
    """What the advisor tells a user, for one run."""

    target: float
    capacity_factor: float  # smallest factor keeping the overall drop rate <= target
    drop_rate: float  # recomputed overall drop rate at that factor
    dropless_factor: float  # smallest factor with no drops at all in any logged step
    per_layer: list[float]  # smallest factor per MoE layer for the same target
    what_if: dict[float, float] = field(default_factory=dict)  # factor -> recomputed drop rate
    steps: int = 0
    exact: bool = True


def advise(log: RoutingLog, target: float = 0.01, from_step: int = 0, resolution: float = 0.01) -> Advice:
    """Smallest capacity factor that keeps recomputed drops <= target, with per-layer and what-if figures."""
    if not 0.0 <= target < 1.0:
        from moe.errors import UserError

        raise UserError("target", target, "give a fraction such as 0.01 for 1%",
                        problem="is not a drop-rate fraction in [0, 1)")
    log = log.subset(from_step)
    if len(log.steps_S) == 0:
        from moe.errors import UserError

        raise UserError("from_step", from_step, "use a step at or before the last logged one",
                        problem="leaves no logged routing statistics")
    factor = smallest_factor(log, target, resolution)
    layers = log.counts_SLE.shape[1]
    factors = sorted({*WHAT_IF_FACTORS, factor})
    return Advice(
        target=target, capacity_factor=factor, drop_rate=drop_rate(log, factor),
        dropless_factor=smallest_factor(log, 0.0, resolution),
        per_layer=[smallest_factor(log.subset(layer=i), target, resolution) for i in range(layers)],
        what_if={f: drop_rate(log, f) for f in factors}, steps=len(log.steps_S), exact=log.exact,
    )
