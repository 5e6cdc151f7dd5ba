"""train.py's checks before Hydra starts a run: nothing is written for a run that never starts.

Hydra creates the run dir (`.hydra/`, `train.log`) before it calls the task, and exits 1 on a
composition error, which a supervisor retries. So `train.py` composes the same config first,
with Hydra's Compose API, and settles it (moe.train.run.settle, once per process): a config error
(an unknown preset, an unknown key however it is written, `+trainer.max_step=5` included, a wrong
type, a NaN, a rule of moe.config.validate, a run dir that cannot be created, a launcher whose
world is not the config's, a relaunch the resume contract refuses) prints one paragraph and exits 2
(moe.tools.supervise never retries it); a relaunch with nothing left to train says so and exits 0;
train.py prints a dry run's plan from the settled config and exits 0; all before any directory
exists or an existing run's files are touched. Under torchrun rank 0's verdict is every rank's
(moe.train.launch_world.agree).
A multirun (`-m`) has every job of its sweep checked first (`check_sweep`). Hydra's flags that
choose the config (--config-dir/-cd, --config-name/-cn, --config-path/-cp) get the same pre-flight;
the ones that run nothing (`--help`, `--cfg`, ...) go straight to Hydra.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, open_dict

from moe.errors import UserError

PLUGIN_EXTRAS = {"sweeper/optuna": "optuna", "launcher/submitit": "slurm"}  # pyproject.toml's extras


def preflight(argv: list[str], config_dir: str, config_name: str = "train"):
    """Compose and settle `argv`'s config as Hydra will (its own flags --config-dir/-cd, --config-name/-cn,
    --config-path/-cp included): its Settled (moe.train.run.settle), or None for a multirun (every job
    checked) and for Hydra's flags that run nothing (--help, --cfg, ...). A config error prints one
    paragraph and exits 2; a run with nothing left to train says so and exits 0; both before anything is
    written."""
    try:
        where = hydra_command(argv, config_dir, config_name)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if where is None:
        return None  # --help / --cfg / --info ...: Hydra's business
    overrides, config_dir, config_name, multirun = where
    from moe.config.settled import as_container
    from moe.train.launch_world import agree, check_launch_world, end_with_rank_zero, launched_by_rank_zero

    end_with_rank_zero()  # a rank Lightning's launcher started: gone with rank 0, however rank 0 ends
    from moe.train.run import settle  # here, not at import: Hydra's own flags need none of the run's code

    if multirun:
        check_sweep(overrides, config_dir, config_name)
        return None
    settled = run_dir = None
    mine: dict = {}
    try:
        cfg, run_dir = compose_config(overrides, config_dir, config_name)
        settled = settle(cfg)  # its notes are train()'s to say, once
        config = settled.config
        mine = as_container(config)
        launch = not (config.dry_run or config.simulate or launched_by_rank_zero())  # a plan launches nothing
        if launch:  # every rank of a launch sees its launcher's world alike: each says so, none waits
            check_launch_world(config.trainer.devices, config.trainer.num_nodes)
    except UserError as err:
        if settled is not None:  # the launcher's world
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        verdict = (2, f"error: {err}")
    else:
        try:
            verdict = None if config.dry_run or config.simulate else check_launch(
                run_dir, mine, config.data, config.trainer.max_steps, config.resume, config.lock_wait_s)
        except UserError as err:
            verdict = (2, f"error: {err}")
    verdict = agree(mine, str(run_dir or ""), verdict)  # torchrun: rank 0's decision is every rank's
    if verdict is not None:
        code, message = verdict
        if message:
            print(message, file=sys.stderr)
        sys.exit(code)
    return settled


def hydra_command(argv: list[str], config_dir: str, config_name: str):
    """What Hydra will compose for `argv`, read with Hydra's own argument parser: (overrides, config dir,
    config name, multirun), or None for a flag that composes no run. --config-dir's directory is searched
    where Hydra puts it: after conf/, before the schema (hydra/_internal/utils.py `_run_hydra`), as a
    `hydra.searchpath` entry is."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)  # a bad flag: argparse's usage line and exit 2, as Hydra's
    if any((args.help, args.hydra_help, args.cfg, args.info, args.shell_completion,
            args.experimental_rerun)):
        return None
    overrides = list(args.overrides)
    if args.config_path is not None:
        path = Path(args.config_path)
        config_dir = str(path if path.is_absolute() else Path(config_dir).parent / path)
        if not Path(config_dir).is_dir():
            raise UserError("--config-path", args.config_path, "pass a directory of configs, absolute or "
                            "relative to train.py's directory", problem=f"is not a directory ({config_dir})")
    if args.config_dir is not None:
        extra = Path(args.config_dir).absolute()
        if not extra.is_dir():
            raise UserError("--config-dir", args.config_dir, "pass an existing directory of config groups",
                            problem=f"is not a directory ({extra})")
        searchpath = [o for o in overrides if o.partition("=")[0].lstrip("+") == "hydra.searchpath"]
        entries = [f"file://{extra}"] + (_list_value(searchpath[-1]) if searchpath else [])
        overrides = [o for o in overrides if o not in searchpath]
        overrides.append(f"hydra.searchpath=[{','.join(entries)}]")
    return overrides, config_dir, args.config_name or config_name, bool(args.multirun)


