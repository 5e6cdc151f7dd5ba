"""Typed schema of `data_prep.py`'s config (top-level keys), registered in Hydra's ConfigStore.

`conf/data_prep/data_prep.yaml` puts `data_prep_schema` first in its defaults, so an unknown key or a
wrong type fails at compose time. Value rules (formats, ranges) are checked by `check_prep`.
"""
# ruff: noqa: UP045  (OmegaConf structured configs want typing.Optional, as in moe/config.py)
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from moe.errors import UserError

DEFAULT_CHAT_TEMPLATE = "<|user|>\n{prompt}\n<|assistant|>\n{completion}"
FORMATS = ("text", "chat", "sentence")
PACKINGS = ("concat", "pad")
BAD_ROW_POLICIES = ("error", "skip")


@dataclass
class PrepConfig:
    """raw files -> tokenizer -> packed blocks -> Arrow dir + meta.json."""

    input: Any = None  # file, glob, directory (raw files or save_to_disk), list of those, or a hub name
    output: Optional[str] = None  # output directory (written to a temp path, renamed at the end)
    format: str = "text"  # text | chat | sentence
    text_column: str = "text"  # format=text: the column to read
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    assistant_only_loss: bool = False  # format=chat: loss only on assistant tokens
    tokenizer: Optional[str] = None  # tokenizer dir (tokenizer.json); or set vocab_size to train one
    vocab_size: Optional[int] = None  # train a byte-level BPE of this size on the input
    eos_token: Optional[str] = None  # null: tokenizer_config.json's, else <|endoftext|>, </s>, ...
    seq_len: int = 2048  # blocks hold seq_len + 1 tokens (inputs and shifted labels)
    packing: str = "concat"  # concat (group_texts, EOS between rows) | pad (one row a block, masked)
    val_fraction: float = 0.1  # share of rows held out for validation
    seed: int = 1234  # validation split seed
    on_bad_row: str = "error"  # error | skip (skips counted in meta.json)
    num_proc: int = 1  # processes for Dataset.map
    batch_size: int = 1000  # rows per map batch
    one_file_per_split: bool = False  # one Arrow file per split (seed 001) instead of ~500 MB shards
    split: Optional[str] = None  # split of a hub dataset / DatasetDict dir (null: train, or the only one)
    hub_config: Optional[str] = None  # hub dataset config name, e.g. sst2 for input=glue
    cache_dir: Optional[str] = None  # datasets cache for hub downloads (null: HF default)
    overwrite: bool = False  # replace an existing output directory


def check_prep(cfg: PrepConfig) -> None:
    """Value rules that a type check cannot express; each names the fix."""
    if cfg.input in (None, "", []):
        raise UserError("input", cfg.input, "pass input=PATH (file, glob, directory) or a hub dataset name",
                        problem="is required")
    if cfg.format not in FORMATS:
        raise UserError("format", cfg.format, f"use one of {', '.join(FORMATS)}",
                        problem="is not a known format")
    if cfg.packing not in PACKINGS:
        raise UserError("packing", cfg.packing, "use concat or pad", problem="is not a packing mode")
    if cfg.on_bad_row not in BAD_ROW_POLICIES:
        raise UserError("on_bad_row", cfg.on_bad_row, "use error or skip", problem="is not a policy")
    if cfg.seq_len < 1:
        raise UserError("seq_len", cfg.seq_len, "use a positive length, e.g. 2048", problem="is too small")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise UserError("val_fraction", cfg.val_fraction, "use a fraction in [0, 1), e.g. 0.1",
                        problem="is out of range")
    if cfg.num_proc < 1 or cfg.batch_size < 1:
        raise UserError("num_proc" if cfg.num_proc < 1 else "batch_size",
                        cfg.num_proc if cfg.num_proc < 1 else cfg.batch_size, "use 1 or more",
                        problem="must be positive")
    if (cfg.tokenizer is None) == (cfg.vocab_size is None):
        raise UserError("tokenizer", cfg.tokenizer, "pass tokenizer=DIR (a directory with tokenizer.json) or "
                        "vocab_size=N (train a byte-level BPE on the input), not both",
                        problem="is required" if cfg.tokenizer is None
                        else f"and vocab_size={cfg.vocab_size} are both set")
    if cfg.format == "chat":
        for slot in ("{prompt}", "{completion}"):
            if cfg.chat_template.count(slot) != 1:
                raise UserError("chat_template", cfg.chat_template,
                                f"put {slot} exactly once in the template, e.g. {DEFAULT_CHAT_TEMPLATE!r}",
                                problem=f"must contain {slot} once")
        if cfg.chat_template.index("{prompt}") > cfg.chat_template.index("{completion}"):
            raise UserError("chat_template", cfg.chat_template, "put {prompt} before {completion}",
                            problem="has the completion before the prompt")
    elif cfg.assistant_only_loss:
        raise UserError("assistant_only_loss", True, "use format=chat, or set assistant_only_loss=false",
                        problem=f"needs format=chat, not {cfg.format}")


def register_configs() -> None:
    ConfigStore.instance().store(name="data_prep_schema", node=PrepConfig)


register_configs()
