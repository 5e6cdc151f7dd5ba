"""Models to generate from: a training checkpoint (rebuilt from the config it holds) or a Mixtral or
DeepSeek-V3 directory.

`train.py` writes Lightning checkpoints (`runs/<run>/checkpoints/last.ckpt`) whose
`state_dict` keys are `model.<our key>` and whose `hyper_parameters["cfg"]` is the full
resolved config, so the architecture comes from the file itself. They are read with
`torch.load(weights_only=True)` (tensors and plain containers only, no code runs); only
a checkpoint holding other objects falls back to a full unpickle, with a warning. A trn1 run's
checkpoints are neuronx-distributed directories of shards (no last.ckpt): the newest complete one
is put back together by moe.backends.neuron.files.read_checkpoint.
"""
from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import UserError
from moe.model import MoETransformer
from moe.model.hf import IMPORTABLE

LAST = "last.ckpt"
PREFIX = "model."  # LitMoE.model


def resolve_checkpoint(ckpt: str, runs_dir: str | Path = "runs") -> Path:
    """`last` -> the newest run's; a run dir -> its last.ckpt (trn1: newest complete NxD checkpoint);
    a file or an NxD checkpoint directory -> itself."""
    from moe.backends.neuron.files import is_complete, newest_complete
    from moe.train.checkpoint import resolved_name
    from moe.train.sharded_checkpoint import is_sharded_checkpoint

    if ckpt == "last":
        found = [*Path(runs_dir).glob(f"*/checkpoints/{LAST}"),
                 *filter(None, (newest_complete(d) for d in Path(runs_dir).glob("*/checkpoints")))]
        found = sorted((p for p in found if p.exists()), key=lambda p: p.stat().st_mtime)  # no dangling link
        if not found:
            raise UserError("ckpt", ckpt, "train first (python train.py) or pass ckpt=PATH; ckpt=last looks "
                            f"in runs_dir={runs_dir!r}", problem=f"found no {runs_dir}/*/checkpoints/{LAST}")
        picked = found[-1]
        print(f"ckpt=last: {picked}{resolved_name(picked)} (the newest of {len(found)} run(s) in "
              f"{runs_dir}/; "
              "pass ckpt=PATH for another)", file=sys.stderr)
        return picked
    path = Path(ckpt).expanduser()
    if path.is_dir() and (is_complete(path) or is_sharded_checkpoint(path)):
        return path  # a trn1 checkpoint, or a sharded one
    if path.is_dir():
        newest_nxd = newest_complete(path / "checkpoints") if (path / "checkpoints").is_dir() else None
        if newest_nxd and not (path / "checkpoints" / LAST).is_file():
            return newest_nxd
        if (path / "checkpoint").is_dir() or any(path.glob("*model_states.pt")):
            raise UserError("ckpt", ckpt, "consolidate it first: python -m "
                            f"lightning.pytorch.utilities.deepspeed {ckpt} consolidated.ckpt, then pass "
                            "ckpt=consolidated.ckpt",
                            problem="is a DeepSpeed sharded checkpoint directory")
        for candidate in (path / "checkpoints" / LAST, path / LAST):
            if candidate.is_file() or is_sharded_checkpoint(candidate):
                return candidate
        raise UserError("ckpt", ckpt, "pass a .ckpt file, a run dir holding checkpoints/last.ckpt, or "
                        "ckpt=last",
                        problem="is a directory without checkpoints/last.ckpt")
    if not path.is_file():
        raise UserError("ckpt", ckpt, "pass an existing .ckpt file, a run dir (runs/<run_name>) or ckpt=last",
                        problem="does not exist")
    return path


def read_checkpoint(path: str | Path) -> dict:
    """torch.load on CPU, weights_only when the file allows it (it does for train.py's checkpoints);
    a sharded or trn1 checkpoint directory, joined into the same dict. Verified first where train.py
    left a record (the sha256 sidecar, a directory's completion marks), else by the CRC-32s inside the
    file: a corrupt file is refused."""
    from moe.train.checkpoint import CorruptCheckpoint, check_zip_crc, meta_path, verify_checkpoint
    from moe.train.sharded_checkpoint import is_sharded_checkpoint, read_full_checkpoint

    try:
        if Path(path).is_dir() or meta_path(path).exists():
            verify_checkpoint(path, deep=True)  # every byte is read next anyway
        else:  # no sidecar (a copied file, an exported one): the CRC-32 of every record inside it
            check_zip_crc(Path(path))
    except CorruptCheckpoint as err:
        raise UserError("ckpt", str(path), "use another checkpoint of the run (checkpoints/step-*.ckpt) "
                        "or the run dir, whose newest good checkpoint train.py resumes from",
                        problem=str(err)) from err

    if is_sharded_checkpoint(path):
        return read_full_checkpoint(path)
    if Path(path).is_dir():
        from moe.backends.neuron.files import read_checkpoint as read_nxd_checkpoint

        return read_nxd_checkpoint(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"warning: {path} holds objects beyond tensors and plain containers ({first_line[:200]}); "
              "loading it with weights_only=False, which runs its pickled code: only load checkpoints you "
              "trust",
              file=sys.stderr)
    except (RuntimeError, OSError, EOFError) as err:
        raise UserError("ckpt", str(path), "pass a checkpoint written by train.py (torch.save format)",
                        problem=f"could not be read ({str(err).splitlines()[0][:200]})") from err
    return torch.load(path, map_location="cpu", weights_only=False)


