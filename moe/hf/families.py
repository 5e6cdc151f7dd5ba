"""Which adapter reads or writes which Hugging Face model family: the one table.

Reading goes by the checkpoint's `model_type` (config.json); writing by `model.hf_family` (an import
sets it), else by our attention: GQA models are Mixtral, MLA models DeepSeek-V3. Dense Mistral/Llama
checkpoints are read by upcycling only (their adapter needs the expert count: moe.hf.dense.DenseUpcycle).
"""
from __future__ import annotations

from moe.errors import ConfigError
from moe.hf.adapter import ExportAdapter, HFAdapter
from moe.hf.deepseek_v3 import DeepSeekV3
from moe.hf.dense import DenseUpcycle
from moe.hf.gpt_oss import GptOss
from moe.hf.mixtral import Mixtral

CONVERTERS: dict[str, type[ExportAdapter]] = {"mixtral": Mixtral, "deepseek_v3": DeepSeekV3,
                                              "gpt_oss": GptOss}
UPCYCLERS: dict[str, type[HFAdapter]] = dict.fromkeys(DenseUpcycle.model_types, DenseUpcycle)
EXPORT_BY_ATTENTION = {"gqa": "mixtral", "mla": "deepseek_v3"}
IMPORTABLE = tuple(CONVERTERS)  # model_type of the checkpoints from_hf reads


def converter_for(model_type: str | None, field: str = "model_type") -> ExportAdapter:
    """The adapter of a Mixtral, DeepSeek-V3 or gpt-oss checkpoint; a ConfigError naming what to do
    otherwise."""
    if model_type not in CONVERTERS:
        raise ConfigError(field, model_type, "convert a Mixtral (MixtralForCausalLM), DeepSeek-V3 "
                          "(DeepseekV3ForCausalLM) or gpt-oss (GptOssForCausalLM) checkpoint; upcycle a "
                          "dense one with moe.hf.upcycle",
                          f"is not {' or '.join(IMPORTABLE)}")
    return CONVERTERS[model_type]()


def exporter_for(model_cfg) -> ExportAdapter:
    """The family a model of ours exports to: `model.hf_family`, else its attention's."""
    family = model_cfg.hf_family or EXPORT_BY_ATTENTION[model_cfg.attention]
    return converter_for(family, field="model.hf_family")
