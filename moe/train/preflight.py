"""train.py's checks before Hydra starts a run: nothing is written for a run that never starts.

Hydra creates the run dir (`.hydra/`, `train.log`) before it calls the task, and exits 1 on a
composition error, which a supervisor retries. So `train.py` composes the same config first,
with Hydra's Compose API, and settles it (moe.train.run.settle, once per process): a config error
(an unknown preset, an unknown key however it is written, `+trainer.max_step=5` included, a wrong
type, a NaN, a rule of moe.config.validate, a run dir that cannot be created, a resume train()
would refuse) prints one paragraph and exits 2 (moe.tools.supervise never retries it), and
train.py prints a dry run's plan from the settled config and exits 0, both before any directory
exists or an existing run's files are touched.
A multirun (`-m`) has every job of its sweep checked first (`check_sweep`); Hydra's own flags
(`--help`, `--cfg`, ...) go straight to Hydra.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, open_dict

from moe.errors import UserError

MULTIRUN_FLAGS = {"-m", "--multirun"}
PLUGIN_EXTRAS = {"sweeper/optuna": "optuna", "launcher/submitit": "slurm"}  # pyproject.toml's extras


def preflight(argv: list[str], config_dir: str, config_name: str = "train"):
    """Compose and settle `argv`'s config: (cfg, ParallelDims), or None for a multirun (every job checked)
    and Hydra's own flags; a config error prints one paragraph and exits 2."""
    flags = {arg for arg in argv if arg.startswith("-")}
    if flags - MULTIRUN_FLAGS:
        return None  # --help / --cfg / --info ...: Hydra's business
    from moe.train.run import settle  # here, not at import: Hydra's own flags need none of the run's code

    if flags:
        check_sweep([arg for arg in argv if arg not in flags], config_dir, config_name)
        return None
    try:
        cfg, run_dir = compose_config(argv, config_dir, config_name)
        dims, _ = settle(cfg)  # its note is train()'s to print, once
        if not (cfg.dry_run or cfg.simulate):
            check_run_dir(run_dir, cfg.resume, cfg.lock_wait_s, cfg.model, cfg.moe_opt)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return cfg, dims


def check_sweep(overrides: list[str], config_dir: str, config_name: str) -> None:
    """`-m`: every job of a basic sweep (command-line lists and `hydra.sweeper.params`, expanded by
    Hydra's own BasicSweeper.split_arguments) is composed and checked before the first one starts:
    a typo in job 7 exits 2 now, not after six jobs (or with Hydra's exit 1 at composition). Other
    sweepers' search spaces (Optuna's ranges) are not enumerable: their base config is checked."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from moe.train.run import settle

    jobs = [overrides]
    try:
        base, _ = compose_config([o for o in overrides if "," not in o.partition("=")[2]], config_dir,
                                 config_name, keep_hydra=True)
        sweeper = base.hydra.sweeper
        if sweeper._target_.endswith("BasicSweeper"):
            params = [f"{key}={value}" for key, value in (sweeper.get("params") or {}).items()]
            parsed = OverridesParser.create().parse_overrides([*params, *overrides])
            jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        for number, job in enumerate(jobs):
            try:
                settle(compose_config(job, config_dir, config_name)[0])
            except UserError as err:
                raise UserError(err.field, err.value, err.fix,
                                problem=f"{err.problem} (in sweep job #{number}: {' '.join(job)})") from err
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def compose_config(overrides: list[str], config_dir: str, config_name: str,
                   keep_hydra: bool = False) -> tuple[DictConfig, Path]:
    """The config Hydra would give the task, without the `hydra` node, and the run dir Hydra would
    create; composition errors as UserError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        with open_dict(cfg):  # what Hydra's run sets before the task, for `${hydra:runtime.output_dir}`
            run_dir = Path(cfg.hydra.run.dir).absolute()
            cfg.hydra.runtime.output_dir = str(run_dir)
    except (HydraException, OmegaConfBaseException) as err:
        raise composition_error(err, overrides) from err
    HydraConfig.instance().set_config(cfg)  # the loggers' save_dir interpolates it
    if not keep_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg, run_dir


def composition_error(err: Exception, overrides: list[str]) -> UserError:
    """Hydra's or OmegaConf's message (and its cause) as one paragraph naming the override it came from."""
    # Hydra suggests `+key=value` for a misspelt key, which would add it silently: left out
    text = re.sub(r"To append to your config use \S+", "", str(err).split("Config search path")[0])
    if err.__cause__ is not None:
        text += f": {str(err.__cause__).splitlines()[0]}"
    message = " ".join(text.split()).replace(". :", ":").rstrip(".")
    culprit = next((o for o in overrides if o.lstrip("+~").split("=")[0] in message), None)
    field, _, value = (culprit or "overrides").lstrip("+~").partition("=")
    fix = ("check the spelling against docs/CONFIG.md (every key and preset is listed there; "
           "`python train.py --cfg job` prints the composed config)")
    if guess := misspelt(message, field):
        fix = f"did you mean {guess}? Else {fix}"
    for plugin, extra in PLUGIN_EXTRAS.items():
        if f"Could not find 'hydra/{plugin}" in message:
            fix = f"install the Hydra plugin: pip install -e '.[{extra}]' -c constraints.txt"
    return UserError(field, value or overrides, fix,
                     problem=f"is refused when composing the config: {message}")


def misspelt(message: str, field: str) -> str | None:
    """For a key or preset Hydra could not find, the closest one that exists (`trainer.max_steps`,
    `model=tiny`), or None."""
    from moe.errors import did_you_mean

    preset = re.search(r"Could not find '([^']+)/([^'/]+)' Available options in '[^']+': ([\w ]+)", message)
    if preset:
        group, option, options = preset.groups()
        guess = did_you_mean(option, options.split())
        return f"{group}={guess}" if guess else None
    if re.search(r"Key '[^']+' not in '\w+'", message) and "." in field:
        from omegaconf import OmegaConf

        from moe.config.schema import TrainConfig

        parent, _, key = field.rpartition(".")
        node = OmegaConf.select(OmegaConf.structured(TrainConfig), parent)
        guess = did_you_mean(key, node.keys()) if node is not None and hasattr(node, "keys") else None
        return f"{parent}.{guess}" if guess else None
    return None


def check_run_dir(run_dir: Path, resume: bool, lock_wait_s: float | None, model, moe_opt) -> None:
    """What Hydra would trip over or overwrite: a run dir that cannot be created, and a resume that
    train() would refuse (Hydra rewrites the existing run's .hydra/ and train.log before the task): a live
    run's lock, or a checkpoint of another model (`model`, `moe_opt`: the sections resumed with)."""
    from moe.checkpoint.picker import check_resume_compatible, find_resume_checkpoint
    from moe.ranks import is_rank_zero

    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not existing.is_dir() else "cannot be written by this user"
        raise UserError("hydra.run.dir", str(run_dir),
                        "pick a writable place: hydra.run.dir=DIR (or run_name=NAME under runs/)",
                        problem=f"cannot be created: {existing} {what}")
    if is_rank_zero():  # one run per directory: refuse a live run's before Hydra rewrites its .hydra/
        from moe.train.run_lock import check_free

        check_free(run_dir, lock_wait_s)
    if resume and is_rank_zero():  # one reader: every rank hashing a 90 GB file at launch is wasted IO
        resume_from = find_resume_checkpoint(run_dir / "checkpoints", quiet=True)
        if resume_from:
            check_resume_compatible(resume_from, model, moe_opt)