def checkpoint_config(ckpt: dict, path: str | Path) -> DictConfig:
    """The resolved training config stored in the checkpoint (model, moe_opt, data, ...)."""
    cfg = (ckpt.get("hyper_parameters") or {}).get("cfg") if isinstance(ckpt, dict) else None
    if not isinstance(cfg, dict) or "model" not in cfg or "state_dict" not in ckpt:
        raise UserError("ckpt", str(path), "pass a checkpoint written by this repo's train.py; for a Mixtral "
                        "directory use hf_dir=DIR", problem="is not a moe training checkpoint "
                        "(no state_dict or hyper_parameters['cfg']['model'])")
    return OmegaConf.create(cfg)


def _typed(schema, values: dict, path, section: str):
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except Exception as err:  # omegaconf raises several types for unknown keys / wrong types
        raise UserError("ckpt", str(path), "pass a checkpoint written by this repo's train.py",
                        problem=f"has a {section} config this version cannot read ({err})") from err


def model_from_checkpoint(path: str | Path) -> tuple[MoETransformer, DictConfig]:
    """(model in eval mode, fp32 on CPU, full experts; training config) from a train.py checkpoint."""
    ckpt = read_checkpoint(path)
    cfg = checkpoint_config(ckpt, path)
    model_cfg = _typed(ModelConfig, OmegaConf.to_container(cfg.model), path, "model")
    moe_opt = _typed(MoEOptConfig, OmegaConf.to_container(cfg.get("moe_opt", {})), path, "moe_opt")
    state = {k[len(PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(PREFIX)}
    model = MoETransformer(model_cfg, moe_opt)
    _load_state(model, state, path)
    return model.eval(), cfg


def _load_state(model: MoETransformer, state: dict, path) -> None:
    """load_state_dict(strict) with one readable paragraph instead of torch's wall of keys."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        groups = (("missing", missing), ("unexpected", unexpected), ("shape (file vs config)", shapes))
        parts = [f"{name}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                 for name, keys in groups if keys]
        raise UserError("ckpt", str(path), "pass a checkpoint of this architecture (its own hyper_parameters "
                        "describe it; it may come from another version or model family)",
                        problem="does not match the model its config describes (" + "; ".join(parts) + ")")
    model.load_state_dict(state, strict=True)


# -- Mixtral and DeepSeek-V3 directories (config.json + safetensors) -----------------------------


def read_hf_config(path: str | Path, field: str):
    from transformers import AutoConfig

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(field, str(path), "point to a local directory written by save_pretrained "
                        "(config.json + safetensors); hub names are not downloaded",
                        problem="has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise UserError(field, str(path), "fix or regenerate config.json",
                        problem=f"has a config.json transformers cannot read ({first})") from err
    if config.model_type not in IMPORTABLE:
        raise UserError(field, str(path), "convert a Mixtral (MixtralForCausalLM) or DeepSeek-V3 "
                        "(DeepseekV3ForCausalLM) checkpoint",
                        problem=f"holds model_type={config.model_type!r}, not {' or '.join(IMPORTABLE)}")
    return config


def model_from_hf_dir(path: str | Path, field: str = "hf_dir", moe_opt=None) -> MoETransformer:
    """MoETransformer (eval) from a Mixtral or DeepSeek-V3 directory; dropless routing as the checkpoint
    computes it."""
    from moe.model.hf import from_hf

    read_hf_config(path, field)
    try:
        return from_hf(Path(path).expanduser(), moe_opt=moe_opt).eval()
    except (OSError, KeyError, RuntimeError) as err:
        first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise UserError(field, str(path), "point to a complete save_pretrained directory (config.json and "
                        "its model*.safetensors)", problem=f"could not be loaded ({first})") from err


def generation_eos_ids(path: str | Path) -> list[int]:
    """eos_token_id(s) from generation_config.json / config.json, when the directory names them."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            ids += [value] if isinstance(value, int) else list(value or [])
    return list(dict.fromkeys(ids))
