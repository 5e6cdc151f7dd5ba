"""Functions read the config sections they need, not the whole config.

A source scan (fast, no imports) lists every function under moe/ that takes train.py's whole config: a
parameter named `cfg` (a function that takes one section names it after the section, or annotates it with
the section's schema class), or a read of a section off another object's config (`backend.cfg.parallel`).
The Backend holds the run's config: it takes it once, in its constructor (a subclass sets itself up in
`prepare`), and the modules it builds (LitMoE, NeuronLitMoE) read the backend's; their methods'
`self.cfg.<section>` reads, and a helper's reads of a LightningModule's own config (`module.cfg`,
`pl_module.cfg`), are that holder's. The other entry points' configs (data_prep's PrepConfig, infer's
InferConfig, moe.eval's EvalConfig) are theirs, not train.py's.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"model", "moe_opt", "parallel", "hardware", "optimizer", "data", "trainer", "logger",
            "callbacks", "seed", "run_name", "resume", "dry_run", "simulate", "simulate_rank", "routing_skew",
            "allow_pickle", "lock_wait_s"}
HOLDERS = {"self", "module", "pl_module", "lit_module"}  # a holder's own config (module docstring)
NOT_TRAIN = ("moe/infer/", "moe/eval/", "moe/data/prep_pipeline.py", "moe/config/rules/entries.py")  # other
# entry points
PART_TYPES = ("ModelConfig", "MoEOptConfig", "ParallelConfig", "HardwareConfig", "OptimizerConfig",
              "DataConfig", "TrainerConfig", "Section", "PrepConfig", "InferConfig", "EvalConfig")

# Every function that takes the whole config, and why it must: entry points, the conversions of the whole,
# and the few that combine every section (the planner, the simulation, the run itself).
WHOLE = {
    "moe/train/run.py": {"settle", "settled_of", "train", "_train"},  # the run
    "moe/train/callbacks.py": {"key_config"},  # the values a report compares runs by, from every section
    "moe/config/validate.py": {"validate"},  # the table of rules, each given what its parameters name
    "moe/config/rules/training.py": {"check_known_keys", "check_finite"},  # walk every key
    "moe/config/settled.py": {"settled_config"},  # the conversion to frozen dataclasses
    "moe/config/upgrade.py": {"with_schema_defaults"},  # an older checkpoint's config, typed
    "moe/parallel/dims.py": {"from_config"},  # the layout from every section it reads
    "moe/tools/plan.py": {"make_plan"},  # the planner
    "moe/tools/simulate.py": {"simulate"},  # the simulation
    "moe/backends/__init__.py": {"build_backend"},  # the backend of hardware.strategy, from the config
    "moe/backends/base.py": {"__init__"},  # Backend holds the run's config (subclasses: `prepare`); the
    # modules it builds (LitMoE, NeuronLitMoE) read the backend's
}


def _whole_config_readers() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "moe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(NOT_TRAIN):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
            cfg = next((a for a in args if a.arg == "cfg"), None)
            takes = cfg is not None and not (cfg.annotation and ast.unparse(cfg.annotation) in PART_TYPES)
            reaches = any(isinstance(node, ast.Attribute) and node.attr in SECTIONS
                          and isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"
                          and not (isinstance(node.value.value, ast.Name) and node.value.value.id in HOLDERS)
                          for node in ast.walk(fn))
            if takes or reaches:
                found.setdefault(rel, set()).add(fn.name)
    return found


def test_only_entry_points_and_combiners_take_the_whole_config():
    found = _whole_config_readers()
    extra = {f"{path}:{name}" for path, names in found.items() for name in names - WHOLE.get(path, set())}
    assert not extra, ("these take train.py's whole config: give them the sections they read, named after "
                       "them (or, if one truly combines every section, add it to WHOLE with why): "
                       f"{sorted(extra)}")
    gone = {f"{path}:{name}" for path, names in WHOLE.items() for name in names - found.get(path, set())}
    assert not gone, f"no longer take the whole config: drop them from WHOLE: {sorted(gone)}"
    assert sum(len(names) for names in WHOLE.values()) == 15  # issue T: at most 15 (113 at 94a9c8b)
