"""Tokenizer directories: load, train a byte-level BPE, register special tokens, save.

A tokenizer directory holds `tokenizer.json` plus the two small files that let
`transformers.AutoTokenizer.from_pretrained(dir)` load it offline, so training,
inference and export all read the same bytes. Its identity is the sha256 of
`tokenizer.json`. `read_tokenizer` opens one with the `tokenizers` library (data
preparation); `load_hf_tokenizer` with transformers (generation, export); a run keeps a
copy of its tokenizer beside its checkpoints (`copy_tokenizer_files`).
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moe.data.text_formats import TURN_SEPARATOR, FormatSpec
from moe.errors import UserError
from moe.inputs import load_json
from moe.outputs import atomic_path
from moe.paths import local_path

EOS = "<|endoftext|>"
PAD = "<|pad|>"
EOS_CANDIDATES = (EOS, "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[SEP]")
PAD_CANDIDATES = (PAD, "<pad>", "[PAD]")
MARKER_RE = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def template_markers(template: str) -> list[str]:
    """Special-token markers (`<|name|>`) in a chat template, in order of appearance."""
    return list(dict.fromkeys(MARKER_RE.findall(template)))


def tokenizer_file(path: str | Path, field: str = "tokenizer") -> Path:
    """`path`'s tokenizer.json (`path`: a directory holding one, or the file)."""
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(field, str(path), "pass a directory holding a Hugging Face tokenizer.json "
                        "(e.g. data/sample), or vocab_size=N to train one", problem="has no tokenizer.json")
    return file


def load_tokenizer(path: str | Path, field: str = "tokenizer") -> Tokenizer:
    """The tokenizer of `path` (a directory with tokenizer.json, or the file), without its config."""
    file = tokenizer_file(path, field)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise UserError(field, str(file), "pass a valid Hugging Face tokenizer.json",
                        problem=f"could not be loaded ({err})") from err


def read_tokenizer(path: str | Path, field: str = "tokenizer") -> tuple[Tokenizer, dict]:
    """Load `path` (a directory with tokenizer.json, or the file) and its tokenizer_config.json."""
    path = Path(path).expanduser()
    file = tokenizer_file(path, field)
    tok = load_tokenizer(file, field)
    config_file = file.parent / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        fix = ("restore tokenizer_config.json, or delete it (the end-of-text token is then looked up in the "
               "vocabulary, or given as eos_token=TOKEN)")
        config = load_json(config_file, field, str(path), fix)
        if not isinstance(config, dict):
            raise UserError(field, str(path), fix, problem=f"cannot be read: {config_file} holds a JSON "
                            f"{type(config).__name__}, not an object")
    return tok, config


def data_tokenizer_dir(data) -> Path | None:
    """The tokenizer directory the data section names: data.tokenizer, or a prepared dataset's own (its
    meta.json's; a mixture's sources share the first one's); None when it names none (or the prepared
    dataset is not there yet)."""
    path = data.sources[0].path if data.get("sources") else data.get("path")
    if data.get("kind") == "prepared" and path:
        meta = local_path(path) / "meta.json"
        return meta.parent / json.loads(meta.read_text())["tokenizer"]["dir"] if meta.is_file() else None
    return local_path(data.tokenizer) if data.get("tokenizer") else None


def check_same_ids(data_tok: Path, model_tok: Path, data) -> None:
    """Every token of the data's tokenizer (`data_tok`) must have the same id in the model's (chat markers
    may be new: training adds them)."""
    ours = load_tokenizer(data_tok, "data.tokenizer").get_vocab(with_added_tokens=True)
    theirs = load_tokenizer(model_tok, "model's directory").get_vocab(with_added_tokens=True)
    markers = set(template_markers(data.get("chat_template") or ""))
    new_marker = markers - set(theirs)  # training adds these as special tokens; absent is fine
    clash = [t for t, i in ours.items() if theirs.get(t) != i and t not in new_marker]
    if clash:
        field = "data.path" if data.get("kind") == "prepared" else "data.tokenizer"
        fix = ("re-run data_prep.py with tokenizer=" if field == "data.path" else "set data.tokenizer=")
        raise UserError(field, str(data_tok), f"{fix}{model_tok} (the model's own tokenizer)",
                        problem=f"gives {len(clash)} tokens ids that differ from {model_tok}'s tokenizer "
                        f"(e.g. {clash[:3]}): the model would read the wrong tokens")


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def vocab_size(tok: Tokenizer) -> int:
    """Embedding rows needed: one past the largest id, added tokens included."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def find_token(tok: Tokenizer, config: dict, key: str, candidates: Iterable[str],
               override: str | None = None) -> str | None:
    """The token named by `override`, else tokenizer_config.json's `key`, else the first known name."""
    vocab = tok.get_vocab(with_added_tokens=True)
    for name in (override, _token_text(config.get(key)), *candidates):
        if name and name in vocab:
            return name
    if override:
        raise UserError("eos_token", override, f"pick a token that is in the vocabulary, e.g. one of "
                        f"{[c for c in EOS_CANDIDATES if c in vocab] or 'none found'}",
                        problem="is not in the tokenizer's vocabulary")
    return None


