"""Export a model as a Mixtral (GQA) or DeepSeek-V3 (MLA) directory that transformers loads offline.

`moe.hf` converts models in memory; this writes config.json + model.safetensors (and, for a DeepSeek-V3 model
with multi-token-prediction depths, model-mtp.safetensors and the index naming both: moe.hf.mtp) +
generation_config.json + tokenizer files atomically (a temp dir renamed into place, so a
failure leaves nothing half-written).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from moe.data.tokenizer import chat_template_jinja, check_vocab, load_hf_tokenizer
from moe.errors import on_interrupt, write_errno, write_failed
from moe.model import MoETransformer
from moe.outputs import HF_EXPORT, check_output, mark, publish


def export_hf(model: MoETransformer, out_dir: str | Path, tokenizer, *, chat_template: str | None = None,
              overwrite: bool = False, reads: dict | None = None) -> Path:
    """Write a directory `AutoModelForCausalLM/AutoTokenizer.from_pretrained` load offline (the model's
    `model.hf_family`, which an import sets; else Mixtral, or DeepSeek-V3 for an MLA model).

    `tokenizer`: a transformers tokenizer or a directory holding one. Refuses (ConfigError)
    a model its transformers class cannot express before anything touches disk, and (UserError) an
    `out_dir` that overlaps what was read (`reads`: field -> path), lies in a run directory, or exists
    without being an export this product wrote (moe.outputs).
    """
    from moe.hf import to_hf
    from moe.hf.convert import write_extra

    out = check_output("export_hf", out_dir, HF_EXPORT, overwrite, reads or {})
    hf = to_hf(model)  # ConfigError for ALiBi, dense layers, shared expert, un-normalised top-k
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_hf_tokenizer(tokenizer)
    check_vocab(tokenizer, model.model_config.vocab_size, "tokenizer",
                getattr(tokenizer, "name_or_path", tokenizer))
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
        with on_interrupt(f"export_hf={out} was not written (its temporary directory was removed; an export "
                          "already there is as it was)"):
            hf.save_pretrained(str(tmp), safe_serialization=True)
            write_extra(model, tmp)  # what the transformers class does not hold (multi-token prediction)
            tokenizer.save_pretrained(str(tmp))
            mark(tmp, HF_EXPORT)
            publish(tmp, out, replace=overwrite)
    except Exception as err:  # safetensors wraps the file system's refusal in its own error
        if write_errno(err) is None:
            raise
        raise write_failed(out, err, field="export_hf", cleaned="its temporary directory was removed") \
            from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
