"""Hugging Face interop: one adapter class per model family behind one registry.

    moe/hf/adapter.py      the adapter contract (read: config, routing, tensors; write: config, weights)
    moe/hf/mixtral.py      Mixtral <-> our GQA models
    moe/hf/deepseek_v3.py  DeepSeek-V3 <-> our MLA models
    moe/hf/gpt_oss.py      gpt-oss <-> our GQA models with sinks, biases and the clamped SwiGLU
    moe/hf/sparse_moe.py   what the softmax top-k families share (keys, reader, writer, refusals)
    moe/hf/qwen3_moe.py    Qwen3-MoE <-> our GQA models with a per-head QK-norm
    moe/hf/qwen2_moe.py    Qwen2-MoE <-> our GQA models with q/k/v biases and a gated shared expert
    moe/hf/olmoe.py        OLMoE <-> our GQA models with a full-width QK-norm
    moe/hf/glm4_moe.py     GLM-4.5 <-> our GQA models with partial RoPE, q/k/v biases, DeepSeek-V3's router
    moe/hf/sigmoid_router.py  what DeepSeek-V3 and GLM-4.5 share: the sigmoid router, first-k-dense layers
    moe/hf/mtp.py          the multi-token-prediction layers an import skips, with a note
    moe/hf/dense.py        dense Mistral/Llama -> MoE by upcycling (and the Llama family's config and keys)
    moe/hf/families.py     model_type -> adapter (read_hf_config); our attention -> the family we export to
    moe/hf/convert.py      to_hf, from_hf (a directory: from_hf_dir), tensor_source
    moe/hf/tensors.py      shared keys, lazy safetensors reads, the weights' start-up checks
    moe/hf/rope.py         a transformers config's RoPE, its scaling and partial width <-> our rope_* keys
    moe/hf/start.py        model.init_from_hf / upcycle_from_hf: what a run settles from the directory

The names below are the public API (`moe.hf.from_hf`, `moe.hf.to_hf`, `moe.hf.upcycle`, ...).
"""
from moe.hf.convert import (
    check_exportable,
    from_hf,
    hf_config_from_model_config,
    model_config_from_hf,
    moe_opt_from_hf,
    tensor_source,
    to_hf,
)
from moe.hf.dense import upcycle
from moe.hf.families import IMPORTABLE, read_hf_config

__all__ = ["IMPORTABLE", "check_exportable", "from_hf", "hf_config_from_model_config", "model_config_from_hf",
           "moe_opt_from_hf", "read_hf_config", "tensor_source", "to_hf", "upcycle"]
