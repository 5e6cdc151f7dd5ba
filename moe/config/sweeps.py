"""Make every `sweeps/<name>.yaml` selectable as `+sweep=<name>`, from any working directory.

Hydra looks a group up as `<search path>/sweep/<name>.yaml`; the repository keeps its sweeps
in a top-level `sweeps/` directory instead, so the files are registered in Hydra's
ConfigStore under the group `sweep` (package `_global_`, or the file's own `# @package`
header). A new file dropped into `sweeps/` is picked up on the next run: nothing to list.
"""
from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from moe.paths import REPO_ROOT

SWEEPS_DIR = REPO_ROOT / "sweeps"


def _package(path: Path) -> str:
    """The `# @package X` header of a sweep file; `_global_` when there is none."""
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            return line.split(maxsplit=2)[2].strip()
        if line.strip() and not line.startswith("#"):
            break
    return "_global_"


# Sweep files that do not load (a YAML slip, another encoding): name -> (path, error). Registering runs at
# import, for every train.py command: such a file is left out, and `+sweep=<name>` says why
# (moe.train.preflight.composition_error), instead of every command stopping on the file's traceback.
UNREADABLE: dict[str, tuple[Path, Exception]] = {}


def register_sweeps(sweeps_dir: Path | str = SWEEPS_DIR) -> list[str]:
    """Register each `sweeps_dir/*.yaml` as `sweep/<stem>`; returns the names registered (an unreadable file
    is left out and kept in UNREADABLE)."""
    import yaml

    names = []
    for path in sorted(Path(sweeps_dir).glob("*.yaml")):
        try:
            node, package = OmegaConf.load(path), _package(path)
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            UNREADABLE[path.stem] = (path, err)
            continue
        UNREADABLE.pop(path.stem, None)
        ConfigStore.instance().store(group="sweep", name=path.stem, node=node, package=package,
                                     provider="moe.sweeps")
        names.append(path.stem)
    return names
