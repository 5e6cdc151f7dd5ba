"""Typed schema of `infer.py` (conf/infer.yaml), registered in Hydra's ConfigStore as `infer_schema`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from hydra.core.config_store import ConfigStore

from moe.config.choices import InferDtype


@dataclass
class InferConfig:
    """Where the model comes from, what to do with it, and how to sample."""

    ckpt: str | None = None  # a .ckpt file, a run dir, or `last` (newest runs/*/checkpoints/last.ckpt)
    hf_dir: str | None = None  # a directory (config.json + safetensors) of a family moe.hf converts
    runs_dir: str = "runs"  # where ckpt=last looks
    prompt: str | None = None
    prompts_file: str | None = None  # .txt: one prompt a line; .jsonl: a `prompt` field a line
    chat: bool = False  # wrap each prompt in the chat template (prompt part only)
    chat_template: str | None = None  # null: the checkpoint's data.chat_template, else the default
    max_new_tokens: int = 64
    greedy: bool = False  # true: argmax whatever temperature says
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 1234  # sampling RNG: same seed, same tokens
    stop_at_eos: bool = True
    batch_size: int = 8  # prompts per left-padded batch
    use_cache: bool = True  # false: recompute the whole sequence every step (slow; for checking)
    tokenizer: str | None = None  # tokenizer dir override; null: the checkpoint's / hf_dir's own
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    dtype: Annotated[str, InferDtype] = "auto"  # auto: bf16 on cuda, fp32 on cpu
    export_hf: str | None = None  # write a Mixtral directory here instead of generating
    overwrite: bool = False  # let export_hf replace an existing non-empty directory
    allow_pickle: bool = False  # load a checkpoint whose unpickling runs code (only one you trust)
    output_file: str | None = None  # also write one JSON line per prompt (prompt, completion, tokens)


def register_configs() -> None:
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)


register_configs()
