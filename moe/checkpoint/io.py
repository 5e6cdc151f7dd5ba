"""Files that survive a kill at any moment: temporary name, fsync, rename, and a checksum sidecar.

`atomic_torch_save` streams `torch.save` into `<name>.tmp` in the same directory, flushes and
fsyncs it, then `os.replace`s it over `<name>`; the sidecar `<name>.meta.json` (sha256, size,
global_step) is removed before the replace and written after it. A kill leaves the old file, or the
new one with or without its sidecar, never half a file under a checkpoint's name. A save the
filesystem refuses (disk full, a directory that cannot be written) removes its temporary file and
stops the run with one paragraph (`unwritable`).
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from moe.errors import UserError, write_failed
from moe.faults import maybe_kill_during_save, maybe_pause_before_rename
from moe.outputs import atomic_path

TMP_SUFFIX = ".tmp"
META_SUFFIX = ".meta.json"


class CorruptCheckpoint(Exception):
    """A checkpoint that cannot be trusted: truncated, altered, unfinished, or not a checkpoint."""


class _HashingWriter:
    """File wrapper that hashes what torch.save streams through it, and keeps the OSError a write raised
    (torch's zip writer turns it into `RuntimeError: ... unexpected pos`)."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (where the filesystem supports fsync on a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def meta_path(path: str | Path) -> Path:
    """The sidecar of a checkpoint file; `last.ckpt`, a link, shares its target's."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    return path.with_name(path.name + META_SUFFIX)


def atomic_torch_save(obj: Any, path: str | Path) -> dict:
    """torch.save `obj` to `path` atomically; returns the sidecar record written next to it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    step = obj.get("global_step") if isinstance(obj, dict) else None
    maybe_kill_during_save(obj, path, tmp, step)
    meta = meta_path(path)
    meta_tmp = meta.with_name(meta.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            try:
                torch.save(obj, writer)
            except RuntimeError as err:
                if writer.error is None:
                    raise
                raise writer.error from err  # the file system's refusal, not torch's position check
            f.flush()
            os.fsync(f.fileno())
        record = {"sha256": writer.sha.hexdigest(), "bytes": writer.size, "global_step": step}
        maybe_pause_before_rename(tmp, path)
        remove(meta)  # a stale sidecar must never vouch for the new file
        os.replace(tmp, path)
        with open(meta_tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, meta)
    except OSError as err:  # ENOSPC, EDQUOT, EFBIG, EACCES, EROFS: leave nothing that fills the disk further
        remove(tmp)
        remove(meta_tmp)
        raise unwritable(path, err) from err
    except BaseException:  # Ctrl-C (KeyboardInterrupt) mid-write: no half file left beside the checkpoint
        remove(tmp)
        remove(meta_tmp)
        raise
    fsync_dir(path.parent)
    return record


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary name, flush, rename: a reader never sees half a file."""
    with atomic_path(path, cleaned="its temporary file was removed") as tmp, tmp.open("w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def unwritable(path: Path, err: OSError) -> UserError:
    """A save the filesystem refused, as one paragraph: the previous checkpoints are intact."""
    return write_failed(path, err, field="checkpoint", cleaned="its temporary file was removed")


def read_record(path: Path, fields: dict[str, tuple[type, ...]]) -> dict:
    """A checksum record (a checkpoint's sidecar, a sharded directory's manifest entry): JSON with these
    fields of these types, else CorruptCheckpoint, so a damaged record is refused as its checkpoint would
    be (a resume warns and falls back), never trusted nor silently skipped."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(f"has an unreadable record {Path(path).name} ({err})") from err
    return check_record(record, fields, Path(path).name)


def check_record(record: Any, fields: dict[str, tuple[type, ...]], where: str) -> dict:
    if not isinstance(record, dict):
        raise CorruptCheckpoint(f"has a corrupt record {where} (not a JSON object)")
    bad = [name for name, types in fields.items()
           if name not in record or not isinstance(record[name], types) or isinstance(record[name], bool)]
    if bad:
        raise CorruptCheckpoint(f"has a corrupt record {where} (bad or missing {', '.join(bad)})")
    return record


SIDECAR_FIELDS = {"bytes": (int,), "sha256": (str,), "global_step": (int, type(None))}
FILE_FIELDS = {"bytes": (int,), "sha256": (str,)}  # a sharded directory's manifest entry


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def check_zip_crc(path: Path) -> None:
    """The checksum inside the file: torch.save writes a zip whose every record carries a CRC-32, which
    torch.load does not check (a flipped byte in a tensor loads silently); zipfile does."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile:
        return  # not a zip (a legacy torch.save, or garbage): a full load decides
    except (OSError, EOFError, ValueError) as err:
        raise CorruptCheckpoint(f"cannot be read ({err})") from err
    if bad is not None:
        raise CorruptCheckpoint(f"fails the CRC-32 of its record {bad} (corrupt)")
