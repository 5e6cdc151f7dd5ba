"""A run's launches: which config trained which steps, and the check every relaunch passes first.

`<run dir>/launches.json` lists the launches whose steps the run keeps, oldest first: the step each went on
from, the whole config it trained with, what it changed against the launch before (the resume contract,
moe.config.contract), the sha256 of its data's tokenizer, where and how it was launched. A launch's steps
run from its `from_step` (exclusive) to the next launch's; a launch that resumes from step s replaces the
records from s on (their steps past s were not kept: the run went on from the checkpoint at s).

A relaunch passes `check_relaunch` before anything is written (train.py's preflight, before Hydra touches the
run dir, and train() again for runs started in-process): a changed fixed key or tokenizer is refused (exit 2,
every such key named, the run dir unchanged), a run whose checkpoint is at or past trainer.max_steps has
nothing to train (`NothingToTrain`: exit 0, the run dir unchanged), anything else is allowed and
`record_launch` writes it down once the run holds its lock.
"""
from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from pathlib import Path

from moe.checkpoint.io import write_json_atomic
from moe.config.contract import NOT_COMPARED, TOKENIZER_KEY, changes
from moe.config.settled import as_container, settled_config
from moe.errors import UserError

LAUNCHES = "launches.json"


class NothingToTrain(Exception):
    """A relaunch of a run that already reached trainer.max_steps: one line, exit 0, nothing written."""


def read_launches(run_dir: Path) -> list[dict]:
    """The run's launch records, oldest first ([] for a new run, or one from before they were kept)."""
    from moe.inputs import load_json

    path = Path(run_dir) / LAUNCHES
    if not path.is_file():
        return []
    fix = ("restore it from a copy, or start the run over with resume=false (or train into another "
           "run_name): it says which config trained which steps")
    launches = load_json(path, "hydra.run.dir", str(run_dir), fix)
    launches = launches.get("launches") if isinstance(launches, dict) else None
    if not isinstance(launches, list) or not all(
            isinstance(launch, dict) and isinstance(launch.get("from_step"), int)
            and isinstance(launch.get("config"), dict) for launch in launches):
        raise UserError("hydra.run.dir", str(run_dir), fix, problem=f"cannot be read: {path} holds no list "
                        "of launches (from_step, config), as train.py writes")
    return launches


def config_at(launches: list[dict], step: int) -> dict | None:
    """The config that trained `step` (>= 1; step 0, none trained yet: the first launch's)."""
    trained = [launch for launch in launches if launch["from_step"] < max(step, 1)]
    return trained[-1]["config"] if trained else None


def tokenizer_sha256(data) -> str | None:
    """The sha256 of the tokenizer.json the run's data is tokenized with, read without preparing the data:
    a prepared dir's meta.json records it; online data names its tokenizer dir. None where neither says."""
    from moe.data.arrow_io import read_meta
    from moe.data.tokenizer import file_sha256
    from moe.paths import local_path

    try:
        path = data.sources[0].path if data.sources else data.path  # a mixture's sources share one
        if data.kind == "prepared" and path:
            return read_meta(Path(local_path(path)).expanduser())["tokenizer"]["sha256"]
        if data.tokenizer:
            file = Path(local_path(data.tokenizer)).expanduser() / "tokenizer.json"
            return file_sha256(file) if file.is_file() else None
    except (UserError, OSError, KeyError, TypeError):
        return None  # the data module names what is wrong with the data itself
    return None


