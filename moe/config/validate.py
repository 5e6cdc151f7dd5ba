"""Every rule train.py checks, in order: `validate(cfg)` raises ConfigError(field, value, fix) for the first
one a composed config breaks, before anything is built (moe.train.run.settle then builds the
run's ParallelDims). The rules live beside what they govern (moe/config/rules/: architecture, layout,
backends, training, entries) and are imported from there; this table is the one place their order is
written.

A rule's parameters say what it reads (`validate` passes each what it names): the config's sections or
top-level keys it checks (`parallel`, `model`, `seed`), the values derived from the config it needs
(`world`, the size it plans for; `dp`, the data-parallel size; `spec`, the backend's; `planning`, whether
the run only plans), or `cfg`, the whole config, for the few that walk all of it (known keys, finite
numbers). So a rule reads only what its signature says, and `validate` is the one place that sees the
whole config.
"""
from __future__ import annotations

import inspect

from moe.backends.registry import spec_of
from moe.config.derived import data_parallel_size, planning, world_of
from moe.config.rules.backends import (
    BACKEND_RULES,
    check_backend,
    check_backend_degrees,
    check_offload,
    check_overlap_comm,
    check_pp_schedule,
)
from moe.config.rules.layout import (
    check_degrees,
    check_dp_matches_world,
    check_ep,
    check_global_batch,
    check_hybrid_shard,
    check_model_split,
    check_mtp_layout,
    check_sequence_parallel,
    check_world_divisible,
    check_zero_stage,
)
from moe.config.rules.training import (
    check_activation_checkpointing,
    check_data,
    check_document_mask,
    check_finite,
    check_fp8_experts,
    check_guard,
    check_in_run_eval,
    check_instantiables,
    check_known_keys,
    check_model,
    check_optimizer,
    check_planning,
    check_schedule,
    check_seeds,
    check_seq_len,
    check_simulate,
    check_trainer_counts,
    check_waits,
)

RULES = [  # in order: keys and numbers, counts, the hardware, divisibility of the layout, the rest
    # (BACKEND_RULES: the rules of the run's backend, by hardware.strategy)
    check_known_keys, check_finite, check_seeds,
    check_trainer_counts, check_backend, check_degrees, check_backend_degrees, check_pp_schedule,
    check_offload,
    check_overlap_comm,
    check_model,
    check_world_divisible, check_dp_matches_world, check_ep, check_hybrid_shard, check_global_batch,
    check_sequence_parallel, check_zero_stage, check_model_split, check_mtp_layout,
    check_activation_checkpointing,
    check_seq_len, check_data, check_document_mask, check_optimizer, check_schedule, check_guard,
    check_in_run_eval, check_instantiables,
    BACKEND_RULES, check_fp8_experts, check_planning, check_simulate, check_waits,
]


def validate(cfg) -> None:
    """Raise ConfigError for the first rule the composed config breaks. Each rule gets what its parameters
    name; a derived value is computed only for a rule that asks for it (an earlier rule has checked what
    it rests on)."""
    plans = planning(cfg.dry_run, cfg.simulate)
    facts = {"planning": lambda: plans,
             "world": lambda: world_of(cfg.trainer, cfg.parallel, plans),
             "dp": lambda: data_parallel_size(cfg.parallel, facts["world"]()),
             "spec": lambda: spec_of(cfg.hardware)}
    for rule in RULES:
        if rule is BACKEND_RULES:  # the rules the run's backend adds, by hardware.strategy
            rule = BACKEND_RULES.get(cfg.hardware.strategy)
        if rule is not None:
            rule(**{name: cfg if name == "cfg" else facts[name]() if name in facts else getattr(cfg, name)
                    for name in inspect.signature(rule).parameters})


__all__ = ["RULES", "validate"]
