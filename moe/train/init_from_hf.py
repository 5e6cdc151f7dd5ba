"""`model.init_from_hf=DIR` (a Mixtral or DeepSeek-V3 directory) and `model.upcycle_from_hf=DIR` (a dense
Mistral or Llama directory, every expert a copy of its MLP: moe/hf/dense.py): start training from it.

The architecture comes from DIR's config.json (applied to the config before validation; with
upcycling, model.num_experts and model.top_k stay the user's), the weights from its safetensors
(read tensor by tensor as each rank materialises its shard, Backend.initial_source), and a data
tokenizer whose ids disagree with DIR's is refused, since the model would read the wrong tokens.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig

from moe.config.rules.run import check_hf_start
from moe.errors import ConfigError, UserError
from moe.paths import local_path

# Architecture fields init_from_hf takes from config.json; name/compile/init_from_hf stay the user's.
KEEP_FROM_USER = ("name", "compile", "init_from_hf", "upcycle_from_hf", "upcycle_granularity")


def apply_init_from_hf(model: DictConfig, moe_opt, data: DictConfig, seed: int) -> str | None:
    """`model.init_from_hf=DIR` or `model.upcycle_from_hf=DIR`: replace the model section's architecture
    with DIR's config.json (in place, while the run settles its config; upcycling keeps the user's
    num_experts and top_k).

    When DIR carries a tokenizer, an unset `data.tokenizer` is pointed at it (returned: a note for
    the user), and a data tokenizer whose ids disagree with it is refused (the model would read the
    wrong tokens).
    """
    from moe.hf.convert import read_hf_config
    from moe.hf.dense import DenseUpcycle, read_dense_config
    from moe.hf.registry import converter_for

    check_hf_start(model, moe_opt)
    field = "model.upcycle_from_hf" if model.upcycle_from_hf else "model.init_from_hf"
    path = model.upcycle_from_hf or model.init_from_hf
    if not path:
        return None
    try:
        if field == "model.upcycle_from_hf":
            g = model.upcycle_granularity
            upcycler = DenseUpcycle(model.num_experts, model.top_k, g,
                                    granularity_field="model.upcycle_granularity")
            arch = asdict(upcycler.model_config(read_dense_config(path)))
        else:
            hf_config = read_hf_config(path, field)
            adapter = converter_for(hf_config.model_type)
            arch = asdict(adapter.model_config(hf_config))
    except ConfigError as err:
        if err.field == field:  # about the directory itself (no config.json): already says so
            raise
        raise UserError(field, str(path), err.fix, problem=f"has {err.field}={err.value!r}, "
                        f"which {err.problem}") from err
    if field == "model.init_from_hf":
        adapter.check_routing(hf_config, moe_opt, arch["top_k"])
    from moe.hf.tensors import check_weights_dir

    check_weights_dir(Path(path).expanduser(), field)  # at start-up: an LFS pointer, a cut-short file
    for key, value in arch.items():
        if key not in KEEP_FROM_USER:
            setattr(model, key, value)
    if field == "model.init_from_hf":
        check_weights_fit_config(model, moe_opt, seed, Path(path).expanduser(), field)
    if not (Path(path) / "tokenizer.json").is_file():
        return None  # the data module still checks that the data's ids fit model.vocab_size
    data_tok = _data_tokenizer_dir(data)
    if data_tok is None and data.kind != "prepared":
        data.tokenizer = str(path)
        return f"{field}: tokenizing data with {path}'s tokenizer (set data.tokenizer to override)"
    if data_tok is not None:
        _check_same_ids(data_tok, Path(path), data)
    return None


def check_weights_fit_config(model, moe_opt, seed: int, path: Path, field: str) -> None:
    """At start-up, before a run dir exists: the final norm and the routers of the first and last MoE layer
    read from DIR's safetensors in the shapes its config.json implies, so weights saved for another config
    (another expert count, width or depth) are refused here, not mid-run. Small tensors only."""
    from moe.hf import tensor_source
    from moe.model.model import state_shapes

    shapes = state_shapes(model, moe_opt)
    routers = [name for name in shapes if name.endswith("router.weight")]
    source = tensor_source(path, model, seed, field)
    for name in dict.fromkeys(["norm.weight", *routers[:1], *routers[-1:]]):
        source(name, shapes[name], None)


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