def _list_value(override: str) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = OverridesParser.create().parse_overrides([override])[0].value()
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


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
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import moe.config  # noqa: F401  (registers the typed schemas with Hydra)

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        with open_dict(cfg):  # what Hydra's run sets before the task, for `${hydra:runtime.output_dir}`
            run_dir = Path(cfg.hydra.run.dir).absolute()
            cfg.hydra.runtime.output_dir = str(run_dir)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError, UnicodeDecodeError) as err:
        raise composition_error(err, overrides) from err
    HydraConfig.instance().set_config(cfg)  # the loggers' save_dir interpolates it
    if not keep_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg, run_dir


KEYS_DOC = {"train.py": "docs/CONFIG.md", "infer.py": "docs/INFERENCE.md", "data_prep.py": "docs/DATA.md",
            "-m moe.eval": "docs/EVALUATION.md"}


def composition_error(err: Exception, overrides: list[str], command: str = "train.py") -> UserError:
    """Hydra's or OmegaConf's message (and its cause) as one paragraph naming the override it came from; a
    config file that does not load (a YAML syntax error, another encoding: Hydra passes yaml's and the
    decoder's own errors through) names the file, the line and the column (`config_file_error`)."""
    from moe.config.sweeps import UNREADABLE

    unreadable = config_file_error(err, overrides)
    if unreadable is not None:
        return unreadable
    # Hydra suggests `+key=value` for a misspelt key, which would add it silently: left out
    text = re.sub(r"To append to your config use \S+", "", str(err).split("Config search path")[0])
    if err.__cause__ is not None:
        text += f": {str(err.__cause__).splitlines()[0]}"
    message = " ".join(text.split()).replace(". :", ":").rstrip(".")
    sweep = re.search(r"Could not find 'sweep/([^']+)'", message)
    if sweep and sweep.group(1) in UNREADABLE:  # a sweeps/ file left out at import: say why now
        path, cause = UNREADABLE[sweep.group(1)]
        return _unreadable_config(path, cause, "sweep", sweep.group(1))
    culprit = next((o for o in overrides if o.lstrip("+~").split("=")[0] in message), None)
    field, _, value = (culprit or "overrides").lstrip("+~").partition("=")
    fix = (f"check the spelling against {KEYS_DOC.get(command, 'docs/CONFIG.md')} (every key and preset is "
           f"listed there; `python {command} --cfg job` prints the composed config)")
    if guess := misspelt(message, field):
        fix = f"did you mean {guess}? Else {fix}"
    for plugin, extra in PLUGIN_EXTRAS.items():
        if f"Could not find 'hydra/{plugin}" in message:
            fix = f"install the Hydra plugin: pip install -e '.[{extra}]' -c constraints.txt"
    return UserError(field, value or overrides, fix,
                     problem=f"is refused when composing the config: {message}")


def config_file_error(err: BaseException, overrides: list[str]) -> UserError | None:
    """For a config file that does not load while composing, one paragraph naming the override that chose
    it (`model=mine`, else `config=<file>`), the file, the line and column of a YAML syntax error, or the
    encoding of a file that is not UTF-8; None for any other error. yaml's errors carry their file and
    position; a decoding error does not: the file is the one Hydra's file source was reading (its frame)."""
    import yaml

    seen = set()
    while err is not None and id(err) not in seen:  # the error itself, or one it was raised from
        seen.add(id(err))
        if isinstance(err, yaml.YAMLError):
            mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
            path = getattr(mark, "name", None)
            if path and Path(path).is_file():
                return _unreadable_config(Path(path), err, *_chosen_by(Path(path), overrides))
        if isinstance(err, UnicodeDecodeError):
            path = _file_being_loaded(err)
            if path is not None:
                return _unreadable_config(path, err, *_chosen_by(path, overrides))
        err = err.__cause__ or err.__context__
    return None


def _chosen_by(path: Path, overrides: list[str]) -> tuple[str, str]:
    """(field, value) of the override that selected `path` (`model=mine` for .../model/mine.yaml), else
    ("config", the file)."""
    for override in overrides:
        group, _, option = override.lstrip("+~").partition("=")
        if option and path.as_posix().endswith(f"/{group.replace('.', '/')}/{option}.yaml"):
            return group, option
    return "config", str(path)


