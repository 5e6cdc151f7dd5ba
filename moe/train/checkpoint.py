"""Checkpoints that survive a kill at any moment, and the one place that picks what to resume from.

Saving: `torch.save` streams into `<name>.tmp` in the same directory, is flushed and fsynced,
then `os.replace`d over `<name>`; a sidecar `<name>.meta.json` (sha256, size, global_step) is
removed before the replace and written after it. So a kill leaves either the old file, or the
new file with or without its sidecar, never half a file under a checkpoint's name. A save that
fails (disk full, a directory that cannot be written) removes its temporary file and stops the
run with one paragraph. `last.ckpt` is a symbolic link to the newest step's file, replaced
atomically (StepCheckpoint._link_checkpoint), not a second full copy.

Resuming: `find_resume_checkpoint` takes the newest checkpoint that verifies (sidecar hash; where
the sidecar is missing, the CRC-32 that torch.save writes for every record of its zip file, then
a full load) and says on stderr why it passed over any other.
`check_resume_compatible` refuses a checkpoint whose model shapes differ from the config.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from moe.errors import UserError

TMP_SUFFIX = ".tmp"
META_SUFFIX = ".meta.json"
# Test hook, never set in real runs: "<step>" or "<step>:<file name>" makes the save of that
# step's checkpoint write half of its temporary file, fsync it and SIGKILL its own process,
# once per run dir (a marker file next to the checkpoints remembers it fired).
KILL_DURING_SAVE_ENV = "MOE_TEST_KILL_DURING_SAVE"
_STEP_IN_NAME = re.compile(r"step[-=_]?(\d+)")


class CorruptCheckpoint(Exception):
    """A checkpoint file that cannot be trusted: truncated, altered, or not a checkpoint."""


class _HashingWriter:
    """File wrapper that hashes what torch.save streams through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

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


