"""Reading a Hugging Face checkpoint's tensors: the keys every family shares, lazy safetensors, helpers.

`get(key) -> tensor` is how every adapter reads: from a state dict in memory (`from_hf`) or from a
save_pretrained directory's safetensors read lazily (`SafetensorsDir`), so a rank that needs one
expert of one layer reads only that, never the whole model (moe.hf.convert.tensor_source).
The keys below are the Llama family's, which Mixtral, DeepSeek-V3, Mistral and Llama share.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from moe.errors import ConfigError, UserError
from moe.model.expert_layout import EXPERT_LAYOUT, stored

Get = Callable[[str], torch.Tensor]

TOP_LEVEL = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
BLOCK_NORMS = {"attn_norm.weight": "input_layernorm.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight"}
LAYER = re.compile(r"layers\.(\d+)\.(.+)")
STACKED_EXPERTS = EXPERT_LAYOUT.suffixes  # ours (gate_up, down), built by stacked_experts


def in_layer(name: str, model: str) -> tuple[str, str]:
    """Our per-layer tensor `name` as (the checkpoint's layer prefix `model.layers.{i}.`, our name inside
    the block); a KeyError naming `model` for a name outside every layer."""
    match = LAYER.fullmatch(name)
    if match is None:
        raise KeyError(f"{name}: not a parameter of {model}")
    return f"model.layers.{match.group(1)}.", match.group(2)


def top_level(name: str, get: Get) -> torch.Tensor:
    """Our embeddings, final norm or LM head (the embedding again when the checkpoint ties them)."""
    if name == "lm_head.weight" and not has_key(get, TOP_LEVEL[name]):
        return get(TOP_LEVEL["embed_tokens.weight"])
    return get(TOP_LEVEL[name])


def stacked_experts(rest: str, get: Get, expert_prefixes: list[str],
                    names: tuple[str, str, str]) -> torch.Tensor:
    """Our stacked gate_up ([gate | up] outputs) or down (`rest`: one of STACKED_EXPERTS), in the stored
    layout, from per-expert nn.Linear weights (gate and up [F, H], down [H, F]), `names` under each
    expert's prefix."""
    gate, up, down = names
    layout = stored()
    if layout.is_gate_up(rest):
        return layout.join_gate_up(layout.stack_linear([get(e + gate) for e in expert_prefixes]),
                                   layout.stack_linear([get(e + up) for e in expert_prefixes]))
    return layout.stack_linear([get(e + down) for e in expert_prefixes]).contiguous()


def expert_rows(get: Get, key: str, experts: range | None) -> torch.Tensor:
    """Experts `experts` (all: None) of a checkpoint tensor stacked [E, ...] (gpt-oss keeps its experts so in
    the files): sliced in the file where `get` reads a directory lazily (SafetensorsDir.get), so a rank
    reads only its own experts' bytes."""
    owner = getattr(get, "__self__", None)
    if experts is not None and isinstance(owner, SafetensorsDir):
        return owner.get_rows(key, experts)
    value = get(key)
    return value if experts is None else value[experts.start:experts.stop]


def has_key(get: Get, key: str) -> bool:
    try:
        get(key)
    except KeyError:
        return False
    return True


def is_stacked(hf_sd: dict[str, torch.Tensor]) -> bool:
    """Whether a Mixtral/DeepSeek-V3 state_dict uses transformers 5.x's stacked experts (else 4.x's and
    the files' per-expert keys)."""
    return any(key.endswith(".mlp.experts.gate_up_proj") for key in hf_sd)


def config_value(hf_config, key: str, default=None):
    """A field of a transformers config object or of its config.json dict."""
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def check_weights_file(path: Path, field: str) -> None:
    """A safetensors file that holds weights, or a UserError naming what it is instead: missing, empty, a
    git-lfs pointer (a clone made without Git LFS), or cut short (its header promises more bytes)."""
    import struct

    fix = ("fetch the real weights: `git lfs install && git lfs pull` in that clone, or download the "
           "directory again")
    if not path.is_file():
        raise UserError(field, str(path.parent), "point to a complete save_pretrained directory",
                        problem=f"has no {path.name}")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(max(8, len(LFS_POINTER)))
        if head.startswith(LFS_POINTER):
            raise UserError(field, str(path.parent), fix, problem=f"holds a git-lfs pointer in {path.name}, "
                            f"not weights ({size} bytes): the repository was cloned without Git LFS")
        if size < 8:
            raise UserError(field, str(path.parent), fix, problem=f"has a {size}-byte {path.name}: empty "
                            "or cut short, not a safetensors file")
        (header_len,) = struct.unpack("<Q", head[:8])
        if header_len > size - 8:
            raise UserError(field, str(path.parent), fix, problem=f"has a {path.name} that is not "
                            f"safetensors or is cut short ({size} bytes; its header claims {header_len})")
        f.seek(8)
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:
            raise UserError(field, str(path.parent), fix, problem=f"has a {path.name} whose safetensors "
                            "header does not parse: damaged") from err
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise UserError(field, str(path.parent), fix, problem=f"has a {path.name} cut short: {size} bytes of "
                        f"the {8 + header_len + end} its header describes")


