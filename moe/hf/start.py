"""`model.init_from_hf=DIR` (a directory of a family moe.hf.families converts) and
`model.upcycle_from_hf=DIR` (a dense Mistral or Llama directory, every expert a copy of its MLP:
moe/hf/dense.py): start training from it.

What the run settles from DIR (moe.train.run.settle) comes back as values, merged into a copy of the
config before validation: the model section's architecture from DIR's config.json (with upcycling,
model.num_experts and model.top_k stay the user's) and, when the data names no tokenizer, DIR's. The
weights come from its safetensors (read tensor by tensor as each rank materialises its shard,
Backend.initial_source). Refused at start-up: a DIR whose weights do not fit its config.json
(moe.hf.tensors.check_weights), and a data tokenizer whose ids disagree with DIR's (the model would read
the wrong tokens: moe.data.tokenizer.check_same_ids).
"""
from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

from moe.config.derived import is_moe_layer
from moe.errors import ConfigError, UserError
from moe.hf.tensors import TOP_LEVEL

# Architecture fields init_from_hf takes from config.json; name/compile/init_from_hf stay the user's, and so
# do the multi-token-prediction depths trained (up to those DIR holds: mtp_start)
KEEP_FROM_USER = ("name", "compile", "init_from_hf", "upcycle_from_hf", "upcycle_granularity", "mtp_layers",
                  "mtp_loss_weight")


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
    from moe.data.tokenizer import check_same_ids, data_tokenizer_dir
    from moe.hf.dense import DenseUpcycle, read_dense_config
    from moe.hf.families import converter_for, read_hf_config
    from moe.hf.tensors import check_weights

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
    if field == "model.init_from_hf":  # DIR's files, then a few tensors in the shapes its config implies
        mine = replace(arch, **{key: getattr(model, key) for key in KEEP_FROM_USER})
        check_weights(directory, field, fit_tensors(mine, adapter.router_key))
    else:
        check_weights(directory, field)  # at start-up: an LFS pointer, a cut-short file
    changes = {key: value for key, value in asdict(arch).items() if key not in KEEP_FROM_USER}
    mtp_note = mtp_start(model, adapter, hf_config, directory) if field == "model.init_from_hf" else None
    if not (Path(path) / "tokenizer.json").is_file():
        return HFStart(changes, {}, mtp_note)  # the data module still checks the data's ids fit vocab_size
    data_tok = data_tokenizer_dir(data)
    if data_tok is None and data.kind != "prepared":
        note = f"{field}: tokenizing data with {path}'s tokenizer (set data.tokenizer to override)"
        return HFStart(changes, {"tokenizer": str(path)}, "\n".join(filter(None, [mtp_note, note])))
    if data_tok is not None:
        check_same_ids(data_tok, Path(path), data)
    return HFStart(changes, {}, mtp_note)


def mtp_start(model, adapter, hf_config, directory: Path) -> str | None:
    """model.mtp_layers with model.init_from_hf: the depths trained start from DIR's (moe.hf.mtp), so at most
    the ones DIR holds (else a UserError); a note naming those DIR holds and the run leaves out."""
    from moe.hf.tensors import SafetensorsDir

    field = "model.init_from_hf"
    held = adapter.mtp_depths(hf_config, SafetensorsDir(directory, field).file_of)
    if model.mtp_layers > held:
        raise UserError(field, str(directory), f"set model.mtp_layers={held} (or fewer), or start from a "
                        f"directory that holds {model.mtp_layers}",
                        problem=f"holds {held} multi-token-prediction layer(s), and model.mtp_layers="
                                f"{model.mtp_layers} starts that many from it")
    if held <= model.mtp_layers:
        return None
    first = hf_config.num_hidden_layers + model.mtp_layers
    layers = ", ".join(f"model.layers.{i}.*" for i in range(first, hf_config.num_hidden_layers + held))
    return (f"{field}: {directory} holds {held} multi-token-prediction layer(s); model.mtp_layers="
            f"{model.mtp_layers} trains {model.mtp_layers}, so {layers} are not read (set model.mtp_layers="
            f"{held} to train them with the loss weight model.mtp_loss_weight)")


def check_hf_start(model, moe_opt) -> None:
    """model.init_from_hf / upcycle_from_hf: one of them; fine-grained upcycling (granularity g) starts
    equal to the dense model only with the top-k weights scaled by g (moe/hf/dense.py)."""
    upcycle, g = model.upcycle_from_hf, model.upcycle_granularity
    if model.init_from_hf and upcycle:
        raise ConfigError("model.upcycle_from_hf", upcycle,
                          "set only one of model.init_from_hf (a Mixtral, DeepSeek-V3, gpt-oss, Qwen-MoE or "
                          "OLMoE directory) and model.upcycle_from_hf (a dense one)",
                          problem="is set together with model.init_from_hf")
    scaling = moe_opt.topk_scaling_factor
    if upcycle and g > 1 and scaling != g:
        raise ConfigError("moe_opt.topk_scaling_factor", scaling,
                          f"set moe_opt.topk_scaling_factor={g}: each of a copy's {g} slices then gets "
                          f"weight 1/{g} x {g}, and the start equals the dense model",
                          problem=f"does not match model.upcycle_granularity={g}")


def fit_tensors(model, router_key: str) -> dict[str, tuple[str, tuple]]:
    """Our final norm and the first and last MoE layer's routers in a model of `model`'s config, by our
    names (moe.model.model.MoETransformer: `norm`, `layers.i.ffn.router`): each one's key in the family's
    files (`router_key`: ExportAdapter.router_key) and its shape."""
    moe = [i for i in range(model.num_layers) if is_moe_layer(i, model)]
    routers = {f"layers.{i}.ffn.router.weight": (f"model.layers.{i}.{router_key}",
                                                 (model.num_experts, model.hidden_size))
               for i in dict.fromkeys(moe[:1] + moe[-1:])}
    return {"norm.weight": (TOP_LEVEL["norm.weight"], (model.hidden_size,)), **routers}
