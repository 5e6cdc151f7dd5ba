"""The one place that picks a checkpoint: to resume from, to generate or export from, to consolidate.

`find_resume_checkpoint` takes the newest checkpoint of a run that verifies, in any format
(moe.checkpoint.formats), and says on stderr why it passed over any other (which config may resume it is
the resume contract's: moe.train.launches). `resolve_checkpoint` turns what a user typed
(`last`, a run dir, a file, a directory) into one checkpoint, and `read_checkpoint` reads it whole,
verified first. train.py's resume, infer.py, its export and `python -m moe.tools.consolidate` go
through these, so every format is detected, verified and read the same way everywhere.
"""
from __future__ import annotations

import sys
from pathlib import Path

from moe.checkpoint.formats import FORMATS, PORTABLE, candidates, format_at, format_of, recency, step_hint
from moe.checkpoint.io import CorruptCheckpoint, check_zip_crc, meta_path
from moe.errors import UserError
from moe.ranks import is_rank_zero

LAST = "last.ckpt"


def verify_checkpoint(path: str | Path, deep: bool = False) -> int | None:
    """The checkpoint's global_step if it can be trusted; raises CorruptCheckpoint saying why not."""
    path = Path(path)
    found = format_of(path)
    if found is None:
        if path.is_dir():
            raise CorruptCheckpoint("is a directory but no checkpoint format this repository reads")
        return PORTABLE.verify(path, deep)  # missing or unreadable: it says so
    return found.verify(path, deep)


def resolved_name(path: Path) -> str:
    """` (-> step-000300.ckpt)` for a link such as last.ckpt, else nothing: says which step a name means."""
    return f" (-> {Path(path).resolve().name})" if Path(path).is_symlink() else ""


def find_resume_checkpoint(ckpt_dir: str | Path, step: int | None = None, quiet: bool = False) -> Path | None:
    """The newest checkpoint in `ckpt_dir` that verifies (at `step` if given), or None when there is none.

    Corrupt or truncated ones are reported on stderr and passed over for the previous one.
    Raises UserError when checkpoints exist but none of them can be loaded.
    """
    ckpt_dir = Path(ckpt_dir)
    bad: list[str] = []

    def check(path: Path) -> int | None:
        try:
            found = verify_checkpoint(path)
            return 0 if found is None else found  # a DeepSpeed directory without a step in its name
        except CorruptCheckpoint as err:
            bad.append(f"{path.name} {err}")
            if not quiet and is_rank_zero():
                print(f"warning: checkpoint {path} {err}; falling back to the previous checkpoint",
                      file=sys.stderr, flush=True)
            return -1

    steps, verified = {}, set()
    for path in candidates(ckpt_dir):
        steps[path] = step_hint(path)
        if steps[path] == sys.maxsize:  # no sidecar and no step in the name: load it to learn the step
            steps[path] = check(path)
            verified.add(path)
    ranked = sorted(steps, key=lambda p: recency(p, steps[p]), reverse=True)
    for path in ranked:
        if steps[path] < 0 or (step is not None and steps[path] != step):
            continue
        if path in verified or check(path) == steps[path]:
            return path
    if bad or step is not None:
        at = "" if step is None else f" at step {step}"
        raise UserError(
            "resume", True,
            f"delete the bad files in {ckpt_dir} to start from scratch, set resume=false, or use another "
            "run_name",
            problem=f"found no loadable checkpoint{at} in {ckpt_dir}: " + ("; ".join(bad) or "none there"),
        )
    return None


def newest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run's checkpoints/ folder, in any format (what reads it
    verifies it)."""
    found = filter(None, (f.newest(Path(checkpoints_dir)) for f in FORMATS))
    return max(found, key=recency, default=None)


# -- what a user names: infer.py's ckpt=, consolidate's SRC ----------------------------------------
def resolve_checkpoint(ckpt: str, runs_dir: str | Path = "runs") -> Path:
    """`last` -> the newest run's newest checkpoint; a run dir -> its newest; a checkpoint -> itself."""
    if ckpt == "last":
        found = list(filter(None, (newest_checkpoint(d) for d in Path(runs_dir).glob("*/checkpoints"))))
        found = sorted(found, key=lambda p: p.stat().st_mtime)
        if not found:
            raise UserError("ckpt", ckpt, "train first (python train.py) or pass ckpt=PATH; ckpt=last looks "
                            f"in runs_dir={runs_dir!r}", problem=f"found no {runs_dir}/*/checkpoints/{LAST}")
        picked = found[-1]
        print(f"ckpt=last: {picked}{resolved_name(picked)} (the newest of {len(found)} run(s) in "
              f"{runs_dir}/; pass ckpt=PATH for another)", file=sys.stderr)
        return picked
    path = Path(ckpt).expanduser()
    if path.is_dir() and format_of(path) is not None:
        return path  # a checkpoint directory
    if path.is_dir():
        for checkpoints in (path / "checkpoints", path):
            newest = newest_checkpoint(checkpoints) if checkpoints.is_dir() else None
            if newest is not None:
                return newest
        raise UserError("ckpt", ckpt, "pass a .ckpt file, a run dir holding checkpoints/, or ckpt=last",
                        problem="is a directory without a complete checkpoint")
    if not path.is_file():
        raise UserError("ckpt", ckpt, "pass an existing .ckpt file, a run dir (runs/<run_name>) or ckpt=last",
                        problem="does not exist")
    return path


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at `path` (any format) whole, verified first where train.py left a record (the
    sha256 sidecar, a directory's completion marks and manifests), else by the CRC-32s inside the file:
    a corrupt checkpoint is refused with one paragraph."""
    path = Path(path)
    found = format_of(path)
    try:
        if found is not None and (path.is_dir() or meta_path(path).exists()):
            found.verify(path, deep=True)  # every byte is read next anyway
        elif found is PORTABLE:  # no sidecar (a copied file, an exported one)
            check_zip_crc(path)
    except CorruptCheckpoint as err:
        raise UserError("ckpt", str(path), "use another checkpoint of the run (checkpoints/step-*.ckpt) "
                        "or the run dir, whose newest good checkpoint train.py resumes from",
                        problem=str(err)) from err
    if found is None:
        raise UserError("ckpt", str(path), "pass a checkpoint written by train.py",
                        problem="is not a checkpoint")
    try:
        return found.read(path)
    except (RuntimeError, OSError, EOFError) as err:
        raise UserError("ckpt", str(path), "pass a checkpoint written by train.py (torch.save format)",
                        problem=f"could not be read ({str(err).splitlines()[0][:200]})") from err


# -- resuming ---------------------------------------------------------------------------------------
def lightning_part(ckpt_path: str | Path) -> Path:
    """The file holding hyper-parameters and step: the checkpoint itself, or the file inside its directory
    its format names (Format.lightning_file)."""
    return format_at(Path(ckpt_path)).lightning_file(Path(ckpt_path))
