"""Models to generate from: a training checkpoint (rebuilt from the config it holds) or a Mixtral or
DeepSeek-V3 directory.

`train.py` writes checkpoints (`runs/<run>/checkpoints/`) whose `state_dict` keys are
`model.<our key>` and whose `hyper_parameters["cfg"]` is the full resolved config, so the
architecture comes from the file itself. Which checkpoint, and reading it in any format, is
moe.checkpoint.picker's (`resolve_checkpoint`, `read_checkpoint`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import UserError, first_line
from moe.hf import read_hf_config
from moe.model import MoETransformer

PREFIX = "model."  # LitMoE.model


def _picker():
    """moe.checkpoint.picker with every backend's own format registered: imported when a checkpoint is read
    (torch.distributed.checkpoint's import is a second or two of an hf_dir= start-up)."""
    import moe.backends.checkpoint_formats  # noqa: F401  (every backend's own format, registered on import)
    from moe.checkpoint import picker

    return picker


def resolve_checkpoint(ckpt: str, runs_dir: str) -> Path:
    """moe.checkpoint.picker.resolve_checkpoint, the formats registered first."""
    return _picker().resolve_checkpoint(ckpt, runs_dir)


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
    """(model in eval mode, fp32 on CPU, full experts; training config) from a train.py checkpoint. The
    model is built on the meta device and takes the checkpoint's tensors as they are (read_checkpoint maps
    the file in): the weights are held once, never a randomly initialised copy beside them."""
    ckpt = _picker().read_checkpoint(path)
    cfg = checkpoint_config(ckpt, path)
    model_cfg = _typed(ModelConfig, OmegaConf.to_container(cfg.model), path, "model")
    moe_opt = _typed(MoEOptConfig, OmegaConf.to_container(cfg.get("moe_opt", {})), path, "moe_opt")
    state = {k[len(PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(PREFIX)}
    with torch.device("meta"):
        model = MoETransformer(model_cfg, moe_opt)
    _load_state(model, {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, path)
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
    model.load_assigned(state)


# -- Mixtral, DeepSeek-V3 and gpt-oss directories (config.json + safetensors) -----------------------------


def model_from_hf_dir(path: str | Path, field: str = "hf_dir", moe_opt=None,
                      dtype: torch.dtype | None = None) -> MoETransformer:
    """MoETransformer (eval, on the CPU) from a directory of a family moe.hf.families converts, read from its
    files one tensor at a time in `dtype` (None: the checkpoint's; moe.hf.convert.from_hf); dropless routing
    as the checkpoint computes it."""
    from moe.hf import from_hf
    from moe.hf.tensors import check_weights_dir

    read_hf_config(path, field)
    check_weights_dir(Path(path).expanduser(), field)
    try:
        return from_hf(Path(path).expanduser(), moe_opt=moe_opt, dtype=dtype).eval()
    except (OSError, KeyError, RuntimeError) as err:
        first = first_line(err, 300)
        raise UserError(field, str(path), "point to a complete save_pretrained directory (config.json and "
                        "its model*.safetensors)", problem=f"could not be loaded ({first})") from err


def generation_eos_ids(path: str | Path, field: str = "hf_dir") -> list[int]:
    """eos_token_id(s) from generation_config.json / config.json, when the directory names them; a damaged
    file is a UserError naming it."""
    from moe.inputs import load_json

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.is_file():
            fix = ("restore generation_config.json, or delete it (the eos ids then come from config.json)"
                   if name == "generation_config.json" else "restore config.json from the model's source")
            record = load_json(file, field, str(path), fix)
            value = record.get("eos_token_id") if isinstance(record, dict) else None
            if not (value is None or isinstance(value, int) or
                    isinstance(value, list) and all(isinstance(v, int) for v in value)):
                raise UserError(field, str(path), fix, problem=f"cannot be read: {file} has eos_token_id="
                                f"{value!r}, not a token id or a list of them")
            ids += [value] if isinstance(value, int) else list(value or [])
    return list(dict.fromkeys(ids))
