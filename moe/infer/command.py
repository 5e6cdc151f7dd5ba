"""What `infer.py` does: load a model (training checkpoint or Mixtral dir), then export it or generate.

Generation prints each completion and a tokens/s line; `export_hf=DIR` writes a Mixtral
directory instead. Everything a user can get wrong surfaces as a UserError.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from moe.config.choices import INFER_DTYPES
from moe.config.rules.entries import validate_infer
from moe.config.schema import DEFAULT_CHAT_TEMPLATE, TOKENIZER_TEMPLATE
from moe.data.text_formats import FormatSpec
from moe.data.tokenizer import check_vocab, load_hf_tokenizer, template_markers
from moe.data.tokenizer_chat import render
from moe.errors import UserError, first_line, on_interrupt
from moe.hf.families import exporter_for
from moe.infer.export import export_hf
from moe.infer.generate import Generation, generate, left_pad
from moe.infer.load import generation_eos_ids, model_from_checkpoint, model_from_hf_dir
from moe.inputs import read_text
from moe.model import MoETransformer
from moe.outputs import HF_EXPORT, atomic_path, check_apart, check_output
from moe.paths import local_path


@dataclass
class Loaded:
    """A model ready to generate, with the tokenizer and template it was trained with."""

    model: MoETransformer
    tokenizer: object  # transformers tokenizer
    tokenizer_dir: Path
    chat_template: str  # ours ({prompt}/{completion}) or `tokenizer` (the tokenizer's own, as trained)
    eos_ids: list[int] = field(default_factory=list)
    source: str = ""
    tokenizer_template: bool = False  # chat via tokenizer.apply_chat_template (an HF dir's own template)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError("device", name, "use auto, cpu, cuda or cuda:N", problem="is not a device") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device", name, "use device=cpu (or auto)",
                        problem="needs CUDA, which is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, INFER_DTYPES[name])


def training_tokenizer_dir(train_cfg: DictConfig, ckpt_path: Path) -> tuple[Path, list[str]]:
    """(tokenizer dir the run trained with, chat markers training added as special tokens)."""
    run_dir = ckpt_path.resolve().parent.parent
    if (run_dir / "tokenizer" / "tokenizer.json").is_file():
        return run_dir / "tokenizer", []
    data = train_cfg.get("data") or {}
    if data.get("kind") == "prepared" and data.get("path"):
        meta_file = local_path(data["path"]) / "meta.json"
        if meta_file.is_file():
            return meta_file.parent / json.loads(meta_file.read_text())["tokenizer"]["dir"], []
    if data.get("tokenizer"):
        markers = template_markers(data.get("chat_template") or "") if data.get("format") == "chat" else []
        return local_path(data["tokenizer"]), markers
    raise UserError("tokenizer", None, "pass tokenizer=DIR (the tokenizer the model was trained with)",
                    problem=f"cannot be found from {ckpt_path}'s data config")


def load(cfg) -> Loaded:
    """Model (eval, on cfg.device in cfg.dtype) + tokenizer from ckpt= or hf_dir=."""
    if bool(cfg.ckpt) == bool(cfg.hf_dir):
        raise UserError("ckpt", cfg.ckpt, "pass exactly one of ckpt=PATH (or ckpt=last) and hf_dir=DIR",
                        problem=f"and hf_dir={cfg.hf_dir!r} are both given" if cfg.ckpt else
                        "and hf_dir are both missing")
    markers: list[str] = []
    eos_ids: list[int] = []
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.ckpt:
        from moe.infer.load import resolve_checkpoint  # the checkpoint formats: imported for ckpt= only

        path = resolve_checkpoint(cfg.ckpt, cfg.runs_dir)
        model, train_cfg = model_from_checkpoint(path)
        if cfg.tokenizer:
            tok_dir, markers = local_path(cfg.tokenizer), []
        else:
            tok_dir, markers = training_tokenizer_dir(train_cfg, path)
        trained = (train_cfg.get("data") or {}).get("chat_template")
        template = cfg.chat_template or trained or DEFAULT_CHAT_TEMPLATE
        source, tok_field = str(path), "tokenizer" if cfg.tokenizer else "ckpt"
    else:
        hf_dir = Path(cfg.hf_dir).expanduser()
        model = model_from_hf_dir(hf_dir, dtype=dtype)  # read in the dtype it runs in
        tok_dir = local_path(cfg.tokenizer) if cfg.tokenizer else hf_dir
        template = cfg.chat_template or DEFAULT_CHAT_TEMPLATE
        eos_ids = generation_eos_ids(hf_dir)
        source, tok_field = str(hf_dir), "tokenizer" if cfg.tokenizer else "hf_dir"
    tokenizer = load_hf_tokenizer(tok_dir, field=tok_field)
    missing = [m for m in markers if m not in tokenizer.get_vocab()]
    if missing:  # training's chat format registered the template markers as special tokens
        tokenizer.add_special_tokens({"additional_special_tokens": missing})
    check_vocab(tokenizer, model.model_config.vocab_size, tok_field, tok_dir)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if template == TOKENIZER_TEMPLATE and not has_template:
        raise UserError("chat_template", template, f"add a chat_template to {tok_dir}/tokenizer_config.json, "
                        f"or pass chat_template={DEFAULT_CHAT_TEMPLATE!r} (a {{prompt}}/{{completion}} "
                        "template)",
                        problem=f"selects the tokenizer's own chat template, and {tok_dir} has none")
    # the tokenizer's template: what training rendered with (chat_template=tokenizer), or an hf_dir's own
    own_template = template == TOKENIZER_TEMPLATE or bool(cfg.hf_dir and not cfg.chat_template
                                                          and has_template)
    if tokenizer.eos_token_id is not None:
        eos_ids = [tokenizer.eos_token_id, *[i for i in eos_ids if i != tokenizer.eos_token_id]]
    model = model.to(device=device, dtype=dtype)
    return Loaded(model, tokenizer, Path(tok_dir), template, eos_ids, source, own_template)


def read_prompts(cfg) -> list[str]:
    """prompt= and/or prompts_file= (.txt: a prompt a line, blank lines skipped; .jsonl: a `prompt` field)."""
    prompts = [cfg.prompt] if cfg.prompt else []
    if cfg.prompts_file:
        path = Path(cfg.prompts_file).expanduser()
        if not path.is_file():
            raise UserError("prompts_file", cfg.prompts_file, "pass an existing .txt or .jsonl file",
                            problem="does not exist")
        text = read_text(path, "prompts_file", cfg.prompts_file)  # UTF-8; another encoding is named
        lines = [line for line in text.splitlines() if line.strip()]
        if path.suffix == ".jsonl":
            for number, line in enumerate(lines, 1):
                try:
                    prompt = json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise UserError("prompts_file", cfg.prompts_file, 'write one {"prompt": "..."} object a '
                                    "line", problem=f"has a line without a prompt field (line {number}: "
                                    f"{first_line(err)})") from err
                if not isinstance(prompt, str) or not prompt.strip():
                    raise UserError("prompts_file", cfg.prompts_file, "make every prompt a non-empty string",
                                    problem=f"has prompt {prompt!r} on line {number}, which is not text")
                prompts.append(prompt)
        else:
            prompts += lines
    if not prompts:
        raise UserError("prompt", cfg.prompt, 'pass prompt="..." or prompts_file=FILE (or export_hf=DIR)',
                        problem="is missing: nothing to generate from")
    return prompts


def check_output_file(output_file: str | None, reads: dict | None = None) -> None:
    """output_file can be written: its parent directory is made, and a directory, an unwritable place, a path
    the command reads (`reads`: field -> path; the prompts file, the checkpoint, the model or tokenizer
    directory) or a place in a training run are refused before anything is generated (a finished generation
    is never lost to it, and it never replaces what it was generated from)."""
    if not output_file:
        return
    path = Path(output_file).expanduser()
    if path.is_dir():
        raise UserError("output_file", output_file, "name a file, e.g. out/completions.jsonl",
                        problem="is a directory")
    check_apart("output_file", output_file, "completions", reads or {}, where="a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError("output_file", output_file, "pick a path this user can write",
                        problem=f"cannot be written: no directory for it ({first_line(err)})") from err
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise UserError("output_file", output_file, "pick a path this user can write",
                        problem="cannot be written (no write permission)")


def chat_prefix(prompt: str, template: str) -> str:
    """The training template up to the completion: what the model saw before the assistant's answer."""
    head, mid, _ = FormatSpec("chat", chat_template=template).template_parts
    return head + prompt + mid


