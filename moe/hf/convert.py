"""Our models <-> transformers models and save_pretrained directories, through the registry's adapters.

`to_hf(model)` and `from_hf(model_or_dir)` convert whole models in memory (their configs too);
`tensor_source(dir, model_cfg, seed)` reads a directory one tensor (or one run of experts) at a time,
as each rank materialises its shard (moe.backends.base.Backend.initial_source, trn1's
param_init_fn); moe.hf.families.read_hf_config opens a directory's config.json with a clear refusal.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.hf.dense import DenseUpcycle
from moe.hf.families import UPCYCLERS, converter_for, exporter_for
from moe.hf.tensors import SafetensorsDir, check_finite, is_stacked, load_local, read_checked


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


def from_hf(model_or_dir: str | Path | object, moe_opt: MoEOptConfig | None = None):
    """MoETransformer from a MixtralForCausalLM, DeepseekV3ForCausalLM or GptOssForCausalLM, or a local
    directory of one (no hub access).

    moe_opt defaults to the adapter's: dropless, so logits match transformers.
    """
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
    cfg = adapter.model_config(hf.config)
    model = MoETransformer(cfg, moe_opt if moe_opt is not None else adapter.moe_opt(hf.config))
    model = model.to(dtype=next(hf.parameters()).dtype)
    hf_sd = hf.state_dict()
    if is_stacked(hf_sd):  # 5.x in memory -> the per-expert keys of the files and of 4.x
        hf_sd = adapter.per_expert(hf_sd, cfg.num_layers)
    read = adapter.reader(cfg, hf.config)
    ours = {name: check_finite(name, read(name, hf_sd.__getitem__), model_or_dir, "hf_dir")
            for name in model.state_dict()}
    model.load_state_dict({k: v.detach().clone().contiguous() for k, v in ours.items()}, strict=True)
    return model


def tensor_source(path: str | Path, model_cfg, seed: int = 0, field: str = "model.init_from_hf"):
    """`source(name, shape, first_expert)` -> our tensor from DIR's safetensors, as
    MoETransformer.materialize (and trn1's param_init_fn) reads values: full tensors, or experts
    [first_expert, first_expert + shape[0]). A directory of a family we convert (moe.hf.families) is
    converted; a dense Mistral/Llama one upcycled to model_cfg's experts, routers from moe.model.init's
    values for `seed`."""
    files = SafetensorsDir(path, field)
    hf_config = json.loads((Path(path) / "config.json").read_text())
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
