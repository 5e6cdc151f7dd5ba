"""No code runs from a file the user did not opt into: every checkpoint loads weights-only.

Unpickling runs whatever code a file names. torch.load(weights_only=True) accepts tensors and plain
containers only, which is all this product writes (Lightning checkpoints, trainer_state.pt, the
DeepSpeed backend's partitions, what each registered format's directory holds). A file holding
anything else came from elsewhere; it is loaded only when the user says so with `allow_pickle=true`
(train.py, infer.py; `--allow-pickle` for the tools), once per process, and then with a warning.

torch.distributed.checkpoint reads a directory's `.metadata` with plain `pickle.load`
(torch/distributed/checkpoint/filesystem.py `read_metadata`), so `check_dcp_metadata` first reads
it with an unpickler that resolves only DCP's own metadata classes, torch sizes and dtypes (Python's
documented way of restricting globals, pickle "Restricting Globals").
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from moe.errors import UserError, first_line

_POLICY = {"allow_pickle": False}


def set_allow_pickle(allowed: bool) -> None:
    """The run's choice (config key `allow_pickle`), set once by each entry point."""
    _POLICY["allow_pickle"] = bool(allowed)


class PickleRefused(UserError):
    """A file that would run code to load, without allow_pickle=true."""

    def __init__(self, path: Path, what: str):
        super().__init__(
            "allow_pickle", False,
            "load only files you trust: pass allow_pickle=true (the tools: --allow-pickle) if you know "
            "where this file comes from, or re-save its tensors with torch.save(state_dict) / safetensors",
            problem=f"keeps {path} from loading: it holds objects beyond tensors and plain containers "
                    f"({what}), and unpickling it would run the code it names")


def _refused(err: Exception) -> str:
    """What the unpickler refused: torch's "Unsupported global: GLOBAL argparse.Namespace ..." line, else
    the error's first line."""
    refused = next((line.split("WeightsUnpickler error:")[-1].split(" was not an allowed")[0].strip()
                    for line in str(err).splitlines() if "WeightsUnpickler error:" in line), None)
    return refused[:200] if refused else first_line(err)


def _unpickle_allowed(path: Path, err: Exception) -> None:
    """Raise PickleRefused unless the user allowed pickles; warn once per file when allowed."""
    if not _POLICY["allow_pickle"]:
        raise PickleRefused(path, _refused(err))
    print(f"warning: allow_pickle=true: unpickling {path}, which holds objects beyond tensors "
          f"({_refused(err)}); its code runs now", file=sys.stderr)


def load_trusted(path: str | Path, **kwargs) -> Any:
    """torch.load, weights-only; a file that needs more loads only under allow_pickle=true."""
    path = Path(path)
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:  # weights_only's refusal of a global it does not allow
        _unpickle_allowed(path, err)
    return torch.load(path, weights_only=False, **kwargs)


def check_weights_only(paths: list[Path]) -> None:
    """Before a library unpickles these files itself (DeepSpeed's checkpoint reader loads with
    weights_only=False): each loads weights-only (then its unpickling can name nothing else), or the user
    allowed pickles."""
    for path in paths:
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            _unpickle_allowed(path, err)


_DCP_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_GLOBALS or module == "torch.distributed.checkpoint.metadata" or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not DCP metadata")


def check_dcp_metadata(metadata_file: Path) -> None:
    """A torch.distributed.checkpoint `.metadata` names only DCP's metadata classes (else the user allowed
    pickles): DCP itself unpickles it without restriction."""
    try:
        with open(metadata_file, "rb") as f:
            _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        _unpickle_allowed(metadata_file, err)