INDEX = "model.safetensors.index.json"


def weight_map(path: Path, field: str) -> dict[str, str]:
    """The index's tensor -> shard file map; an index that is not JSON, or holds no such map, is a UserError
    naming the file and what to do (a cut-short download, a hand edit)."""
    from moe.inputs import load_json

    index = Path(path) / INDEX
    fix = ("download the directory again; if its model.safetensors alone holds all the weights, delete "
           f"{INDEX} instead")
    record = load_json(index, field, str(path), fix)
    mapping = record.get("weight_map") if isinstance(record, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise UserError(field, str(path), fix, problem=f"cannot be read: {index} holds no weight_map of "
                        "tensor names to safetensors files")
    return mapping


def check_weights_dir(path: Path, field: str) -> dict[str, str] | None:
    """Every safetensors file a save_pretrained directory names (one file, or its index's); returns the
    index's weight_map (None: no index)."""
    path = Path(path)
    index = path / INDEX
    mapping, names = None, {"model.safetensors"}
    if index.is_file():
        mapping = weight_map(path, field)
        names = set(mapping.values())
    elif not (path / "model.safetensors").exists() and (path / "pytorch_model.bin").exists():
        return None  # not safetensors: its loader says what it makes of the file
    for name in sorted(names):
        check_weights_file(path / name, field)
    return mapping


def check_weights(path: Path, field: str, tensors: dict[str, tuple[str, tuple]] | None = None) -> None:
    """At start-up, before a run dir exists: every safetensors file of DIR whole (`check_weights_dir`: an LFS
    pointer, a cut-short file) and, given `tensors` (our name -> its key in DIR's files and the shape
    DIR's config.json implies), those tensors in those shapes and finite, so weights saved for another
    config are refused here, not mid-run (small tensors only)."""
    if not tensors:
        check_weights_dir(Path(path), field)
        return
    files = SafetensorsDir(path, field)
    for name, (key, shape) in tensors.items():
        read_checked(functools.partial(files.get, key), name, shape, path, field)


def read_checked(read: Callable[[], torch.Tensor], name: str, shape, path, field: str) -> torch.Tensor:
    """Our tensor `name` as `read` gets it from DIR: a UserError naming `field` when DIR lacks it (`read`
    raises KeyError), holds it in another shape than `shape`, or holds NaN or inf in it."""
    fix = ("use the config.json saved with these weights (save_pretrained writes both), or weights "
           "saved for this config.json")
    try:
        value = read()
    except KeyError as err:
        raise UserError(field, str(path), fix, problem=f"has no tensor {err.args[0]} for our {name}, "
                        "which its config.json implies") from None
    if tuple(value.shape) != tuple(shape):
        raise UserError(field, str(path), fix, problem=f"holds our {name} as {tuple(value.shape)}, where "
                        f"its config.json implies {tuple(shape)}")
    return check_finite(name, value, path, field)


def check_finite(name: str, value: torch.Tensor, path, field: str) -> torch.Tensor:
    """A checkpoint tensor holding NaN or inf would train (or generate) nothing but NaN: refused, named."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise UserError(field, str(path), "use an intact copy of the checkpoint (re-download or re-export "
                        "it); its files' own checksums cannot tell a tensor saved with NaN",
                        problem=f"holds {bad} NaN or infinite values in the tensor that becomes our {name}")
    return value


class SafetensorsDir:
    """`get(key)` over a save_pretrained directory's safetensors (one file or an index), read lazily."""

    def __init__(self, path: str | Path, field: str = "model.init_from_hf"):
        self.path = Path(path)
        mapping = check_weights_dir(self.path, field)
        if mapping is not None:
            self.file_of = mapping
        else:
            from safetensors import safe_open

            with safe_open(self.path / "model.safetensors", framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), "model.safetensors")
        self._open: dict[str, object] = {}

    def get(self, key: str) -> torch.Tensor:
        return self._file(key).get_tensor(key)

    def get_rows(self, key: str, rows: range) -> torch.Tensor:
        """Rows [rows.start, rows.stop) of tensor `key`, reading only those from the file."""
        return self._file(key).get_slice(key)[rows.start:rows.stop]

    def _file(self, key: str):
        from safetensors import safe_open

        if key not in self.file_of:
            raise KeyError(key)
        name = self.file_of[key]
        if name not in self._open:
            self._open[name] = safe_open(self.path / name, framework="pt")
        return self._open[name]


def load_local(model_or_dir, model_cls, field: str):
    """A transformers model as given, or `model_cls.from_pretrained` of a local save_pretrained directory
    (no hub access)."""
    if not isinstance(model_or_dir, (str, Path)):
        return model_or_dir
    path = Path(model_or_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(field, str(path), "point to a directory written by save_pretrained "
                          "(config.json + weights); hub names are not downloaded", "has no config.json")
    return model_cls.from_pretrained(str(path), local_files_only=True)
