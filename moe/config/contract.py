"""The resume contract: which keys a relaunch into an existing run may change, and what names a run.

Every key of train.py's config is one of three kinds, by the longest prefix listed in `KINDS`:

- fixed: what the run's weights and data stream are (the model, the data and its tokenizer, the seed). A
  relaunch that changes one is refused (exit 2, naming each key): its steps would not continue this run.
- steered: the rest of the experiment (the optimizer and its schedule, the routing options). A relaunch into
  the same run may change them; the run's records (launches.json) say from which step.
- free: how and how long the run is carried out (the hardware, the parallel layout, the batch geometry,
  max_steps, logging, checkpoint cadence, the guard). A relaunch may change them; recorded the same way.

The default run name is the experiment's: a digest of its fixed and steered keys (`experiment_digest`), so
relaunching the same experiment, however it is launched, continues it, and any change to the experiment
starts another run unless the run is named (run_name=, hydra.run.dir=), which is how a run is steered.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Literal

Kind = Literal["fixed", "steered", "free"]

# prefix -> (kind, why); the longest prefix of a key decides. docs/FAULT_TOLERANCE.md's table is made from it.
KINDS: dict[str, tuple[Kind, str]] = {
    "model": ("fixed", "the weights' shapes and the function they compute"),
    "model.compile": ("free", "how the same function runs"),
    "data": ("fixed", "the stream of rows: its files, tokenizer, length, split and order"),
    "data.num_workers": ("free", "how the same rows are loaded"),
    "seed": ("fixed", "the stream's order and every step's random draws"),
    "moe_opt": ("steered", "the routing a step trains with"),
    "moe_opt.enable_expert_bias": ("fixed", "a buffer in the weights (the experts' bias)"),
    "optimizer": ("steered", "the update a step makes and its schedule"),
    "trainer": ("free", "how long, in what batch geometry and precision, logged and guarded how"),
    "hardware": ("free", "where it runs (checkpoints convert between backends where they can)"),
    "parallel": ("free", "the layout (checkpoints reshard on load)"),
    "logger": ("free", "where metrics also go"),
    "callbacks": ("free", "extra callbacks"),
    "run_name": ("free", "the run's directory itself"),
    "resume": ("free", "whether this launch resumes"),
    "allow_pickle": ("free", "what this launch may load"),
    "lock_wait_s": ("free", "how long this launch waits for the run's lock"),
    "dry_run": ("free", "a plan, not a run"),
    "simulate": ("free", "a plan, not a run"),
    "simulate_rank": ("free", "a plan, not a run"),
    "routing_skew": ("free", "a plan, not a run"),
}
# the tokenizer's bytes are fixed too, whatever names them (moe.train.launches compares their sha256)
TOKENIZER_KEY = "data.tokenizer (its tokenizer.json)"
# names the run rather than saying how it trains (a run given hydra.run.dir keeps its directory whatever the
# default name would now be): never a change
NOT_COMPARED = ("run_name",)


def kind_of(key: str) -> Kind:
    """The kind of a dotted key: its longest prefix in KINDS."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        found = KINDS.get(".".join(parts[:end]))
        if found:
            return found[0]
    raise KeyError(f"{key} is not a key of train.py's config (moe.config.contract.KINDS)")


def flat(values: dict, prefix: str = "") -> dict[str, Any]:
    """`values` (a config as plain containers) as {dotted key: value}; lists and the free-form dicts of the
    logger and callbacks groups are values."""
    out = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in ("logger", "callbacks"):
            out.update(flat(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def schema_defaults(schema: type) -> dict[str, Any]:
    """Every key of a config schema (a dataclass: moe.config.schema.TrainConfig) with its default, flat."""
    return flat(dataclasses.asdict(schema()))


def experiment_digest(values: dict, defaults: dict[str, Any]) -> str:
    """8 hex digits naming the experiment: its fixed and steered keys that differ from the schema's `defaults`
    (schema_defaults), so a key added later with a default keeps old runs' names."""
    named = {key: value for key, value in flat(values).items()
             if kind_of(key) != "free" and (key not in defaults or defaults[key] != value)}
    text = json.dumps(named, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


@dataclasses.dataclass(frozen=True)
class Changes:
    """What a relaunch changes against the config the run trained with: {key: (before, now)}."""

    refused: dict[str, tuple[Any, Any]]
    allowed: dict[str, tuple[Any, Any]]


def changes(before: dict, now: dict) -> Changes:
    """Compare two configs (plain containers of the whole config) key by key under the contract."""
    old, new = flat(before), flat(now)
    refused, allowed = {}, {}
    for key in sorted(set(old) | set(new)):
        if key in NOT_COMPARED or (key in old and key in new and old[key] == new[key]):
            continue
        if key not in old or key not in new:  # a key one version of the schema has and the other lacks
            continue
        (refused if kind_of(key) == "fixed" else allowed)[key] = (old[key], new[key])
    return Changes(refused, allowed)


def contract_table(defaults: dict[str, Any]) -> str:
    """The contract as docs/FAULT_TOLERANCE.md shows it, for the schema `defaults` (schema_defaults):
    `python tests/test_relaunch.py` prints it."""
    verdict = {"fixed": "refused (exit 2)", "steered": "allowed into a named run, recorded",
               "free": "allowed, recorded"}
    lines = ["| keys | on a relaunch | in the default run name | why |", "|---|---|---|---|"]
    for prefix, (kind, why) in KINDS.items():
        scalar = prefix in defaults and not isinstance(defaults[prefix], dict)
        keys = f"`{prefix}`" if scalar or "." in prefix else f"`{prefix}.*`"
        said = "not compared: it names the directory" if prefix in NOT_COMPARED else verdict[kind]
        lines.append(f"| {keys} | {said} | {'no' if kind == 'free' else 'yes'} | {why} |")
    lines.append(f"| {TOKENIZER_KEY} | refused (exit 2) | through `data.*` | the ids the weights were "
                 "trained on |")
    return "\n".join(lines) + "\n"