def _remove(path: Path) -> None:
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
    _maybe_kill_during_save(obj, path, tmp, step)
    meta = meta_path(path)
    meta_tmp = meta.with_name(meta.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        record = {"sha256": writer.sha.hexdigest(), "bytes": writer.size, "global_step": step}
        _remove(meta)  # a stale sidecar must never vouch for the new file
        os.replace(tmp, path)
        with open(meta_tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, meta)
    except OSError as err:  # ENOSPC, EDQUOT, EACCES, EROFS...: leave nothing that fills the disk further
        _remove(tmp)
        _remove(meta_tmp)
        raise unwritable(path, err) from err
    fsync_dir(path.parent)
    return record


def resolved_name(path: Path) -> str:
    """` (-> step-000300.ckpt)` for a link such as last.ckpt, else nothing: says which step a name means."""
    return f" (-> {Path(path).resolve().name})" if Path(path).is_symlink() else ""


def unwritable(path: Path, err: OSError) -> UserError:
    """A save the filesystem refused, as one paragraph: the previous checkpoints are intact."""
    return UserError("checkpoint", str(path),
                     f"free space or fix permissions under {path.parent} (df -h; ls -ld), or move the run "
                     "with hydra.run.dir=..., then relaunch the same command: it resumes from the newest "
                     "good checkpoint",
                     problem=f"could not be written ({getattr(err, 'strerror', None) or err}); its "
                             "temporary file was removed")


def _maybe_kill_during_save(obj: Any, path: Path, tmp: Path, step: int | None) -> None:
    spec = os.environ.get(KILL_DURING_SAVE_ENV)
    if not spec or step is None:
        return
    want_step, _, want_name = spec.partition(":")
    marker = path.with_name(f".{KILL_DURING_SAVE_ENV}-{step}")
    if int(want_step) != step or (want_name and want_name != path.name) or marker.exists():
        return
    marker.touch()
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    with open(tmp, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
    print(f"{KILL_DURING_SAVE_ENV}: killing this process half-way through writing {tmp}", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: temp file, fsync, rename, sha256 sidecar; removes sidecars with files."""

    def __init__(self) -> None:
        super().__init__()
        self._cleaned: set[Path] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        if path.parent not in self._cleaned:  # temp files of saves killed in an earlier launch
            for stale in path.parent.glob(f"*{TMP_SUFFIX}"):
                _remove(stale)
            self._cleaned.add(path.parent)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        """A file as Lightning loads it; a sharded directory whole (a resume where this rank holds
        every expert: one process, or ep=1)."""
        from moe.train.sharded_checkpoint import is_sharded_checkpoint, read_full_checkpoint

        if is_sharded_checkpoint(path):
            return read_full_checkpoint(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        _remove(meta_path(path))


def with_atomic_io(plugins: list, strategy: Any = None) -> list:
    """`plugins` plus an AtomicCheckpointIO, unless the strategy or plugins bring their own CheckpointIO."""
    plugins = list(plugins or [])
    if any(isinstance(p, CheckpointIO) for p in plugins) or getattr(strategy, "_checkpoint_io", None):
        return plugins
    return [*plugins, AtomicCheckpointIO()]


# -- verifying and picking ------------------------------------------------------------------
def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def verify_checkpoint(path: str | Path, deep: bool = False) -> int | None:
    """The checkpoint's global_step if it can be trusted; raises CorruptCheckpoint saying why not.
    A sharded directory's files are checked by size, and with `deep` by sha256 too."""
    from moe.train.sharded_checkpoint import DCP_METADATA, TRAINER_STATE, check_manifests

    path = Path(path)
    if path.is_dir() and (path / TRAINER_STATE).exists():  # sharded (DCP): renamed into place when complete
        if not (path / DCP_METADATA).is_file():
            raise CorruptCheckpoint(f"has no {DCP_METADATA} (not written by torch.distributed.checkpoint)")
        check_manifests(path.resolve(), deep)
        return verify_checkpoint(path / TRAINER_STATE)
    if path.is_dir():  # neuronx-distributed's: complete once every rank has written it
        from moe.backends.neuron.files import USER_CONTENT, is_complete

        if not is_complete(path):
            raise CorruptCheckpoint("was not finished by every rank (no `done` file: the run stopped while "
                                    "saving it)")
        return int(_load(path / USER_CONTENT)["global_step"])
    try:
        stat = path.stat()
    except OSError:
        return _verify_file(path)  # missing or unreadable: it says so
    # train.py verifies the newest checkpoint in its preflight and again in train(), one process: a
    # file unchanged since (same inode, size and mtime) is not hashed twice
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED:
        _VERIFIED[key] = _verify_file(path)
    return _VERIFIED[key]


_VERIFIED: dict[tuple, int | None] = {}  # checkpoint files that verified in this process -> global_step


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def _verify_file(path: Path) -> int | None:
    """A checkpoint file's step: its sidecar's size and sha256, else the zip CRC-32s and a full load."""
    meta = meta_path(path)
    if meta.exists():
        try:
            record = json.loads(meta.read_text())
        except (OSError, ValueError):
            record = None
        if record is not None:
            size = path.stat().st_size
            if size != record["bytes"]:
                raise CorruptCheckpoint(f"is {size} bytes but was written as {record['bytes']} (truncated)")
            if file_sha256(path) != record["sha256"]:
                raise CorruptCheckpoint("does not match the sha256 recorded when it was written (corrupt)")
            return record["global_step"]
    check_zip_crc(path)
    try:
        ckpt = _load(path)
    except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError... for bad files
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorruptCheckpoint(f"cannot be read ({first[:160]})") from err
    if not isinstance(ckpt, dict) or "global_step" not in ckpt or not ({"state_dict", "loops"} & set(ckpt)):
        raise CorruptCheckpoint("is not a Lightning checkpoint (no state_dict/global_step)")
    return int(ckpt["global_step"])


def check_zip_crc(path: Path) -> None:
    """The checksum inside the file: torch.save writes a zip whose every record carries a CRC-32, which
    torch.load does not check (a flipped byte in a tensor loads silently); zipfile does."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile:
        return  # not a zip (a legacy torch.save, or garbage): the full load below decides
    except (OSError, EOFError, ValueError) as err:
        raise CorruptCheckpoint(f"cannot be read ({err})") from err
    if bad is not None:
        raise CorruptCheckpoint(f"fails the CRC-32 of its record {bad} (corrupt)")


def _candidates(ckpt_dir: Path) -> list[Path]:
    """Checkpoints in `ckpt_dir`; a link (last.ckpt) is left out when its target is among them."""
    if not ckpt_dir.is_dir():
        return []
    found = sorted(p for p in ckpt_dir.iterdir() if p.name.endswith(".ckpt"))
    targets = {p.resolve() for p in found if not p.is_symlink()}
    return [p for p in found if not (p.is_symlink() and p.resolve() in targets)]


def step_hint(path: Path) -> int:
    """Order without loading: sidecar step, else the step in the name; last.ckpt first on ties."""
    try:
        step = json.loads(meta_path(path).read_text())["global_step"]
        if step is not None:
            return int(step)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    match = _STEP_IN_NAME.search(path.name)
    return int(match.group(1)) if match else sys.maxsize  # unknown step: try it first, verify tells


def is_rank_zero() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def find_resume_checkpoint(ckpt_dir: str | Path, step: int | None = None, quiet: bool = False) -> Path | None:
    """The newest checkpoint in `ckpt_dir` that verifies (at `step` if given), or None when there is none.

    Corrupt or truncated files are reported on stderr and passed over for the previous one.
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
    for path in _candidates(ckpt_dir):
        steps[path] = step_hint(path)
        if steps[path] == sys.maxsize:  # no sidecar and no step in the name: load it to learn the step
            steps[path] = check(path)
            verified.add(path)
    ranked = sorted(steps, key=lambda p: (steps[p], p.name.startswith("last")), reverse=True)
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


# -- compatibility ---------------------------------------------------------------------------
def lightning_part(ckpt_path: str | Path) -> Path:
    """The file holding hyper-parameters and step: the checkpoint itself, or inside its directory
    (trainer_state.pt of a sharded one, user_content.pt of a neuronx-distributed one)."""
    from moe.backends.neuron.files import USER_CONTENT
    from moe.train.sharded_checkpoint import TRAINER_STATE

    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_dir():
        return ckpt_path
    return ckpt_path / (TRAINER_STATE if (ckpt_path / TRAINER_STATE).exists() else USER_CONTENT)



def _shapes(model_cfg, moe_opt) -> dict[str, tuple]:
    from moe.model import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(model_cfg, moe_opt)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_resume_compatible(ckpt_path: str | Path, cfg) -> None:
    """Raise UserError naming the field, both values and the fix when the model shapes changed."""
    from omegaconf import OmegaConf

    saved = (_load(lightning_part(ckpt_path)).get("hyper_parameters") or {}).get("cfg")
    if not saved or "model" not in saved:
        return
    saved = OmegaConf.create(saved)
    old, new = _shapes(saved.model, saved.moe_opt), _shapes(cfg.model, cfg.moe_opt)
    if old == new:
        return
    changed = [k for k in OmegaConf.to_container(cfg.model)
               if k in saved.model and saved.model[k] != cfg.model[k]]
    key = next((k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)), "?")
    tensor = f"tensor {key}: checkpoint {old.get(key, 'absent')}, config {new.get(key, 'absent')}"
    fix = (f"train with the checkpoint's settings, or start a new run: resume=false (overwrites "
           f"{ckpt_path.parent}) or another run_name")
    if changed:
        field = changed[0]
        raise UserError(f"model.{field}", cfg.model[field], fix,
                        problem=f"differs from the checkpoint being resumed ({ckpt_path}, model.{field}="
                                f"{saved.model[field]!r}; {tensor})")
    raise UserError("model", cfg.model.name, fix,
                    problem=f"does not match the checkpoint being resumed ({ckpt_path}; {tensor})")


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, saving only at optimizer-step boundaries, and the final step too.

    Two Lightning 2.6 behaviours break an exact resume with gradient accumulation:
    - `_last_global_step_saved` is not restored, so a run resumed at step N (N a multiple of
      every_n_train_steps) saves step N again after its first micro-batch, mid-accumulation: that
      checkpoint drops the accumulated gradient, and resuming from it replays a different step.
      Here a batch end that did not complete an optimizer step never saves.
    - With a monitor set, the save of an epoch's last batch waits for a validation pass that, with
      `check_val_every_n_epoch=None`, may never come: a finished run's last.ckpt would stop short
      of max_steps. Here the run's end saves whatever step was not saved yet.
    """

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._step_seen = trainer.global_step

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        """Point `last.ckpt` at the newest step atomically: a new link renamed over the old one.
        Lightning's own (model_checkpoint.py:610-622) removes the old link first, and a kill between
        the two would leave no last.ckpt."""
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link = Path(linkpath)
            if link.is_dir() and not link.is_symlink():  # a sharded last.ckpt saved as a directory
                import shutil

                shutil.rmtree(link)
            _remove(link.with_name(link.name + META_SUFFIX))  # a full copy's sidecar (older runs)
            tmp = link.with_name(link.name + ".link" + TMP_SUFFIX)
            _remove(tmp)
            os.symlink(os.path.relpath(filepath, link.parent), tmp)
            os.replace(tmp, link)
            fsync_dir(link.parent)
        trainer.strategy.barrier()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == getattr(self, "_step_seen", None):
            return  # accumulating micro-batches: no optimizer step ended here
        self._step_seen = trainer.global_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        done = self._last_global_step_saved == trainer.global_step
        if not done and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)