def check_relaunch(run_dir: Path, config: dict, data, max_steps: int,
                   resume_from: Path | None) -> dict[str, list]:
    """Before a launch that resumes from `resume_from` (None: a fresh start) writes anything: refuse a change
    the resume contract forbids in `config` (the launch's settled config, as_container: every key is
    compared), stop one that has nothing to train (trainer.max_steps); returns the allowed changes
    ({key: [before, now]}) for its record. `data`: the data section, whose tokenizer is compared by its
    bytes."""
    if resume_from is None:
        return {}
    from moe.checkpoint.formats import step_hint

    step = step_hint(resume_from)
    launches = read_launches(run_dir)
    before = config_at(launches, step) or _checkpoint_config(resume_from)
    allowed = {}
    if before is not None:
        found = changes(as_container(settled_config(before)), config)
        refused = dict(found.refused)
        recorded, now = (launches[0].get("tokenizer_sha256") if launches else None), tokenizer_sha256(data)
        if recorded and now and recorded != now:
            refused[TOKENIZER_KEY] = (recorded[:12], now[:12])
        if refused:
            raise _refusal(run_dir, step, refused)
        allowed = {key: list(pair) for key, pair in found.allowed.items()}
    if step >= max_steps:
        raise NothingToTrain(
            f"{run_dir} already trained to step {step} (its checkpoint {resume_from.name}) and "
            f"trainer.max_steps={max_steps}: nothing to train, nothing changed. To train on, raise "
            "trainer.max_steps; for another run, pass run_name=NAME (or resume=false to start this one over)")
    return allowed


def _checkpoint_config(resume_from: Path) -> dict | None:
    """The config a checkpoint from before launches.json was kept says it trained with."""
    import moe.backends.checkpoint_formats  # noqa: F401  (every backend's own format, registered on import)
    from moe.checkpoint.formats import load
    from moe.checkpoint.picker import lightning_part

    return (load(lightning_part(resume_from)).get("hyper_parameters") or {}).get("cfg")


def _refusal(run_dir: Path, step: int, refused: dict[str, tuple]) -> UserError:
    (key, (before, now)), *others = refused.items()
    also = "; ".join(f"{k} ({b!r} -> {n!r})" for k, (b, n) in others)
    shown = "the tokenizer's sha256" if key == TOKENIZER_KEY else key
    problem = (f"differs from the run being resumed ({run_dir}, which trained to step {step} with {shown}="
               f"{before!r}){'; so do ' + also if also else ''}. A run's model, data, tokenizer and seed are "
               "fixed (docs/FAULT_TOLERANCE.md, 'The resume contract'); nothing was changed")
    fix = ("relaunch with the run's values, or start another run: another run_name (run_name=NAME), or "
           "resume=false to start this run over")
    return UserError(key, now, fix, problem=problem)


def record_launch(run_dir: Path, config: dict, data, from_step: int, changed: dict[str, list], reports: dict,
                  world: int) -> None:
    """Append this launch (rank zero, holding the run's lock; records from `from_step` on are dropped): its
    `config` (as_container), its `data` section's tokenizer, what it `changed`. `reports`: the values a
    report compares runs by (moe.train.callbacks.key_config), which summary.json states only where every
    kept step trained with them."""
    from moe.train.launch_world import launcher_name

    kept = [launch for launch in read_launches(run_dir) if launch["from_step"] < from_step] if from_step \
        else []
    kept.append({
        "from_step": from_step,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "pid": os.getpid(), "launcher": launcher_name(), "world": world,
        "changed": changed,
        "tokenizer_sha256": (kept[0].get("tokenizer_sha256") if kept else None) or tokenizer_sha256(data),
        "reports": reports,
        "config": config,
    })
    write_json_atomic(Path(run_dir) / LAUNCHES, {"launches": kept})


def reports_by_steps(launches: list[dict], last_step: int) -> dict[str, list[dict]]:
    """The reported values (`reports`) that changed over the steps 1..last_step the run kept: for each, the
    ranges of steps and the value each trained with (neighbouring launches with one value: one range)."""
    spans = [(launch, launches[i + 1]["from_step"] if i + 1 < len(launches) else last_step)
             for i, launch in enumerate(launches)]
    spans = [(launch, end) for launch, end in spans if end > launch["from_step"]]  # trained at least one step
    keys = {key for launch, _ in spans for key in launch.get("reports", {}) if key not in NOT_COMPARED}
    found = {}
    for key in sorted(keys):
        ranges: list[dict] = []
        for launch, end in spans:
            value = launch.get("reports", {}).get(key)
            if ranges and ranges[-1]["value"] == value:
                ranges[-1]["steps"][1] = end
            else:
                ranges.append({"steps": [launch["from_step"] + 1, end], "value": value})
        if len(ranges) > 1:
            found[key] = ranges
    return found
