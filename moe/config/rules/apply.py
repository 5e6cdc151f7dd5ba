"""How a rule gets what it reads: its parameters name it.

A rule's parameters are the config's sections or top-level keys it checks (`parallel`, `model`, `seed`),
the values derived from the config it needs (`facts` below: the world it plans for, the data-parallel
size, the backend's spec, whether the run only plans), or `cfg`, the whole config, for the few that walk
all of it (known keys, finite numbers). So a rule reads only what its signature says, and the table in
moe.config.validate is the one place that sees the whole config.
"""
from __future__ import annotations

import inspect

from moe.backends.registry import spec_of
from moe.config.derived import data_parallel_size, planning, world_of


def apply_rule(rule, cfg) -> None:
    """Run `rule` on `cfg`, passing each parameter what it names; a derived value is computed only for a
    rule that asks for it (an earlier rule has checked what it rests on)."""
    plans = planning(cfg.dry_run, cfg.simulate)
    facts = {"planning": lambda: plans,
             "world": lambda: world_of(cfg.trainer, cfg.parallel, plans),
             "dp": lambda: data_parallel_size(cfg.parallel, facts["world"]()),
             "spec": lambda: spec_of(cfg.hardware)}
    args = {name: cfg if name == "cfg" else facts[name]() if name in facts else getattr(cfg, name)
            for name in inspect.signature(rule).parameters}
    rule(**args)
