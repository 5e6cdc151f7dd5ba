"""data_prep.py's, infer.py's and moe.eval's own keys (moe/config/data_prep.py PrepConfig, moe/config/infer.py
InferConfig, moe/config/eval.py EvalConfig); names are top level there."""
from __future__ import annotations

import math

from moe.config.choices import (
    BAD_ROW_POLICIES,
    DATA_FORMATS,
    INFER_DTYPES,
    PACKINGS,
)
from moe.config.rules.refusals import check_seed, finite_number, need, one_of
from moe.config.schema import DEFAULT_CHAT_TEMPLATE, TOKENIZER_TEMPLATE


def check_chat_template(field: str, template: str) -> None:
    if template == TOKENIZER_TEMPLATE:  # the tokenizer's own; whether it has one is checked where it loads
        return
    for slot in ("{prompt}", "{completion}"):
        need(template.count(slot) == 1, field, template,
             f"put {slot} exactly once in the template, e.g. {DEFAULT_CHAT_TEMPLATE!r}",
             f"must contain {slot} once")
    need(template.index("{prompt}") < template.index("{completion}"), field, template,
         "put {prompt} before {completion}", "has the completion before the prompt")


def validate_prep(cfg) -> None:
    """data_prep.py's keys (moe/config/data_prep.py PrepConfig); names are top level there."""
    check_seed("seed", cfg.seed)
    need(cfg.input not in (None, "", []), "input", cfg.input,
         "pass input=PATH (file, glob, directory) or a hub dataset name", "is required")
    one_of("format", cfg.format, DATA_FORMATS, "format")
    one_of("packing", cfg.packing, PACKINGS, "packing mode")
    one_of("on_bad_row", cfg.on_bad_row, BAD_ROW_POLICIES, "bad-row policy")
    need(cfg.seq_len >= 1, "seq_len", cfg.seq_len, "use a positive length, e.g. 2048", "is too small")
    finite_number("val_fraction", cfg.val_fraction, "use a fraction in [0, 1), e.g. 0.1")
    need(0.0 <= cfg.val_fraction < 1.0, "val_fraction", cfg.val_fraction,
         "use a fraction in [0, 1), e.g. 0.1", "is out of range")
    for key in ("num_proc", "batch_size"):
        need(getattr(cfg, key) >= 1, key, getattr(cfg, key), "use 1 or more", "must be positive")
    need(cfg.vocab_size is None or cfg.vocab_size > 256, "vocab_size", cfg.vocab_size,
         "use more than 256 (a byte-level BPE holds the 256 bytes and its special tokens), e.g. 32000",
         "is too small for a byte-level BPE")
    need((cfg.tokenizer is None) != (cfg.vocab_size is None), "tokenizer", cfg.tokenizer,
         "pass tokenizer=DIR (a directory with tokenizer.json) or vocab_size=N (train a byte-level BPE "
         "on the input), not both",
         "is required" if cfg.tokenizer is None else f"and vocab_size={cfg.vocab_size} are both set")
    if cfg.format == "chat":
        check_chat_template("chat_template", cfg.chat_template)
        need(cfg.chat_template != TOKENIZER_TEMPLATE or cfg.tokenizer is not None, "chat_template",
             cfg.chat_template, "pass tokenizer=DIR whose tokenizer_config.json has a chat_template, or set "
             f"chat_template to a {{prompt}}/{{completion}} template such as {DEFAULT_CHAT_TEMPLATE!r}",
             f"selects the tokenizer's own template, and vocab_size={cfg.vocab_size} trains a tokenizer "
             "that has none")
    else:
        need(not cfg.assistant_only_loss, "assistant_only_loss", True,
             "use format=chat, or set assistant_only_loss=false", f"needs format=chat, not {cfg.format}")


def validate_infer(cfg) -> None:
    """infer.py's sampling and dtype keys (moe/config/infer.py InferConfig)."""
    checks = [("max_new_tokens", cfg.max_new_tokens >= 0, "use 0 or more"),
              ("temperature", math.isfinite(cfg.temperature) and cfg.temperature >= 0,
               "use 0 (greedy) or a positive value such as 0.8"),
              ("top_k", cfg.top_k >= 0, "use 0 (off) or a positive count such as 50"),
              ("top_p", math.isfinite(cfg.top_p) and 0 < cfg.top_p <= 1, "use a value in (0, 1], 1 = off"),
              ("batch_size", cfg.batch_size >= 1, "use 1 or more")]
    for name, ok, fix in checks:
        need(ok, name, getattr(cfg, name), fix)
    check_seed("seed", cfg.seed)
    one_of("dtype", cfg.dtype, ("auto", *INFER_DTYPES), "dtype")


def validate_eval(cfg) -> None:
    """python -m moe.eval's counts and dtype (moe/config/eval.py EvalConfig)."""
    need(cfg.batch_size >= 1, "batch_size", cfg.batch_size, "use 1 or more")
    need(cfg.limit is None or cfg.limit >= 1, "limit", cfg.limit, "use null (every document) or 1 or more")
    need(cfg.num_fewshot is None or cfg.num_fewshot >= 0, "num_fewshot", cfg.num_fewshot,
         "use null (each task's own) or 0 or more")
    need(cfg.max_length is None or cfg.max_length >= 2, "max_length", cfg.max_length,
         "use null (model.max_position_embeddings) or 2 or more")
    check_seed("seed", cfg.seed)
    one_of("dtype", cfg.dtype, ("auto", *INFER_DTYPES), "dtype")
