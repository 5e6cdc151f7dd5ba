"""How a rule gets what it reads: its parameters name it.

A rule's parameters are the config's sections or top-level keys it checks (`parallel`, `model`, `seed`),
the values derived from the config it needs (FACTS: the world it plans for, the data-parallel size, the
backend's spec, whether the run only plans), or `cfg`, the whole config, for the few that walk all of it
(known keys, finite numbers). So a rule reads only what its signature says, and the table in
moe.config.validate is the one place that sees the whole config.
"""
from __future__ import annotations

import inspect

from moe.config.derived import data_parallel_size, planning, world_of
from moe.config.specs import spec_of

FACTS = {"world": world_of, "dp": data_parallel_size, "spec": spec_of, "planning": planning}


def apply_rule(rule, cfg) -> None:
    """Run `rule` on `cfg`, passing each parameter what it names."""
    args = {name: cfg if name == "cfg" else FACTS[name](cfg) if name in FACTS else getattr(cfg, name)
            for name in inspect.signature(rule).parameters}
    rule(**args)
