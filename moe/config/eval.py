"""Typed schema of `python -m moe.eval` (conf/eval.yaml), in Hydra's ConfigStore as `eval_schema`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from hydra.core.config_store import ConfigStore

from moe.config.choices import BUNDLED_EVAL_TASKS, InferDtype


@dataclass
class EvalConfig:
    """The model (as infer.py finds it), the lm_eval tasks and a held-out text to score, where results go."""

    ckpt: str | None = None  # a .ckpt file, a sharded checkpoint directory, a run dir, or `last`
    hf_dir: str | None = None  # a directory (config.json + safetensors) of a family moe.hf converts
    runs_dir: str = "runs"  # where ckpt=last looks
    tokenizer: str | None = None  # tokenizer dir override; null: the checkpoint's / hf_dir's own
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    dtype: Annotated[str, InferDtype] = "auto"  # auto: bf16 on cuda, fp32 on cpu
    allow_pickle: bool = False  # load a checkpoint whose unpickling runs code (only one you trust)
    tasks: list[str] = field(default_factory=lambda: list(BUNDLED_EVAL_TASKS))  # task/group names
    task_dirs: list[str] = field(default_factory=list)  # more directories of lm_eval task yaml (local data)
    num_fewshot: int | None = None  # null: each task's own
    limit: int | None = None  # at most this many documents per task (null: all)
    batch_size: int = 8  # requests (or rolling windows) per forward
    max_length: int | None = None  # context in tokens; null: model.max_position_embeddings
    perplexity_file: str | None = None  # held-out text (.txt: a document a line; .jsonl: a `text` field)
    output: str | None = None  # eval.json path; null: <run dir>/eval.json for a checkpoint in a run
    seed: int = 1234  # few-shot sampling and do_sample tasks


def register_configs() -> None:
    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


register_configs()
