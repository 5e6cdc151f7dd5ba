"""Where the repository is, and relative paths that work from any working directory."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def local_path(path: str | Path) -> Path:
    """`path`, or the same relative path under the repo root when it is missing from the working directory.

    Presets name bundled files relative to the repo (data/sample), and Hydra multirun jobs may run
    from elsewhere, so a path is tried where the user is first, then where the repository is.
    """
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute() or not (REPO_ROOT / p).exists():
        return p
    return REPO_ROOT / p
