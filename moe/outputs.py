"""Directories the product writes, and the one rule for replacing them: `overwrite=true` only ever replaces
what this product wrote, and no output may overlap what the command reads.

Each command that publishes a directory (data_prep's prepared data, infer.py's Hugging Face export) writes
a marker file into it (`.moe-output.json`, naming its kind). Before any work starts, `check_output` refuses,
with one paragraph naming both paths:
- an output that equals, contains or lies inside a path the command reads (its input files, a checkpoint,
  a tokenizer, a Hugging Face directory) or a run directory;
- an existing, non-empty output without overwrite=true;
- with overwrite=true, an output this product did not write as that kind (no marker): the user's own
  directory is never renamed or removed.
Prepared-data directories written before the marker existed are recognised by their meta.json.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from moe.errors import UserError, write_failed
from moe.faults import maybe_pause_before_rename

MARKER = ".moe-output.json"
PREPARED_DATA, HF_EXPORT = "prepared data", "Hugging Face export"


@contextlib.contextmanager
def atomic_path(path: str | Path, cleaned: str = "nothing was left under its name") -> Iterator[Path]:
    """Write a file under a temporary name beside `path` (`.<name>.<pid>.tmp`), renamed over it when the block
    ends: a reader never sees half a file. A write the disk refuses removes the temporary file and raises one
    paragraph (moe.errors.write_failed) saying `cleaned`: what is, or is not, left of the file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        maybe_pause_before_rename(tmp, path)
        os.replace(tmp, path)
    except OSError as err:
        raise write_failed(path, err, cleaned=cleaned) from err
    finally:
        tmp.unlink(missing_ok=True)


def mark(directory: Path, kind: str) -> None:
    """Say in `directory` (before it is published) that this product wrote it, as `kind`."""
    (Path(directory) / MARKER).write_text(json.dumps({"written_by": "moe", "kind": kind}) + "\n")


def written_kind(directory: Path) -> str | None:
    """What this product wrote `directory` as, or None (not ours, or not a directory)."""
    directory = Path(directory)
    try:
        return json.loads((directory / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        pass
    try:  # prepared data from before the marker: meta.json with data_prep's own keys
        meta = json.loads((directory / "meta.json").read_text())
        legacy = isinstance(meta, dict) and {"sources", "config", "splits"} <= set(meta)
        return PREPARED_DATA if legacy else None
    except (OSError, ValueError):
        return None


def publish(tmp: Path, out: Path, replace: bool = True) -> None:
    """Put the finished directory `tmp` at `out` by renames, so `out` is never half-written. replace=True (the
    user asked to overwrite): an existing `out` (check_output lets only this product's through) is renamed
    aside first and removed after. replace=False: one atomic rename, which the kernel refuses when another
    process published `out` meanwhile (two runs building one data cache): theirs stays whole and in place,
    and this raises a UserError (the caller removes `tmp`)."""
    maybe_pause_before_rename(tmp, out)
    if not replace or not out.exists():
        try:
            os.rename(tmp, out)  # onto nothing or an empty directory; never onto a published one
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise UserError("output", str(out), "use the copy the other process wrote, or pick a new path",
                            problem="was written by another process while this one worked") from err
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def is_run_dir(path: Path) -> bool:
    """A training run's directory (runs/<name>): Hydra's .hydra/ beside train.py's checkpoints/ or metrics.csv
    (names general enough on their own that a user's project directory may hold one)."""
    path = Path(path)
    trained = (path / "checkpoints").is_dir() or (path / "metrics.csv").is_file()
    return trained and (path / ".hydra").is_dir()


def overlap(out: Path, read: Path) -> str | None:
    """How `out` overlaps `read` ("is", "holds", "lies inside"), or None."""
    out, read = out.resolve(), read.resolve()
    if out == read:
        return "is"
    if out in read.parents:
        return "holds"
    if read in out.parents:
        return "lies inside"
    return None


def check_apart(field: str, out: str | Path, kind: str, reads: dict[str, str | Path | None],
                where: str = "a path") -> Path:
    """Refuse (UserError) an output that is, holds or lies inside a path the command reads (`reads`: field
    name -> path, None: unset), or lies in a training run directory; returns the output, absolute."""
    out = Path(out).expanduser().absolute()
    for read_field, read in reads.items():
        if read is None:
            continue
        read = Path(read).expanduser().absolute()
        relation = overlap(out, read)
        if relation:
            fix = (f"name another file for the {kind}: not {read_field}, nor a path inside it"
                   if where == "a file" else f"write the {kind} to {where} outside {read_field}")
            raise UserError(field, str(out), fix,
                            problem=f"{relation} {read_field}={read}, which this command reads: replacing "
                                    "it would destroy its own input")
    for parent in (out, *out.parents):
        if is_run_dir(parent):
            inside = "is" if parent == out else f"lies inside {parent}, which is"
            raise UserError(field, str(out), f"write the {kind} outside the run directory, e.g. next to it",
                            problem=f"{inside} a training run directory (checkpoints, metrics, config): "
                                    "nothing is written into a run")
    return out


def check_output(field: str, out: str | Path, kind: str, overwrite: bool,
                 reads: dict[str, str | Path | None], ours: Callable[[Path], bool] | None = None,
                 flag: str = "overwrite=true") -> Path:
    """Refuse (UserError, before any work) an output that would destroy what is read or owned by the user;
    returns the output as an absolute path. `reads`: field name -> a path this command reads (None: unset);
    `ours`: whether an existing output is one this product wrote as `kind` (default: its marker says so);
    `flag`: how the command spells overwrite."""
    out = check_apart(field, out, kind, reads, where="a directory")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return out
    ours = (ours or (lambda path: path.is_dir() and written_kind(path) == kind))(out)
    if not overwrite:
        fix = (f"pick a new path, or pass {flag} to replace this {kind}" if ours
               else f"pick a new path (not a {kind} this product wrote: {flag} will not replace it)")
        raise UserError(field, str(out), fix, problem="already exists")
    if not ours:
        what = f"a directory without {MARKER}" if out.is_dir() else "a file"
        raise UserError(field, str(out), "pick a new path, or move or delete it yourself if it is yours to "
                        "lose", problem=f"is {what}: {flag} replaces only a {kind} this product wrote, and "
                        "nothing of it was removed")
    return out