def _file_being_loaded(err: BaseException) -> Path | None:
    """The config file Hydra's FileConfigSource.load_config was reading when `err` was raised."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "load_config" and "full_path" in frame.f_locals:
            return Path(frame.f_locals["full_path"])
        tb = tb.tb_next
    return None


def _unreadable_config(path: Path, err: BaseException, field: str, value: str) -> UserError:
    """`field`=`value` (the override that chose `path`, or config=`path`) cannot be read: where and why."""
    from moe.inputs import encoding_problem, parse_error, position

    if isinstance(err, UnicodeDecodeError):
        problem, fix = encoding_problem(path)
    else:
        where = position(err)
        at = f" at {where}" if where else ""
        problem = f"{path} is not valid YAML{at} ({parse_error(err)})"
        fix = f"correct the YAML in {path}{at} (or move the file aside)"
    if field == "config":  # the value is the file: say it once
        problem = problem.removeprefix(f"{path} ")
    return UserError(field, value, fix,
                     problem=problem if field == "config" else f"cannot be read: {problem}")


def config_file_errors(argv: list[str]):
    """A context in which a config file that does not load (a YAML syntax error, another encoding), met by
    Hydra while composing, prints `config_file_error`'s paragraph and exits 2; other errors go on."""
    import contextlib

    import yaml

    @contextlib.contextmanager
    def checked():
        try:
            yield
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            unreadable = config_file_error(err, argv)
            if unreadable is None:
                raise
            print(f"error: {unreadable}", file=sys.stderr)
            sys.exit(2)

    return checked()


def check_composes(argv: list[str], config_dir: str, config_name: str, command: str) -> None:
    """infer.py's and data_prep.py's pre-flight: their config composed as Hydra will before Hydra runs the
    command (its flags that choose the config, --config-dir/-cd, --config-name/-cn, --config-path/-cp,
    included), so that a composition error (an unknown key or preset, a wrong type, a YAML syntax error, a
    file in another encoding) is one paragraph and exit 2 rather than Hydra's exit 1 or a traceback. Hydra's
    flags that run nothing (--help, --cfg, ...) go straight to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        where = hydra_command(argv, config_dir, config_name)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if where is None or where[3]:
        return
    overrides, config_dir, config_name, _ = where
    with config_file_errors(overrides):
        try:
            with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
                compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as err:
            print(f"error: {composition_error(err, overrides, command)}", file=sys.stderr)
            sys.exit(2)
        finally:
            GlobalHydra.instance().clear()


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


def check_launch(run_dir: Path, config: dict, data, max_steps: int, resume: bool,
                 lock_wait_s: float | None) -> tuple[int, str] | None:
    """Before Hydra touches the run dir: a run dir that cannot be created, a live run's lock, and a relaunch
    the resume contract refuses in `config` (the settled config, as_container) or that has nothing to train
    (moe.train.launches). Returns what to do instead of the run (exit code, message), or None to go on; a
    refusal raises UserError."""
    import moe.backends.checkpoint_formats  # noqa: F401  (every backend's own format, registered on import)
    from moe.checkpoint.picker import find_resume_checkpoint, newest_checkpoint
    from moe.ranks import is_rank_zero
    from moe.train.launch_world import follows_rank_zero, launched_by_rank_zero
    from moe.train.launches import NothingToTrain, check_relaunch

    check_writable(run_dir)
    if launched_by_rank_zero():
        return None  # Lightning's own launcher: rank 0 checked all of this before it started this rank
    if follows_rank_zero():
        return None  # torchrun: rank 0 judges the run dir for every rank (agree)
    if is_rank_zero():  # one run per directory: refuse a live run's before Hydra rewrites its .hydra/
        from moe.train.run_lock import check_free

        check_free(run_dir, lock_wait_s)
    resume_from = None
    if resume:  # rank zero verifies (one reader of a 90 GB file); the others go by the newest's name
        ckpt_dir = run_dir / "checkpoints"
        resume_from = (find_resume_checkpoint(ckpt_dir, quiet=True) if is_rank_zero()
                       else newest_checkpoint(ckpt_dir))
    try:
        check_relaunch(run_dir, config, data, max_steps, resume_from)
    except NothingToTrain as done:
        return 0, f"note: {done}"
    return None


def check_writable(run_dir: Path) -> None:
    """A run dir that cannot be created: refused before Hydra tries."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not existing.is_dir() else "cannot be written by this user"
        raise UserError("hydra.run.dir", str(run_dir),
                        "pick a writable place: hydra.run.dir=DIR (or run_name=NAME under runs/)",
                        problem=f"cannot be created: {existing} {what}")
