"""A checkpoint directory as one portable file: `python -m moe.tools.consolidate SRC OUT.ckpt`.

SRC is a checkpoint directory (sharded, moe/checkpoint/sharded.py; neuronx-distributed's, trn1;
DeepSpeed's) or a run dir (its newest complete checkpoint, moe.checkpoint.picker). OUT is the
single-file Lightning checkpoint, written by the portable format (atomic, with its `.meta.json` sidecar):
full tensors under `state_dict` (`model.<name>`), the run's config under `hyper_parameters`, its step,
so `infer.py ckpt=OUT`
generates and `export_hf=DIR` exports from it on any machine. infer.py also reads SRC directly;
this file is for copying a model off the cluster without its shard files. The optimizer state
stays behind: OUT is not for resuming. `python -m moe.tools.convert_nxd` is the same command.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import moe.backends.checkpoint_formats  # noqa: F401  (every backend's own format, registered on import)
from moe.checkpoint.formats import PORTABLE, format_of
from moe.checkpoint.picker import read_checkpoint, resolve_checkpoint
from moe.checkpoint.trust import set_allow_pickle
from moe.errors import UserError, exit_on_user_error, on_interrupt
from moe.outputs import check_output

KEPT = ("state_dict", "hyper_parameters", "hparams_name", "global_step", "epoch", "pytorch-lightning_version")


def checkpoint_dir(src: str) -> Path:
    """SRC as a checkpoint directory, or a UserError saying what SRC is instead."""
    path = resolve_checkpoint(src)
    if format_of(path) is PORTABLE:
        problem = ("holds no complete checkpoint directory (its newest checkpoint, "
                   f"{path.name}, is one file, already portable)" if Path(src).is_dir()
                   else "is a single checkpoint file, already portable")
        raise UserError("SRC", src, "pass a run dir or a checkpoint directory", problem=problem)
    return path


def is_torch_checkpoint(path: Path) -> bool:
    """A file torch.save wrote (a zip archive holding data.pkl): what --overwrite may replace."""
    import zipfile

    if not (path.is_file() and zipfile.is_zipfile(path)):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/data.pkl") for name in archive.namelist())


def convert(src: str, out: str, overwrite: bool = False) -> Path:
    """SRC's checkpoint as one file at OUT. SRC is checked first: a SRC that is no checkpoint is the
    user's first mistake, whatever OUT is."""
    source = checkpoint_dir(src)
    out_path = check_output("OUT", out, "portable checkpoint", overwrite, {"SRC": src},
                            ours=is_torch_checkpoint, flag="--overwrite")
    with on_interrupt(f"OUT={out_path} was not written (no temporary file was left; a file already there is "
                      "as it was)"):
        ckpt = read_checkpoint(source)
        PORTABLE.write({k: ckpt[k] for k in KEPT if k in ckpt}, out_path)  # atomic, with its sha256 sidecar
    print(f"{source} (step {ckpt['global_step']}) -> {out_path}")
    return out_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a sharded or NxD checkpoint directory, or a run dir (its newest one)")
    parser.add_argument("out", help="the .ckpt file to write")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="load files whose unpickling runs code (only ones you trust)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint file")
    args = parser.parse_args(argv)
    set_allow_pickle(args.allow_pickle)
    exit_on_user_error(convert)(args.src, args.out, args.overwrite)


if __name__ == "__main__":
    main(sys.argv[1:])
