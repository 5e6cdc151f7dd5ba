"""Mixtral-format directories on disk: export ours, import theirs, start training from one.

`moe.hf` converts models in memory; this module deals with directories: it writes
config.json + model.safetensors + generation_config.json + tokenizer files atomically
(a temp dir renamed into place, so a failure leaves nothing half-written), loads a
directory for generation, and wires `model.init_from_hf=DIR` into training (the
architecture comes from DIR's config.json, the weights from its safetensors).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, fields
from pathlib import Path

from omegaconf import DictConfig

from moe.config import ModelConfig
from moe.data.formats import TURN_SEPARATOR, FormatSpec
from moe.errors import ConfigError, UserError
from moe.model import MoETransformer

# Architecture fields init_from_hf takes from config.json; name/compile/init_from_hf stay the user's.
KEEP_FROM_USER = ("name", "compile", "init_from_hf")


# ----------------------------------------------------------------------------- tokenizers


def load_tokenizer(path: str | Path, field: str = "tokenizer"):
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

    System messages join the next user prompt, turns are separated as in moe.data.formats;
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


# ----------------------------------------------------------------------------- export


def export_hf(model: MoETransformer, out_dir: str | Path, tokenizer, *, chat_template: str | None = None,
              overwrite: bool = False) -> Path:
    """Write a directory `MixtralForCausalLM/AutoTokenizer.from_pretrained` load offline.

    `tokenizer`: a transformers tokenizer or a directory holding one. Refuses (ConfigError)
    a model Mixtral cannot express before anything touches disk.
    """
    from moe.hf import to_hf

    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError("export_hf", str(out), "choose a new directory, or add overwrite=true to replace it",
                        problem="already exists and is not empty")
    hf = to_hf(model)  # ConfigError for ALiBi, dense layers, shared expert, un-normalised top-k
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    check_vocab(tokenizer, model.cfg.vocab_size, "tokenizer", getattr(tokenizer, "name_or_path", tokenizer))
    if chat_template:
        tokenizer.chat_template = chat_template_jinja(chat_template)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, key)
        setattr(hf.config, key, value)
        setattr(hf.generation_config, key, value)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- import


def _read_hf_config(path: str | Path, field: str):
    from transformers import AutoConfig

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(field, str(path), "point to a local directory written by save_pretrained "
                        "(config.json + safetensors); hub names are not downloaded",
                        problem="has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise UserError(field, str(path), "fix or regenerate config.json",
                        problem=f"has a config.json transformers cannot read ({first})") from err
    if config.model_type != "mixtral":
        raise UserError(field, str(path), "convert a Mixtral checkpoint (model_type mixtral, "
                        "MixtralForCausalLM)",
                        problem=f"holds model_type={config.model_type!r}, not mixtral")
    return config


def model_from_hf_dir(path: str | Path, field: str = "hf_dir", moe_opt=None) -> MoETransformer:
    """MoETransformer (eval) from a Mixtral directory; dropless routing as Mixtral computes it."""
    from moe.hf import from_hf

    _read_hf_config(path, field)
    try:
        return from_hf(Path(path).expanduser(), moe_opt=moe_opt).eval()
    except (OSError, KeyError, RuntimeError) as err:
        first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise UserError(field, str(path), "point to a complete save_pretrained directory (config.json and "
                        "its model*.safetensors)", problem=f"could not be loaded ({first})") from err


def generation_eos_ids(path: str | Path) -> list[int]:
    """eos_token_id(s) from generation_config.json / config.json, when the directory names them."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            ids += [value] if isinstance(value, int) else list(value or [])
    return list(dict.fromkeys(ids))


# ----------------------------------------------------------------------------- fine-tuning


def apply_init_from_hf(cfg: DictConfig) -> None:
    """`model.init_from_hf=DIR`: replace cfg.model's architecture with DIR's config.json (in place).

    When DIR carries a tokenizer, an unset `data.tokenizer` is pointed at it, and a data
    tokenizer whose ids disagree with it is refused (the model would read the wrong tokens).
    """
    from moe.hf import model_config_from_hf

    path = cfg.model.init_from_hf
    if not path:
        return
    try:
        arch = asdict(model_config_from_hf(_read_hf_config(path, "model.init_from_hf")))
    except ConfigError as err:
        raise UserError("model.init_from_hf", str(path), err.fix, problem=f"has {err.field}={err.value!r}, "
                        f"which {err.problem}") from err
    for key, value in arch.items():
        if key not in KEEP_FROM_USER:
            cfg.model[key] = value
    if not (Path(path) / "tokenizer.json").is_file():
        return  # the data module still checks that the data's ids fit model.vocab_size
    data_tok = _data_tokenizer_dir(cfg.data)
    if data_tok is None and cfg.data.get("kind") != "prepared":
        cfg.data.tokenizer = str(path)
        print(f"init_from_hf: tokenizing data with {path}'s tokenizer (set data.tokenizer to override)")
    elif data_tok is not None:
        _check_same_ids(data_tok, Path(path), cfg.data)


def local_path(path: str | Path) -> Path:
    """A relative path missing from the working directory is tried against the repo root (as training)."""
    p = Path(path).expanduser()
    root = Path(__file__).resolve().parents[1]
    return p if p.exists() or p.is_absolute() or not (root / p).exists() else root / p


def _data_tokenizer_dir(data) -> Path | None:
    if data.get("kind") == "prepared" and data.get("path"):
        meta = local_path(data.path) / "meta.json"
        return meta.parent / json.loads(meta.read_text())["tokenizer"]["dir"] if meta.is_file() else None
    return local_path(data.tokenizer) if data.get("tokenizer") else None


def _check_same_ids(data_tok: Path, model_tok: Path, data) -> None:
    """Every token of the data's tokenizer must have the same id in the model's (chat markers may be new)."""
    from moe.data.tokenizer import load_tokenizer as load_raw
    from moe.data.tokenizer import template_markers

    ours = load_raw(data_tok, "data.tokenizer")[0].get_vocab(with_added_tokens=True)
    theirs = load_raw(model_tok, "model.init_from_hf")[0].get_vocab(with_added_tokens=True)
    markers = set(template_markers(data.get("chat_template") or ""))
    new_marker = markers - set(theirs)  # training adds these as special tokens; absent is fine
    clash = [t for t, i in ours.items() if theirs.get(t) != i and t not in new_marker]
    if clash:
        field = "data.path" if data.get("kind") == "prepared" else "data.tokenizer"
        fix = ("re-run data_prep.py with tokenizer=" if field == "data.path" else "set data.tokenizer=")
        raise UserError(field, str(data_tok), f"{fix}{model_tok} (the model's own tokenizer)",
                        problem=f"gives {len(clash)} tokens ids that differ from {model_tok}'s tokenizer "
                        f"(e.g. {clash[:3]}): the model would read the wrong tokens")


def load_hf_weights(model: MoETransformer, path: str | Path) -> None:
    """Copy DIR's weights into `model` (built from apply_init_from_hf's config), casting to its dtype."""
    src = model_from_hf_dir(path, "model.init_from_hf", moe_opt=model.moe_opt)
    diff = {f.name: (getattr(src.cfg, f.name), getattr(model.cfg, f.name)) for f in fields(ModelConfig)
            if f.name not in KEEP_FROM_USER and getattr(src.cfg, f.name) != getattr(model.cfg, f.name)}
    if diff:
        raise UserError("model.init_from_hf", str(path), "leave the model.* architecture fields to the "
                        "directory's config.json (only name and compile are yours)",
                        problem=f"does not match the configured model: {diff} (directory vs config)")
    model.load_state_dict(src.state_dict(), strict=True)