def add_special_tokens(tok: Tokenizer, tokens: Iterable[str]) -> list[str]:
    """Register `tokens` as special tokens (never split, never merged); returns the ones that were new."""
    vocab = tok.get_vocab(with_added_tokens=True)
    new = [t for t in tokens if t not in vocab]
    # Already-present markers must still be special, or BPE would split them in text.
    tok.add_special_tokens(list(dict.fromkeys(tokens)))
    return new


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str], length: int | None = None,
              show_progress: bool = True) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) whose vocabulary, specials included, has `vocab_size` entries."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise UserError("vocab_size", vocab_size, f"use at least {len(alphabet) + len(special_tokens)} "
                        f"(256 bytes + {len(special_tokens)} special tokens)", problem="is too small")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=alphabet, show_progress=show_progress)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, eos: str | None, pad: str | None,
                   model_max_length: int | None = None, config_extra: dict | None = None) -> str:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json; returns the sha256.
    `config_extra`: more tokenizer_config.json keys (the chat template training rendered with, its BOS)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    specials = {k: v for k, v in (("eos_token", eos), ("pad_token", pad)) if v}
    extra = [t.content for t in tok.get_added_tokens_decoder().values()
             if t.special and t.content not in specials.values()]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **specials, "additional_special_tokens": extra}
    if model_max_length:
        config["model_max_length"] = model_max_length
    config.update(config_extra or {})
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({**specials, "additional_special_tokens": extra}, indent=2) + "\n")
    return file_sha256(out_dir / "tokenizer.json")


# -- transformers tokenizers (generation and export) -----------------------------------------


def load_hf_tokenizer(path: str | Path, field: str = "tokenizer"):
    """transformers tokenizer from a local directory (tokenizer.json + config), never the hub."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise UserError(field, str(path), "point to a directory holding tokenizer.json, or pass "
                        "tokenizer=DIR (the tokenizer the model was trained with)",
                        problem="has no tokenizer.json")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types for broken files
        raise UserError(field, str(path), "pass a directory that transformers.AutoTokenizer can load",
                        problem=f"could not be loaded ({str(err).splitlines()[0][:200]})") from err


def check_vocab(tokenizer, vocab_size: int, field: str, path) -> None:
    """A tokenizer may have fewer ids than the embedding (padding rows), never more."""
    n = len(tokenizer)
    if n > vocab_size:
        raise UserError(field, str(path), "use the tokenizer the model was trained with (at most "
                        f"{vocab_size} tokens), or train with this one so model.vocab_size covers it",
                        problem=f"has {n} tokens but the model's vocab_size is {vocab_size}")


def chat_template_jinja(template: str) -> str:
    """Our `{prompt}`/`{completion}` template as a transformers chat template (same text as training).

    System messages join the next user prompt, turns are separated as in moe.data.text_formats;
    a user turn ends with the template's assistant header, so generation starts right after it.
    """
    head, mid, tail = FormatSpec("chat", chat_template=template).template_parts
    q = json.dumps  # a JSON string literal is a valid Jinja string literal
    return (
        "{%- set ns = namespace(system='', first=true) -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\\n' -%}"
        f"{{%- elif m['role'] == 'user' -%}}{{{{ ('' if ns.first else {q(TURN_SEPARATOR)}) + {q(head)}"
        f" + ns.system + m['content'] + {q(mid)} }}}}"
        "{%- set ns.system = '' -%}{%- set ns.first = false -%}"
        f"{{%- elif m['role'] == 'assistant' -%}}{{{{ m['content'] + {q(tail)} }}}}"
        "{%- endif -%}{%- endfor -%}"
    )


TOKENIZER_EXTRAS = {"special_tokens_map.json", "chat_template.jinja", "added_tokens.json"}


def copy_tokenizer_files(source: str | Path, target: str | Path) -> None:
    """Copy a tokenizer directory's files (tokenizer*.json and their companions) into `target`."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for path in Path(source).iterdir():
        if path.is_file() and (path.name.startswith("tokenizer") or path.name in TOKENIZER_EXTRAS):
            with atomic_path(target / path.name) as tmp:  # infer never reads half a tokenizer.json
                shutil.copy2(path, tmp)
