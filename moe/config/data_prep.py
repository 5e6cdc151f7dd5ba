"""Typed schema of `data_prep.py`'s config (top-level keys), registered in Hydra's ConfigStore.

`conf/data_prep/data_prep.yaml` puts `data_prep_schema` first in its defaults, so an unknown key or a
wrong type fails at compose time. Value rules (formats, ranges) are `moe.config.rules.entries.validate_prep`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

from hydra.core.config_store import ConfigStore

from moe.config.choices import BadRowPolicy, DataFormat, Packing
from moe.config.schema import DEFAULT_CHAT_TEMPLATE


@dataclass
class PrepConfig:
    """raw files -> tokenizer -> packed blocks -> Arrow dir + meta.json."""

    input: Any = None  # file, glob, directory (raw files or save_to_disk), list of those, or a hub name
    output: Optional[str] = None  # output directory (written to a temp path, renamed at the end)
    format: Annotated[str, DataFormat] = "text"
    text_column: str = "text"  # format=text: the column to read
    chat_template: str = DEFAULT_CHAT_TEMPLATE  # {prompt}/{completion} text, or `tokenizer`: its own
    assistant_only_loss: bool = False  # format=chat: loss only on assistant tokens
    tokenizer: Optional[str] = None  # tokenizer dir (tokenizer.json); or set vocab_size to train one
    vocab_size: Optional[int] = None  # train a byte-level BPE of this size on the input
    eos_token: Optional[str] = None  # null: tokenizer_config.json's, else <|endoftext|>, </s>, ...
    seq_len: int = 2048  # blocks hold seq_len + 1 tokens (inputs and shifted labels)
    # concat (group_texts, EOS between rows) | pad (one row a block, masked)
    packing: Annotated[str, Packing] = "concat"
    val_fraction: float = 0.1  # share of rows held out for validation
    seed: int = 1234  # validation split seed
    # error | skip (bad rows dropped) | repair (undecodable bytes replaced by U+FFFD, other bad rows dropped);
    # both counted in meta.json
    on_bad_row: Annotated[str, BadRowPolicy] = "error"
    num_proc: int = 1  # processes for Dataset.map
    batch_size: int = 1000  # rows per map batch
    one_file_per_split: bool = False  # one Arrow file per split (Llama 2 7B trn1 recipe), not ~500 MB shards
    split: Optional[str] = None  # split of a hub dataset / DatasetDict dir (null: train, or the only one)
    hub_config: Optional[str] = None  # hub dataset config name, e.g. sst2 for input=glue
    cache_dir: Optional[str] = None  # datasets cache for hub downloads (null: HF default)
    overwrite: bool = False  # replace an existing output directory


def register_configs() -> None:
    ConfigStore.instance().store(name="data_prep_schema", node=PrepConfig)


register_configs()
