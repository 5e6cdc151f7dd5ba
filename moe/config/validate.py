"""Every rule train.py checks, in order: `validate(cfg)` raises ConfigError(field, value, fix) for the first
one a composed config breaks, before anything is built (moe.train.run.settle then builds the
run's ParallelDims). The rules live beside what they govern (moe/config/rules/: architecture, layout,
backends, training, entries); this table is the one place their order is written, and the names below
stay importable from here.

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
from moe.config.choices import *  # noqa: F403  (the choices, as importable from here as before)
from moe.config.derived import data_parallel_size, planning, world_of
from moe.config.rules.architecture import (
    validate_gqa,
    validate_groups,
    validate_mla,
    validate_model,
    validate_routing,
)
from moe.config.rules.backends import (
    BACKEND_RULES,
    check_backend,
    check_backend_degrees,
    check_offload,
    check_overlap_comm,
    check_pp_schedule,
)
from moe.config.rules.entries import check_chat_template, validate_infer, validate_prep
from moe.config.rules.layout import (
    check_degrees,
    check_dp_matches_world,
    check_ep,
    check_global_batch,
    check_hybrid_shard,
    check_model_split,
    check_sequence_parallel,
    check_untied_embeddings,
    check_whole_kv_heads,
    check_world_divisible,
    check_zero_stage,
)
from moe.config.rules.refusals import SEED_RANGE, check_seed
from moe.config.rules.training import (
    FREE_FORM,
    check_activation_checkpointing,
    check_data,
    check_finite,
    check_fp8_experts,
    check_guard,
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
    check_sequence_parallel, check_zero_stage, check_model_split, check_activation_checkpointing,
    check_seq_len, check_data, check_optimizer, check_schedule, check_guard, check_instantiables,
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


__all__ = [  # the rules, the table and the checks other entry points run
    "BACKEND_RULES", "FREE_FORM", "RULES", "SEED_RANGE", "check_activation_checkpointing",
    "check_backend", "check_backend_degrees", "check_chat_template", "check_data", "check_degrees",
    "check_dp_matches_world", "check_ep", "check_finite", "check_fp8_experts",
    "check_global_batch", "check_guard",
    "check_hybrid_shard", "check_instantiables", "check_known_keys", "check_model",
    "check_model_split",
    "check_offload", "check_optimizer", "check_overlap_comm", "check_planning", "check_pp_schedule",
    "check_schedule", "check_seed", "check_seeds", "check_seq_len", "check_sequence_parallel",
    "check_simulate", "check_trainer_counts", "check_untied_embeddings", "check_waits",
    "check_whole_kv_heads", "check_world_divisible", "check_zero_stage", "validate", "validate_gqa",
    "validate_groups", "validate_infer", "validate_mla", "validate_model", "validate_prep",
    "validate_routing",
]
