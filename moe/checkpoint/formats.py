"""The on-disk checkpoint formats, one class each: every checkpoint is written and read through one of them.

    detect(path)        is `path` a checkpoint of this format
    verify(path, deep)  its global_step (None where it records none) if it can be trusted, else
                        CorruptCheckpoint saying why; `deep` reads every byte (a sha256) where the
                        format records one
    read(path)          the whole checkpoint as one Lightning-style dict (`state_dict` of full tensors,
                        `hyper_parameters`, `global_step`) on one process: for infer.py, export,
                        consolidation and a resume that holds every expert
    newest(dir)         the newest complete checkpoint of this format in a run's checkpoints/ folder
                        (by the step its sidecar or name gives; cheap: no checksum is computed, what
                        reads it verifies it)
    save(live, ckpt, path)  collective, in a training run: every rank writes its part (atomic: a torn save
                        is never taken for a checkpoint)
    load(live, path)    collective: Lightning's checkpoint dict; a format the run writes itself fills the
                        live tensors in place and returns an empty `state_dict` (`in_place`)
    remove(path)        delete it with everything beside it (sidecar, ZeRO partitions)
    lightning_file(path)  the file holding its hyper-parameters and step

Each backend declares the format it writes (moe.config.specs.BackendSpec.checkpoint_formats, by `key`);
its Lightning strategy saves and loads through it (moe.backends.checkpoints.FormatCheckpoints).

    Portable   a torch.save file `step-N.ckpt` with a `.meta.json` sidecar (moe.checkpoint.io): one
               process, DDP without EP, DeepSpeed without EP (its ZeRO partitions in `<file>.zero/`)
    Sharded    a torch.distributed.checkpoint directory, every tensor canonical (moe.checkpoint.sharded):
               DDP and DeepSpeed with EP, fsdp2
    DeepSpeed  DeepSpeed's own directory (`latest`, `<tag>/mp_rank_00_model_states.pt`, ZeRO
               partitions), as Lightning's DeepSpeedStrategy writes it (not this repository's)

A backend whose library writes a format of its own keeps that format in its package and registers it
here (`register`; moe.backends.checkpoint_formats registers every one, and each command that reads
checkpoints imports that module), so this layer reads every format without knowing any backend.
`FORMATS` lists them in the order `format_of` asks (directories first, the portable file last);
moe.checkpoint.picker uses them for every choice of a checkpoint.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe.checkpoint import sharded
from moe.checkpoint.io import (
    SIDECAR_FIELDS,
    TMP_SUFFIX,
    CorruptCheckpoint,
    atomic_torch_save,
    check_zip_crc,
    file_sha256,
    meta_path,
    read_record,
    remove,
)
from moe.checkpoint.trust import PickleRefused, check_weights_only, load_trusted
from moe.errors import first_line
from moe.model.expert_layout import recorded, upgraded_checkpoint
from moe.model.mlp import upgraded

_STEP_IN_NAME = re.compile(r"step[-=_]?(\d+)")


def load(path: Path) -> dict:
    return load_trusted(path, map_location="cpu", mmap=True)


def _current_names(checkpoint):
    """A checkpoint's weights under today's parameter names (moe.model.mlp.RENAMED) and in today's expert
    layout (moe.model.expert_layout)."""
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint["state_dict"] = upgraded(checkpoint["state_dict"])
    return upgraded_checkpoint(checkpoint)


def step_hint(path: Path) -> int:
    """Order without loading: sidecar step, else the step in the name (unknown: tried first)."""
    try:
        step = json.loads(meta_path(path).read_text())["global_step"]
        if step is not None:
            return int(step)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    match = _STEP_IN_NAME.search(path.name)
    return int(match.group(1)) if match else sys.maxsize


def recency(path: Path, step: int | None = None) -> tuple[int, bool]:
    """The one order of checkpoints, newest last: by step (`step`, once read, else step_hint), a `last*`
    link after the file it names at the same step (the picker, every format's `newest`)."""
    return step_hint(path) if step is None else step, path.name.startswith("last")


def candidates(checkpoints_dir: Path) -> list[Path]:
    """Checkpoints in `checkpoints_dir`; a link (last.ckpt) is left out when its target is among them."""
    if not checkpoints_dir.is_dir():
        return []
    found = sorted(p for p in checkpoints_dir.iterdir() if p.name.endswith(".ckpt"))
    targets = {p.resolve() for p in found if not p.is_symlink()}
    return [p for p in found if not (p.is_symlink() and p.resolve() in targets)]


@dataclass
class Live:
    """This rank's side of a collective save or load in a training run (built by the strategy,
    moe.backends.checkpoints.FormatCheckpoints)."""

    module: Any  # the LightningModule
    optimizers: list  # the torch optimizers whose state the checkpoint holds ([]: the backend keeps its own)
    dims: Any  # moe.parallel.dims.ParallelDims: the checkpoint mesh of every rank
    device_type: str
    rank: int
    is_global_zero: bool
    barrier: Callable[[], None]
    writes: Format  # the format this run writes: one it loads in place
    per_rank: dict | None = None  # this rank's own state beside the checkpoint (DeepSpeed's ZeRO partition)

    def mesh(self):
        return self.dims.checkpoint_mesh(self.device_type)


def in_place(checkpoint: dict) -> bool:
    """Whether a loaded checkpoint's weights are already in the live tensors (its state_dict is empty)."""
    return not checkpoint["state_dict"]


def lightning_state(checkpoint: dict) -> dict:
    """What a checkpoint holds besides the weights and the optimizer states (loops, callbacks, step...)."""
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


class Format:
    """What every format shares: `newest` ranks this format's complete candidates by step."""

    name = ""  # for messages
    key = ""  # what a backend's spec names it by (BackendSpec.checkpoint_formats)
    # each tensor whole in it: a rank holding a slice (its experts) gathers the rest before a save
    whole_tensors = False

    def detect(self, path: Path) -> bool:
        raise NotImplementedError

    def complete(self, path: Path) -> bool:
        """Finished writing, by its own marks (cheap; `verify` checks the content)."""
        return self.detect(path)

    def verify(self, path: Path, deep: bool = False) -> int | None:
        raise NotImplementedError

    def read(self, path: Path) -> dict:
        raise NotImplementedError

    def newest(self, checkpoints_dir: Path) -> Path | None:
        mine = [p for p in candidates(Path(checkpoints_dir)) if self.detect(p) and self.complete(p)]
        return max(mine, key=recency, default=None)

    def save(self, live: Live, checkpoint: dict, path: Path) -> None:
        raise NotImplementedError(f"this repository reads a {self.name} but does not write one")

    def load(self, live: Live, path: Path) -> dict:
        """Read whole on every rank; the strategy puts it into its layout (moe.backends.checkpoints)."""
        return self.read(path)

    def partition_file(self, path: Path, rank: int) -> Path:
        """Where `rank`'s own state lies in it (Live.per_rank: DeepSpeed's ZeRO partition)."""
        raise NotImplementedError(f"a {self.name} holds no per-rank state of this repository")

    def lightning_file(self, path: Path) -> Path:
        """The file holding Lightning's part of it (hyper-parameters, step): a file checkpoint itself."""
        return Path(path)

    def remove(self, path: Path) -> None:
        """Delete it and its sidecar; a link (last.ckpt) only the link."""
        path = Path(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            remove(path)
        remove(meta_path(path))


ZERO_PARTITIONS_SUFFIX = ".zero"


def zero_partitions_dir(path: Path) -> Path:
    """`<file>.zero/` beside a portable checkpoint: DeepSpeed's per-rank ZeRO optimizer partitions
    (`rank_NNNNN.pt`, each written atomically with its sidecar); last.ckpt, a link, shares its target's."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    return path.with_name(path.name + ZERO_PARTITIONS_SUFFIX)


def zero_partition_file(path: Path, rank: int) -> Path:
    """A rank's ZeRO partition of the portable checkpoint `path`."""
    return zero_partitions_dir(path) / f"rank_{rank:05d}.pt"


class Portable(Format):
    """One file, as Lightning's checkpoint dict; `last.ckpt` is a link to the newest one. DeepSpeed without EP
    adds its ranks' ZeRO partitions in `<file>.zero/` (zero_partitions_dir), which verify checks too."""

    name = "portable file"
    key = "portable"
    whole_tensors = True

    def __init__(self) -> None:
        self._cleaned: set[Path] = set()  # folders whose stale temporary files are gone

    def detect(self, path: Path) -> bool:
        return Path(path).is_file()

    def write(self, checkpoint: dict, path: Path) -> None:
        """One process writes the file: temporary name, fsync, rename, sha256 sidecar (moe.checkpoint.io);
        the expert layout recorded."""
        atomic_torch_save(recorded(checkpoint), path)

    def write_in_run(self, checkpoint: dict, path: Path) -> None:
        """`write` into a run's checkpoints/ folder, the first time removing there the temporary files of
        saves killed in an earlier launch."""
        path = Path(path)
        if path.parent not in self._cleaned:
            for stale in path.parent.glob(f"*{TMP_SUFFIX}"):
                remove(stale)
            self._cleaned.add(path.parent)
        self.write(checkpoint, path)

    def save(self, live: Live, checkpoint: dict, path: Path) -> None:
        """Every rank's ZeRO partition (live.per_rank) first, then rank 0's file, whose sidecar marks the
        whole checkpoint complete."""
        if live.per_rank is not None:
            atomic_torch_save(live.per_rank, self.partition_file(path, live.rank))
            live.barrier()
        if live.is_global_zero:
            self.write_in_run(checkpoint, path)
        live.barrier()

    def partition_file(self, path: Path, rank: int) -> Path:
        return zero_partition_file(path, rank)

    def remove(self, path: Path) -> None:
        """The file, its sidecar and its ZeRO partitions (a link: the link only)."""
        partitions = None if Path(path).is_symlink() else zero_partitions_dir(path)
        super().remove(path)
        if partitions is not None:
            shutil.rmtree(partitions, ignore_errors=True)

    def verify(self, path: Path, deep: bool = False) -> int | None:
        path = Path(path)
        try:
            stat = path.stat()
        except OSError:
            return self._verify(path)  # missing or unreadable: it says so
        # train.py verifies the newest checkpoint in its preflight and again in train(), one process: a
        # file unchanged since (same inode, size and mtime) is not hashed twice
        key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in _VERIFIED:
            _VERIFIED[key] = self._verify(path)
        return _VERIFIED[key]

    @staticmethod
    def _verify(path: Path) -> int | None:
        """The sidecar's size and sha256, else the zip CRC-32s and a full load."""
        if meta_path(path).exists():
            record = Portable._check_sidecar(path)
            Portable._verify_partitions(path)
            return record["global_step"]
        check_zip_crc(path)
        try:
            ckpt = load(path)
        except PickleRefused:  # not corrupt: foreign, and the user has not allowed its code to run
            raise
        except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError... for bad files
            first = first_line(err)
            raise CorruptCheckpoint(f"cannot be read ({first[:160]})") from err
        lightning = isinstance(ckpt, dict) and "global_step" in ckpt and {"state_dict", "loops"} & set(ckpt)
        if not lightning:
            raise CorruptCheckpoint("is not a Lightning checkpoint (no state_dict/global_step)")
        return int(ckpt["global_step"])

    @staticmethod
    def _check_sidecar(path: Path) -> dict:
        """The file's size and sha256 against its sidecar; returns the sidecar's record."""
        record = read_record(meta_path(path), SIDECAR_FIELDS)  # a damaged sidecar: refused like the file
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CorruptCheckpoint(f"is {size} bytes but was written as {record['bytes']} (truncated)")
        if file_sha256(path) != record["sha256"]:
            raise CorruptCheckpoint("does not match the sha256 recorded when it was written (corrupt)")
        return record

    @staticmethod
    def _verify_partitions(path: Path) -> None:
        """Each ZeRO partition beside the file against its sidecar (one an older version wrote, without a
        sidecar, by the CRC-32s inside it)."""
        for partition in sorted(zero_partitions_dir(path).glob("rank_*.pt")):
            try:
                if meta_path(partition).exists():
                    Portable._check_sidecar(partition)
                else:
                    check_zip_crc(partition)
            except CorruptCheckpoint as err:
                raise CorruptCheckpoint(f"has a ZeRO partition ({partition.name}) that {err}") from err

    def read(self, path: Path) -> dict:
        """weights_only (tensors and plain containers, no code runs): train.py's files allow it; another
        file only under allow_pickle=true (moe.checkpoint.trust)."""
        return _current_names(load(path))


_VERIFIED: dict[tuple, int | None] = {}  # checkpoint files that verified in this process -> global_step


class Sharded(Format):
    """A torch.distributed.checkpoint directory (moe.checkpoint.sharded): each rank wrote its pieces,
    renamed into place when every rank had; per-rank manifests hold each file's size and sha256."""

    name = "sharded directory"
    key = "sharded"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return path.is_dir() and (path / sharded.TRAINER_STATE).exists()

    def complete(self, path: Path) -> bool:
        return (Path(path) / sharded.DCP_METADATA).is_file()

    def verify(self, path: Path, deep: bool = False) -> int | None:
        path = Path(path)
        if not self.complete(path):
            raise CorruptCheckpoint(f"has no {sharded.DCP_METADATA} (not written by "
                                    "torch.distributed.checkpoint)")
        sharded.check_manifests(path.resolve(), deep)
        return PORTABLE.verify(path / sharded.TRAINER_STATE)

    def read(self, path: Path) -> dict:
        return sharded.read_full_checkpoint(path)

    def save(self, live: Live, checkpoint: dict, path: Path) -> None:
        state = recorded(lightning_state(checkpoint))  # the expert layout, in trainer_state.pt
        sharded.save_sharded(path, live.module, live.optimizers, live.mesh(), state, live.is_global_zero,
                             per_rank=live.per_rank)

    def load(self, live: Live, path: Path) -> dict:
        """A run that writes this format reads every rank's pieces into its live tensors, resharded to its
        layout; any other reads it whole."""
        if live.writes is not self:
            return self.read(path)
        return sharded.load_sharded(path, live.module, live.optimizers, live.mesh())

    def partition_file(self, path: Path, rank: int) -> Path:
        return sharded.rank_file(path, rank)

    def lightning_file(self, path: Path) -> Path:
        return Path(path) / sharded.TRAINER_STATE


class DeepSpeed(Format):
    """DeepSpeed's own directory, as Lightning's DeepSpeedStrategy saves it (`latest` names the tag
    directory holding `mp_rank_00_model_states.pt` and the ZeRO partitions); read through Lightning's
    consolidation (lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict)."""

    name = "DeepSpeed directory"
    key = "deepspeed_directory"  # read only: no backend writes it (BackendSpec.checkpoint_formats)
    MODEL_STATES = "mp_rank_00_model_states.pt"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return path.is_dir() and ((path / "latest").is_file() or (path / "checkpoint").is_dir()
                                  or any(path.glob(f"*/{self.MODEL_STATES}")))

    def complete(self, path: Path) -> bool:
        return any(Path(path).glob(f"**/{self.MODEL_STATES}"))

    def verify(self, path: Path, deep: bool = False) -> int | None:
        if not self.complete(path):
            raise CorruptCheckpoint(f"has no {self.MODEL_STATES} (DeepSpeed had not finished saving it)")
        return None  # DeepSpeed records the step inside its client state only

    def read(self, path: Path) -> dict:
        import tempfile

        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        check_weights_only(sorted(Path(path).glob("**/*.pt")))  # the converter unpickles them unrestricted
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "consolidated.ckpt"
            convert_zero_checkpoint_to_fp32_state_dict(str(path), str(out))
            return _current_names(load_trusted(out, map_location="cpu"))


PORTABLE, SHARDED, DEEPSPEED = Portable(), Sharded(), DeepSpeed()
FORMATS: list[Format] = [SHARDED, DEEPSPEED, PORTABLE]  # and each registered one, before PORTABLE
BY_KEY: dict[str, Format] = {f.key: f for f in FORMATS}


def register(found: Format) -> None:
    """A backend's own format, read and picked from now on like the formats above: asked before the portable
    file (a directory format). Registering the same one again changes nothing; another with a taken key
    is an error of the code."""
    if BY_KEY.get(found.key) is found:
        return
    if found.key in BY_KEY or not found.key:
        raise ValueError(f"checkpoint format key {found.key!r} is empty or taken by {BY_KEY.get(found.key)}")
    FORMATS.insert(FORMATS.index(PORTABLE), found)
    BY_KEY[found.key] = found


def format_of(path: Path) -> Format | None:
    """The format of `path`, or None when it is none of them."""
    return next((f for f in FORMATS if f.detect(Path(path))), None)


def format_at(path: Path) -> Format:
    """The format to read, load or remove `path` with: its own, else the portable file's (whose reading
    says what is wrong with a missing or foreign file)."""
    return format_of(path) or PORTABLE
