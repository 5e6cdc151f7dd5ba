"""A trn1 checkpoint as one portable file: `python -m moe.tools.convert_nxd SRC OUT.ckpt`.

SRC is a neuronx-distributed checkpoint directory (`runs/<run>/checkpoints/step-000100.ckpt/`) or
a run dir (its newest complete one). OUT is the Lightning checkpoint the CPU and GPU backends
write: full tensors under `state_dict` (`model.<name>`), the run's config under
`hyper_parameters`, its step, so `infer.py ckpt=OUT` generates and `export_hf=DIR` exports from
it on any machine. infer.py also reads SRC directly; this file is for copying a model off the
cluster without its 64 shard files. The optimizer state stays behind: OUT is not for resuming.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from moe.backends.neuron.files import is_complete, newest_complete, read_checkpoint
from moe.errors import UserError, exit_on_user_error

KEPT = ("state_dict", "hyper_parameters", "hparams_name", "global_step", "epoch", "pytorch-lightning_version")


def checkpoint_dir(src: str) -> Path:
    """SRC as a complete NxD checkpoint directory, or a UserError saying what SRC is instead."""
    path = Path(src).expanduser()
    if path.is_dir() and not is_complete(path):
        newest = newest_complete(path / "checkpoints" if (path / "checkpoints").is_dir() else path)
        if newest is None:
            raise UserError("SRC", src, "pass a trn1 run dir (runs/<run>) or one of its "
                            "checkpoints/<name>.ckpt/ directories that has a `done` file",
                            problem="holds no complete neuronx-distributed checkpoint")
        path = newest
    if not path.is_dir():
        raise UserError("SRC", src, "pass a trn1 run dir or a checkpoint directory; a .ckpt file is already "
                        "portable", problem="is not a directory")
    return path


def convert(src: str, out: str) -> Path:
    source = checkpoint_dir(src)
    ckpt = read_checkpoint(source)
    out_path = Path(out).expanduser()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    torch.save({k: ckpt[k] for k in KEPT if k in ckpt}, partial)
    partial.replace(out_path)  # never a half-written OUT
    print(f"{source} (step {ckpt['global_step']}) -> {out_path}")
    return out_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="an NxD checkpoint directory, or a trn1 run dir (its newest checkpoint)")
    parser.add_argument("out", help="the .ckpt file to write")
    args = parser.parse_args(argv)
    exit_on_user_error(convert)(args.src, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
