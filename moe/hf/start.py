"""`model.init_from_hf=DIR` (a Mixtral, DeepSeek-V3 or gpt-oss directory) and `model.upcycle_from_hf=DIR` (a
dense Mistral or Llama directory, every expert a copy of its MLP: moe/hf/dense.py): start training from it.

What the run settles from DIR (moe.train.run.settle) comes back as values, merged into a copy of the
config before validation: the model section's architecture from DIR's config.json (with upcycling,
model.num_experts and model.top_k stay the user's) and, when the data names no tokenizer, DIR's. The
weights come from its safetensors (read tensor by tensor as each rank materialises its shard,
Backend.initial_source). Refused at start-up: a DIR whose weights do not fit its config.json, and a data
tokenizer whose ids disagree with DIR's (the model would read the wrong tokens).
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

from moe.config.derived import is_moe_layer
from moe.errors import ConfigError, UserError
from moe.paths import local_path

# Architecture fields init_from_hf takes from config.json; name/compile/init_from_hf stay the user's.
KEEP_FROM_USER = ("name", "compile", "init_from_hf", "upcycle_from_hf", "upcycle_granularity")


class HFStart(NamedTuple):
    """What DIR settles: the model keys its config.json sets, the data keys it sets (data.tokenizer, when
    the data names none) and a note for the user (or None)."""

    model: dict
    data: dict
    note: str | None


def hf_start(model, moe_opt, data) -> HFStart:
    """`model.init_from_hf=DIR` or `model.upcycle_from_hf=DIR`: DIR's architecture as model keys (upcycling
    keeps the user's num_experts and top_k), refusing a DIR whose files are damaged or whose weights do not
    fit its config.json. When DIR carries a tokenizer, an unset `data.tokenizer` is pointed at it (with a
    note for the user), and a data tokenizer whose ids disagree with it is refused."""
    from moe.hf.convert import read_hf_config
    from moe.hf.dense import DenseUpcycle, read_dense_config
    from moe.hf.families import converter_for
    from moe.hf.tensors import check_weights_dir

    check_hf_start(model, moe_opt)
    field = "model.upcycle_from_hf" if model.upcycle_from_hf else "model.init_from_hf"
    path = model.upcycle_from_hf or model.init_from_hf
    if not path:
        return HFStart({}, {}, None)
    try:
        if field == "model.upcycle_from_hf":
            g = model.upcycle_granularity
            upcycler = DenseUpcycle(model.num_experts, model.top_k, g,
                                    granularity_field="model.upcycle_granularity")
            arch = upcycler.model_config(read_dense_config(path))
        else:
            hf_config = read_hf_config(path, field)
            adapter = converter_for(hf_config.model_type)
            arch = adapter.model_config(hf_config)
    except ConfigError as err:
        if err.field == field:  # about the directory itself (no config.json): already says so
            raise
        raise UserError(field, str(path), err.fix, problem=f"has {err.field}={err.value!r}, "
                        f"which {err.problem}") from err
    if field == "model.init_from_hf":
        adapter.check_routing(hf_config, moe_opt, arch.top_k)
    directory = Path(path).expanduser()
    if field == "model.init_from_hf":  # tensor_source checks DIR's files first (SafetensorsDir)
        mine = replace(arch, **{key: getattr(model, key) for key in KEEP_FROM_USER})
        check_weights_fit_config(mine, directory, field)
    else:
        check_weights_dir(directory, field)  # at start-up: an LFS pointer, a cut-short file
    changes = {key: value for key, value in asdict(arch).items() if key not in KEEP_FROM_USER}
    if not (Path(path) / "tokenizer.json").is_file():
        return HFStart(changes, {}, None)  # the data module still checks that the data's ids fit vocab_size
    data_tok = _data_tokenizer_dir(data)
    if data_tok is None and data.kind != "prepared":
        return HFStart(changes, {"tokenizer": str(path)},
                       f"{field}: tokenizing data with {path}'s tokenizer (set data.tokenizer to override)")
    if data_tok is not None:
        _check_same_ids(data_tok, Path(path), data)
    return HFStart(changes, {}, None)


def check_hf_start(model, moe_opt) -> None:
    """model.init_from_hf / upcycle_from_hf: one of them; fine-grained upcycling (granularity g) starts
    equal to the dense model only with the top-k weights scaled by g (moe/hf/dense.py)."""
    upcycle, g = model.upcycle_from_hf, model.upcycle_granularity
    if model.init_from_hf and upcycle:
        raise ConfigError("model.upcycle_from_hf", upcycle,
                          "set only one of model.init_from_hf (a Mixtral, DeepSeek-V3 or gpt-oss directory) "
                          "and model.upcycle_from_hf (a dense one)",
                          problem="is set together with model.init_from_hf")
    scaling = moe_opt.topk_scaling_factor
    if upcycle and g > 1 and scaling != g:
        raise ConfigError("moe_opt.topk_scaling_factor", scaling,
                          f"set moe_opt.topk_scaling_factor={g}: each of a copy's {g} slices then gets "
                          f"weight 1/{g} x {g}, and the start equals the dense model",
                          problem=f"does not match model.upcycle_granularity={g}")


def check_weights_fit_config(model, path: Path, field: str) -> None:
    """At start-up, before a run dir exists: the final norm and the routers of the first and last MoE layer
    read from DIR's safetensors in the shapes its config.json implies (`fit_shapes`), so weights saved for
    another config (another expert count, width or depth) are refused here, not mid-run. Small tensors
    only. (A Mixtral, DeepSeek-V3 or gpt-oss directory: no router is drawn from a seed.)"""
    from moe.hf.convert import tensor_source

    source = tensor_source(path, model, field=field)
    for name, shape in fit_shapes(model).items():
        source(name, shape, None)


def fit_shapes(model) -> dict[str, tuple]:
    """Our final norm's and the first and last MoE layer's routers' names and shapes in a model of `model`'s
    config, as its state_dict holds them (moe.model.model.MoETransformer: `norm`, `layers.i.ffn.router`)."""
    moe = [i for i in range(model.num_layers) if is_moe_layer(i, model)]
    routers = {f"layers.{i}.ffn.router.weight": (model.num_experts, model.hidden_size)
               for i in dict.fromkeys(moe[:1] + moe[-1:])}
    return {"norm.weight": (model.hidden_size,), **routers}


def _data_tokenizer_dir(data) -> Path | None:
    if data.get("kind") == "prepared" and data.get("path"):
        meta = local_path(data.path) / "meta.json"
        return meta.parent / json.loads(meta.read_text())["tokenizer"]["dir"] if meta.is_file() else None
    return local_path(data.tokenizer) if data.get("tokenizer") else None


def _check_same_ids(data_tok: Path, model_tok: Path, data) -> None:
    """Every token of the data's tokenizer must have the same id in the model's (chat markers may be new)."""
    from moe.data.tokenizer import read_tokenizer, template_markers

    ours = read_tokenizer(data_tok, "data.tokenizer")[0].get_vocab(with_added_tokens=True)
    theirs = read_tokenizer(model_tok, "model's directory")[0].get_vocab(with_added_tokens=True)
    markers = set(template_markers(data.get("chat_template") or ""))
    new_marker = markers - set(theirs)  # training adds these as special tokens; absent is fine
    clash = [t for t, i in ours.items() if theirs.get(t) != i and t not in new_marker]
    if clash:
        field = "data.path" if data.get("kind") == "prepared" else "data.tokenizer"
        fix = ("re-run data_prep.py with tokenizer=" if field == "data.path" else "set data.tokenizer=")
        raise UserError(field, str(data_tok), f"{fix}{model_tok} (the model's own tokenizer)",
                        problem=f"gives {len(clash)} tokens ids that differ from {model_tok}'s tokenizer "
                        f"(e.g. {clash[:3]}): the model would read the wrong tokens")