def run(cfg) -> list[dict] | Path:
    """infer.py: export (returns the directory) or generate (returns one dict per prompt, also printed)."""
    from moe.checkpoint.trust import set_allow_pickle

    validate_infer(cfg)
    set_allow_pickle(cfg.allow_pickle)
    reads = {"ckpt": None if cfg.ckpt in (None, "last") else cfg.ckpt, "hf_dir": cfg.hf_dir,
             "tokenizer": cfg.tokenizer}
    if cfg.export_hf:  # before loading: a refused export wastes no time and touches nothing
        check_output("export_hf", cfg.export_hf, HF_EXPORT, cfg.overwrite, reads)
    else:  # before loading: the prompts, and that the results can be written
        prompts = read_prompts(cfg)
        check_output_file(cfg.output_file, {**reads, "prompts_file": cfg.prompts_file})
    loaded = load(cfg)
    if cfg.export_hf:
        reads["ckpt" if cfg.ckpt else "hf_dir"] = loaded.source  # ckpt=last resolved
        # the tokenizer's own template stays as it is; ours is written as a transformers template
        ours = None if loaded.chat_template == TOKENIZER_TEMPLATE else loaded.chat_template
        out = export_hf(loaded.model, cfg.export_hf, loaded.tokenizer, chat_template=ours,
                        overwrite=cfg.overwrite, reads=reads)
        hf_class = exporter_for(loaded.model.model_config).hf_class  # the registry's family for its attention
        print(f"exported {loaded.source} -> {out} (config.json, model.safetensors, tokenizer); load it with "
              f"transformers.{hf_class}.from_pretrained({str(out)!r})")
        return out
    if cfg.chat and loaded.tokenizer_template:  # a Mixtral-Instruct dir's [INST], or what training rendered
        texts = [render(loaded.tokenizer, [{"role": "user", "content": p}], generation_prompt=True)
                 for p in prompts]
    else:
        texts = [chat_prefix(p, loaded.chat_template) if cfg.chat else p for p in prompts]
    rendered = cfg.chat and loaded.tokenizer_template
    with on_interrupt(f"generation stopped; output_file={cfg.output_file} was not written" if cfg.output_file
                      else "generation stopped; nothing was written"):
        results, runs = generate_texts(loaded, texts, cfg, add_special_tokens=not rendered)
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        print(f"=== [{i}] {prompt}\n{res['completion']}")
    total, seconds = sum(g.num_new_tokens for g in runs), sum(g.seconds for g in runs)
    param = next(loaded.model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    print(f"--- {len(prompts)} prompt(s), {total} new tokens in {seconds:.2f} s: "
          f"{total / max(seconds, 1e-9):.1f} tokens/s ({loaded.model.model_config.name}, {dtype}, "
          f"{param.device}, "
          f"batch_size={cfg.batch_size}, prefill {sum(g.prefill_s for g in runs):.2f} s)")
    if cfg.output_file:
        with on_interrupt(f"output_file={cfg.output_file} was not written (no temporary file was left); the "
                          "completions are printed above"), atomic_path(cfg.output_file) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in results))
    return results


