"""Which tasks an evaluation runs: lm_eval task yaml from the bundled directory (moe/eval/bundled) and the
user's task_dirs, with their data on local disk. Nothing is fetched: a task lm_eval knows only by its hub name
(hellaswag, arc_easy, mmlu, ...) or whose dataset_path names a hub dataset is refused with the fix (a local
copy: docs/EVALUATION.md).

A relative path in a task yaml (dataset_kwargs.data_files, data_dir, a dataset_path that is a directory) is
read beside the yaml, not in the working directory, so a task directory works from anywhere.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from moe.config.choices import BUNDLED_EVAL_TASKS as BUNDLED_TASKS
from moe.errors import UserError

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
# datasets' builders that read local files (data_files); any other dataset_path must be a local directory
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
LOCAL_COPY_FIX = ("copy the task's yaml from lm_eval/tasks/<name>/ into a directory, save its data there "
                  "as jsonl (on a machine with network: "
                  "datasets.load_dataset(...)[split].to_json(FILE)), set `dataset_path: json` and "
                  "`dataset_kwargs: {data_files: {test: FILE}}` in the yaml, and pass task_dirs=[DIR] "
                  "(docs/EVALUATION.md)")


def stay_offline() -> None:
    """Nothing an evaluation runs may reach the network (datasets and huggingface_hub read these when
    imported; lm_eval imports them after this)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"


def _found(path: Path) -> bool:
    """`path` exists, or names files as a glob pattern (data_files may: `test-*.jsonl`)."""
    if path.exists():
        return True
    anchor = Path(path.anchor or ".")
    try:
        return any(anchor.glob(str(path.relative_to(anchor)))) if glob.has_magic(str(path)) else False
    except (ValueError, NotImplementedError):  # a pattern pathlib cannot take
        return False


def _local(value, base: Path):
    """A relative path (or a list / dict of them) made absolute against `base`, when it is found there."""
    if isinstance(value, str):
        path = Path(value).expanduser()
        return str(base / path) if not path.is_absolute() and _found(base / path) else str(path)
    if isinstance(value, list):
        return [_local(v, base) for v in value]
    if isinstance(value, dict):
        return {k: _local(v, base) for k, v in value.items()}
    return value


def _paths(value) -> list[str]:
    """The path strings of a data_files value (a path, a list, a split -> path(s) dict)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [p for v in value for p in _paths(v)]
    if isinstance(value, dict):
        return [p for v in value.values() for p in _paths(v)]
    return []


def local_config(task: dict, yaml_path: Path | None) -> dict:
    """A task's config (lm_eval's) with its relative paths read beside its yaml; a hub dataset refused."""
    name = task.get("task", "?")
    base = Path(yaml_path).parent if yaml_path else Path.cwd()
    kwargs = dict(task.get("dataset_kwargs") or {})
    for key in ("data_files", "data_dir"):
        if key in kwargs:
            kwargs[key] = _local(kwargs[key], base)
    if kwargs:
        task["dataset_kwargs"] = kwargs
    missing = [p for p in _paths(kwargs.get("data_files")) if not _found(Path(p))]
    if missing:
        raise UserError("tasks", name, f"put the file beside {yaml_path or 'the task yaml'} (a relative path "
                        "is read there) or give its absolute path in data_files",
                        problem=f"names data_files that do not exist: {', '.join(missing[:3])}")
    path = task.get("dataset_path")
    if isinstance(path, str) and path not in FILE_BUILDERS:
        task["dataset_path"] = path = _local(path, base)
        if not Path(path).expanduser().exists():
            raise UserError("tasks", name, LOCAL_COPY_FIX,
                            problem=f"reads dataset_path={path!r} from the Hugging Face hub (no such local "
                            "directory beside its yaml); evaluation fetches nothing")
    if path in FILE_BUILDERS and not kwargs.get("data_files") and not kwargs.get("data_dir"):
        raise UserError("tasks", name, "name the local files in the task yaml: dataset_kwargs: {data_files: "
                        "{test: FILE.jsonl}} (docs/EVALUATION.md)",
                        problem=f"has dataset_path={path!r} and no data_files to read")
    return task


def task_manager(task_dirs: list[str]):
    """lm_eval's TaskManager over the bundled tasks and `task_dirs` only (not lm_eval's own, which read
    the hub), building each task from a local_config."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._factory import TaskFactory

    class LocalFactory(TaskFactory):
        # private: lm_eval 0.4.13 builds every task's config here (lm_eval/tasks/_factory.py:255), the one
        # place a yaml's path and its config meet
        def _load_full_config(self, entry, overrides=None):
            return local_config(super()._load_full_config(entry, overrides), entry.yaml_path)

    dirs = [BUNDLED_DIR]
    for d in task_dirs:
        path = Path(d).expanduser()
        if not path.is_dir():
            raise UserError("task_dirs", d, "pass directories holding lm_eval task yaml (and their data)",
                            problem="is not a directory")
        dirs.append(path.resolve())
    manager = TaskManager(include_path=[str(d) for d in dirs], include_defaults=False)
    manager._factory = LocalFactory()  # private: see LocalFactory
    return manager


def check_names(manager, tasks: list[str], task_dirs: list[str]) -> None:
    """Every name is a task, group or tag of the bundled directory or task_dirs; else the fix."""
    if not tasks:
        raise UserError("tasks", tasks, f"name at least one task, e.g. tasks=[{','.join(BUNDLED_TASKS)}]",
                        problem="is empty")
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            where = f"the bundled tasks ({', '.join(BUNDLED_TASKS)})" + \
                (f" or task_dirs={task_dirs}" if task_dirs else "")
            raise UserError("tasks", name, LOCAL_COPY_FIX,
                            problem=f"is not a task in {where}; lm_eval's own tasks read their data from the "
                            "Hugging Face hub, and evaluation fetches nothing")
