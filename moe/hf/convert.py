"""Our models <-> transformers models and save_pretrained directories, through the registry's adapters.

`to_hf(model)` and `from_hf(model_or_dir)` convert whole models (their configs too); a directory of
safetensors goes straight into ours, no transformers model built (`from_hf_dir`).
`tensor_source(dir, model_cfg, seed)` reads a directory one tensor (or one run of experts) at a time,
as `from_hf_dir` and each rank materialise their model (moe.backends.base.Backend.initial_source, trn1's
param_init_fn); moe.hf.families.read_hf_config opens a directory's config.json with a clear refusal.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.hf.dense import DenseUpcycle
from moe.hf.families import UPCYCLERS, converter_for, exporter_for
from moe.hf.tensors import INDEX, SafetensorsDir, check_finite, is_stacked, load_local, read_checked


def check_exportable(cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
    """Raise ConfigError for any option the model's transformers class (its family: moe.hf.families) cannot
    reproduce."""
    exporter_for(cfg).check_exportable(cfg, moe_opt)


def hf_config_from_model_config(cfg: ModelConfig, moe_opt: MoEOptConfig):
    """MixtralConfig (GQA) or DeepseekV3Config (MLA) with the same architecture (check_exportable first)."""
    return exporter_for(cfg).hf_config(cfg, moe_opt)


def model_config_from_hf(hf_config) -> ModelConfig:
    """ModelConfig for a MixtralConfig or DeepseekV3Config; refuses what our decoder does not implement."""
    return converter_for(getattr(hf_config, "model_type", None)).model_config(hf_config)


def moe_opt_from_hf(hf_config) -> MoEOptConfig:
    """Dropless routing as the checkpoint computes it (Mixtral's renormalised softmax top-k, or DeepSeek-V3's
    sigmoid with groups and bias)."""
    return converter_for(getattr(hf_config, "model_type", None)).moe_opt(hf_config)


def _unsharded(model) -> None:
    for i, block in enumerate(model.layers):
        if not block.is_moe:
            continue
        experts = block.ffn.experts
        local = experts.gate_up.shape[experts.layout.expert_dim]
        if local != model.model_config.num_experts:
            raise ConfigError(f"layers.{i}.ffn.experts",
                              f"{local} of {model.model_config.num_experts} experts",
                              "export from an unsharded model (a checkpoint loaded without apply_ep)",
                              "holds only this rank's experts")


def to_hf(model):
    """A transformers MixtralForCausalLM (GQA) or DeepseekV3ForCausalLM (MLA) with the same config and
    weights (same dtype)."""
    adapter = exporter_for(model.model_config)
    hf_config = adapter.hf_config(model.model_config, model.moe_opt)
    _unsharded(model)
    hf = adapter.model_class()(hf_config).to(dtype=next(model.parameters()).dtype)
    adapter.prepare(hf)
    sd = adapter.state_dict(model)
    sd = sd if is_stacked(hf.state_dict()) else adapter.per_expert(sd, model.model_config.num_layers)
    hf.load_state_dict(sd, strict=True)
    return hf.eval()


def from_hf(model_or_dir: str | Path | object, moe_opt: MoEOptConfig | None = None,
            dtype: torch.dtype | None = None, field: str = "hf_dir"):
    """MoETransformer from a MixtralForCausalLM, DeepseekV3ForCausalLM or GptOssForCausalLM, or a local
    directory of one (no hub access), with the multi-token-prediction depths a directory's files hold
    (DeepSeek-V3's layer 61: moe.hf.mtp).

    A directory of safetensors is read straight into our model (`from_hf_dir`: no transformers model);
    one of pytorch_model.bin goes through transformers. moe_opt defaults to the adapter's: dropless, so logits
    match transformers. dtype: the model's (None: the checkpoint's own, as transformers' dtype="auto");
    field: the setting a refusal of DIR's tensors names.
    """
    if isinstance(model_or_dir, (str, Path)):
        path = Path(model_or_dir)
        if (path / "config.json").is_file() and any((path / name).is_file()
                                                     for name in ("model.safetensors", INDEX)):
            return from_hf_dir(path, moe_opt, dtype, field)
    return _from_transformers(model_or_dir, moe_opt, dtype)


def from_hf_dir(path: str | Path, moe_opt: MoEOptConfig | None = None, dtype: torch.dtype | None = None,
                field: str = "hf_dir"):
    """Our model built on the meta device and materialised from DIR's safetensors one tensor at a time
    (`tensor_source`), in `dtype`: the weights are held once, never a transformers model beside ours. Each
    tensor is checked as it is read (present, in the shape config.json implies, finite)."""
    from transformers import AutoConfig

    from moe.model.model import MoETransformer

    path = Path(path)
    hf_config = json.loads((path / "config.json").read_text())
    adapter = converter_for(hf_config.get("model_type"))
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    cfg = adapter.model_config(config)  # a refusal (gpt-oss's quantized experts, ...) before any weight loads
    files = SafetensorsDir(path, field)
    cfg = replace(cfg, mtp_layers=adapter.mtp_depths(hf_config, files.file_of))
    with torch.device("meta"):
        model = MoETransformer(cfg, moe_opt if moe_opt is not None else adapter.moe_opt(config))
    model.to(dtype=dtype or checkpoint_dtype(config, files))
    model.materialize("cpu", tensor_source(path, cfg, field=field, files=files, hf_config=hf_config))
    return model.to(dtype=next(model.parameters()).dtype)  # computed buffers too, as a cast model has them


def checkpoint_dtype(config, files: SafetensorsDir) -> torch.dtype:
    """The dtype transformers loads a directory in by default (dtype="auto"): config.json's, else its first
    floating-point tensor's."""
    if isinstance(config.dtype, torch.dtype):
        return config.dtype
    if isinstance(config.dtype, str) and isinstance(getattr(torch, config.dtype, None), torch.dtype):
        return getattr(torch, config.dtype)
    for key in files.file_of:
        value = files.get(key)
        if value.is_floating_point():
            return value.dtype
    return torch.get_default_dtype()


def _from_transformers(model_or_dir, moe_opt: MoEOptConfig | None, dtype: torch.dtype | None):
    """from_hf of a transformers model in memory, or of a directory only transformers reads (its
    pytorch_model.bin): its state dict converted and copied into ours."""
    from transformers import AutoModelForCausalLM

    from moe.model.model import MoETransformer

    model_cls = AutoModelForCausalLM
    if isinstance(model_or_dir, (str, Path)) and (Path(model_or_dir) / "config.json").is_file():
        from transformers import AutoConfig

        hf_config = json.loads((Path(model_or_dir) / "config.json").read_text())
        adapter = converter_for(hf_config.get("model_type"))
        # a refusal (gpt-oss's quantized experts, ...) before any weight loads
        adapter.model_config(AutoConfig.from_pretrained(str(model_or_dir), local_files_only=True))
        model_cls = adapter.loading_class(hf_config)
    hf = load_local(model_or_dir, model_cls, "init_from_hf")
    adapter = converter_for(getattr(hf.config, "model_type", None))
    cfg = replace(adapter.model_config(hf.config), mtp_layers=0)
    model = MoETransformer(cfg, moe_opt if moe_opt is not None else adapter.moe_opt(hf.config))
    model = model.to(dtype=next(hf.parameters()).dtype)
    hf_sd = hf.state_dict()
    if is_stacked(hf_sd):  # 5.x in memory -> the per-expert keys of the files and of 4.x
        hf_sd = adapter.per_expert(hf_sd, cfg.num_layers)
    read = adapter.reader(cfg, hf.config)
    ours = {name: check_finite(name, read(name, hf_sd.__getitem__), model_or_dir, "hf_dir")
            for name in model.state_dict()}
    model.load_state_dict({k: v.detach().clone().contiguous() for k, v in ours.items()}, strict=True)
    return model if dtype is None else model.to(dtype=dtype)


def tensor_source(path: str | Path, model_cfg, seed: int = 0, field: str = "model.init_from_hf",
                  files: SafetensorsDir | None = None, hf_config: dict | None = None):
    """`source(name, shape, first_expert)` -> our tensor from DIR's safetensors, as
    MoETransformer.materialize (and trn1's param_init_fn) reads values: full tensors, or experts
    [first_expert, first_expert + shape[0]). A directory of a family we convert (moe.hf.families) is
    converted; a dense Mistral/Llama one upcycled to model_cfg's experts, routers from moe.model.init's
    values for `seed`. files, hf_config: DIR's, where the caller has opened them already."""
    files = files or SafetensorsDir(path, field)
    hf_config = hf_config or json.loads((Path(path) / "config.json").read_text())
    model_type = hf_config.get("model_type")
    if model_type in UPCYCLERS:
        adapter = DenseUpcycle(model_cfg.num_experts, model_cfg.top_k,
                               model_cfg.upcycle_granularity, seed)
    else:
        adapter = converter_for(model_type)
    read = adapter.reader(model_cfg, hf_config)

    def source(name: str, shape, first_expert: int | None) -> torch.Tensor:
        experts = None if first_expert is None else range(first_expert, first_expert + shape[0])
        return read_checked(lambda: read(name, files.get, experts), name, shape, path, field)

    return source


def write_extra(model, directory: str | Path) -> None:
    """Add to a save_pretrained directory of `model`'s export what its transformers class does not hold
    (ExportAdapter.extra_state_dict: DeepSeek-V3's multi-token-prediction layers) as one more safetensors file
    (moe.hf.mtp.FILE), named in the index beside the files save_pretrained wrote (an index is written for a
    single model.safetensors). transformers loads a single model.safetensors before any index
    (modeling_utils.py:592-603 at 5.24), so it reads only what its class holds there; readers that go by the
    index (ours, vLLM's) find every tensor."""
    from safetensors.torch import save_file

    from moe.hf.mtp import FILE

    extra = exporter_for(model.model_config).extra_state_dict(model)
    if not extra:
        return
    directory = Path(directory)
    save_file(extra, directory / FILE, metadata={"format": "pt"})
    index = directory / INDEX
    if index.is_file():
        record = json.loads(index.read_text())
    else:
        record = {"metadata": {"total_size": tensor_bytes(directory / "model.safetensors")},
                  "weight_map": SafetensorsDir(directory).file_of}
    record["weight_map"] |= dict.fromkeys(extra, FILE)
    record.setdefault("metadata", {})["total_size"] = record["metadata"].get("total_size", 0) + sum(
        t.numel() * t.element_size() for t in extra.values())
    index.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def tensor_bytes(file: Path) -> int:
    """The bytes of the tensors a safetensors file holds (its index's total_size), from its header."""
    import struct

    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(end - start for key, entry in header.items() if key != "__metadata__"
               for start, end in [entry["data_offsets"]])