def new_tokens_that_fit(max_new_tokens: int, prompt_tokens: int, context: int) -> int:
    """max_new_tokens, capped (with a one-line note) so the prompt and its continuation stay within the
    model's context (model.max_position_embeddings): past it the positions are ones the model never had.
    A prompt that alone fills the context is refused."""
    if prompt_tokens >= context:
        raise UserError("prompt", f"{prompt_tokens} tokens", f"shorten the prompt below {context} tokens, or "
                        "use a model with a longer context (model.max_position_embeddings)",
                        problem=f"leaves no room to generate in model.max_position_embeddings={context}")
    fits = context - prompt_tokens
    if max_new_tokens > fits:
        print(f"note: max_new_tokens={max_new_tokens} capped to {fits}: a prompt of {prompt_tokens} tokens "
              f"plus {fits} new fill model.max_position_embeddings={context}, the model's context",
              file=sys.stderr)
    return min(max_new_tokens, fits)


def generate_texts(loaded: Loaded, texts: list[str], cfg,
                   add_special_tokens: bool = True) -> tuple[list[dict], list[Generation]]:
    """Tokenize, left-pad in batches of cfg.batch_size, generate, decode.

    add_special_tokens=False for text a chat template rendered (it already holds BOS and the like).
    """
    tok, model = loaded.tokenizer, loaded.model
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (loaded.eos_ids or [0])[0]
    greedy = cfg.greedy or cfg.temperature == 0
    gen = torch.Generator(next(model.parameters()).device).manual_seed(cfg.seed)
    results, runs = [], []
    for start in range(0, len(texts), cfg.batch_size):
        chunk = texts[start:start + cfg.batch_size]
        encoded = [tok(t, add_special_tokens=add_special_tokens)["input_ids"] for t in chunk]
        for text, ids in zip(chunk, encoded, strict=True):
            if not ids:
                raise UserError("prompt", text, "give a prompt with at least one token", problem="is empty")
        ids_BS, mask_BS = left_pad(encoded, pad_id)
        out: Generation = generate(
            model, ids_BS, mask_BS, max_new_tokens=new_tokens_that_fit(cfg.max_new_tokens, ids_BS.shape[1],
                                                                        model.model_config.max_position_embeddings),
            temperature=0.0 if greedy else cfg.temperature,
            top_k=cfg.top_k, top_p=cfg.top_p, eos_token_id=loaded.eos_ids if cfg.stop_at_eos else None,
            pad_token_id=pad_id, generator=gen, use_cache=cfg.use_cache, vocab_limit=len(tok))
        for text, ids, new in zip(chunk, encoded, out.tokens, strict=True):
            results.append({"prompt": text, "completion": tok.decode(new, skip_special_tokens=True),
                            "prompt_tokens": len(ids), "new_tokens": len(new), "tokens": new})
        runs.append(out)
    return results, runs

