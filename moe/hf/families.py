"""Which adapter reads or writes which Hugging Face model family: the one table.

Reading goes by the checkpoint's `model_type` (config.json, opened by `read_hf_config`): Mixtral,
DeepSeek-V3, gpt-oss, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V2, GLM-4.5; writing by `model.hf_family` (an
import sets it), else by our attention: GQA models are Mixtral, MLA models DeepSeek-V3. Dense Mistral/Llama
checkpoints are read by upcycling only (their adapter needs the expert count: moe.hf.dense.DenseUpcycle).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from moe.errors import ConfigError, UserError, first_line
from moe.hf.adapter import ExportAdapter, HFAdapter
from moe.hf.deepseek_v2 import DeepSeekV2
from moe.hf.deepseek_v3 import DeepSeekV3
from moe.hf.dense import DenseUpcycle
from moe.hf.glm4_moe import Glm4Moe
from moe.hf.gpt_oss import GptOss
from moe.hf.mixtral import Mixtral
from moe.hf.olmoe import Olmoe
from moe.hf.qwen2_moe import Qwen2Moe
from moe.hf.qwen3_moe import Qwen3Moe
from moe.hf.tensors import SafetensorsDir

CONVERTERS: dict[str, type[ExportAdapter]] = {
    adapter.model_types[0]: adapter
    for adapter in (Mixtral, DeepSeekV3, GptOss, Qwen3Moe, Qwen2Moe, Olmoe, DeepSeekV2, Glm4Moe)}
UPCYCLERS: dict[str, type[HFAdapter]] = dict.fromkeys(DenseUpcycle.model_types, DenseUpcycle)
EXPORT_BY_ATTENTION = {"gqa": "mixtral", "mla": "deepseek_v3"}
IMPORTABLE = tuple(CONVERTERS)  # model_type of the checkpoints from_hf reads
FAMILY_CLASSES = tuple(adapter.hf_class for adapter in CONVERTERS.values())


def converter_for(model_type: str | None, field: str = "model_type") -> ExportAdapter:
    """The adapter of a checkpoint of a family we convert; a ConfigError naming what to do otherwise."""
    if model_type not in CONVERTERS:
        raise ConfigError(field, model_type, f"convert a checkpoint of one of {', '.join(FAMILY_CLASSES)}; "
                          "upcycle a dense one with moe.hf.upcycle", f"is not {' or '.join(IMPORTABLE)}")
    return CONVERTERS[model_type]()


def exporter_for(model_cfg) -> ExportAdapter:
    """The family a model of ours exports to: `model.hf_family`, else its attention's."""
    family = model_cfg.hf_family or EXPORT_BY_ATTENTION[model_cfg.attention]
    return converter_for(family, field="model.hf_family")


def read_hf_config(path: str | Path, field: str):
    """The transformers config of a directory of a family we convert; a UserError naming `field` when the
    directory has none, an unreadable one, or another model type."""
    from transformers import AutoConfig

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(field, str(path), "point to a local directory written by save_pretrained "
                        "(config.json + safetensors); hub names are not downloaded",
                        problem="has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        first = first_line(err)
        raise UserError(field, str(path), "fix or regenerate config.json",
                        problem=f"has a config.json transformers cannot read ({first})") from err
    if config.model_type not in CONVERTERS:
        raise UserError(field, str(path), f"convert a checkpoint of one of {', '.join(FAMILY_CLASSES)}",
                        problem=f"holds model_type={config.model_type!r}, not {' or '.join(IMPORTABLE)}")
    warn_unknown_keys(config, path)
    note_unread(config, path)
    return config


def note_unread(config, path) -> None:
    """One line naming what the directory holds that the import skips (HFAdapter.note); a directory whose
    weights cannot be listed says nothing here (its load says why)."""
    try:
        keys = SafetensorsDir(path).file_of
    except UserError:
        return
    note = converter_for(config.model_type).note(config, keys)
    if note:
        print(f"note: {path} {note}", file=sys.stderr)


LEGACY_ROPE_KEYS = {"rope_theta", "rope_scaling", "partial_rotary_factor"}


def warn_unknown_keys(config, path) -> list[str]:
    """Keys of config.json its transformers config class does not define (a typo, or another model's
    option): nothing reads them, so the model built is the one the known keys describe. Said in one line
    (what changes the architecture and is not implemented is refused by the adapter instead)."""
    import inspect

    from transformers import PretrainedConfig

    known = set(inspect.signature(type(config).__init__).parameters) | set(PretrainedConfig().to_dict())
    if hasattr(config, "rope_parameters"):  # transformers 5 reads 4.x's RoPE keys into rope_parameters
        known |= LEGACY_ROPE_KEYS  # (modeling_rope_utils.py:776-786 at 5.24; our export writes rope_theta)
    # what the class itself writes (DeepSeek-V3: head_dim and qk_head_dim, derived in __post_init__, and
    # num_nextn_predict_layers, an alias in attribute_map)
    known |= set(type(config)().to_dict())
    # either spelling of an attribute_map alias (Qwen3MoeConfig saves num_experts as num_local_experts,
    # configuration_qwen3_moe.py:50-51 at 5.24; OLMoE reads num_local_experts as num_experts)
    aliases = getattr(config, "attribute_map", {})
    known |= set(aliases) | set(aliases.values())
    known.add("torch_dtype")  # transformers 4's name of `dtype`, read as it (configuration_utils.py:438-442
    # at 5.24): nearly every released config.json has it
    known.add("head_dim")  # read with getattr by the attention of configs without the field (Qwen-MoE, OLMoE:
    # modeling_qwen3_moe.py:129 at 5.24); Qwen3-30B-A3B's config.json sets it
    unknown = sorted(set(json.loads((Path(path) / "config.json").read_text())) - known)
    if unknown:
        print(f"warning: {Path(path) / 'config.json'} has keys {config.model_type} does not define, ignored: "
              f"{', '.join(unknown)}", file=sys.stderr)
    return unknown
