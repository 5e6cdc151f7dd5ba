"""The contract of a Hugging Face model family's adapter (torchtitan's StateDictAdapter, one per model).

Reading (every adapter, `HFAdapter`):
    model_config(hf_config) -> ModelConfig        our architecture for the checkpoint's (or a refusal)
    moe_opt(hf_config) -> MoEOptConfig            routing as the checkpoint computes it (dropless)
    check_routing(hf_config, moe_opt)             a user's moe_opt must choose experts as the checkpoint
                                                  was trained to (the fields in `routing_keys`)
    reader(model_cfg, hf_config) -> Read          read(name, get, experts=None): our tensor `name` from
                                                  the checkpoint's per-expert keys, experts a range
    loading_class(hf_config)                      the transformers class from_hf loads a directory with
    note(hf_config, keys) -> str | None           what a directory holds that is not read (said once)
Writing (the families we export to, `ExportAdapter`):
    check_exportable(cfg, moe_opt)                refuse what the transformers class cannot reproduce
    hf_config(cfg, moe_opt)                       its transformers config
    state_dict(model) -> dict                     our weights under transformers 5.x's keys (stacked)
    per_expert(sd, num_layers) -> dict            5.x's stacked experts -> 4.x's / the files' keys
    model_class()                                 the transformers class (MixtralForCausalLM, ...)

`hf_config` is a transformers config object or its config.json as a dict (tensors.config_value
reads either). The adapters are registered by model_type in moe/hf/families.py.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from moe.config.derived import window_of
from moe.config.schema import ModelConfig, MoEOptConfig, normalizes
from moe.errors import ConfigError

Read = Callable[..., torch.Tensor]  # read(name, get, experts: range | None = None)


class HFAdapter(ABC):
    """One transformers model family, read into our model."""

    model_types: ClassVar[tuple[str, ...]]
    routing_keys: ClassVar[tuple[str, ...]] = ()  # moe_opt fields the checkpoint's router fixes

    @abstractmethod
    def model_config(self, hf_config) -> ModelConfig:
        ...

    @abstractmethod
    def moe_opt(self, hf_config) -> MoEOptConfig:
        ...

    @abstractmethod
    def reader(self, model_cfg, hf_config) -> Read:
        ...

    def loading_class(self, hf_config):
        """The transformers class `from_hf` loads a directory of this family with."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def note(self, hf_config, keys) -> str | None:
        """A line for the user about the checkpoint's tensors (`keys`) that the import leaves unread."""
        return None

    def check_routing(self, hf_config, moe_opt, top_k: int) -> None:
        """model.init_from_hf: the user's moe_opt must route as the checkpoint does, else the loaded
        experts are chosen differently from how they were trained."""
        want = self.moe_opt(hf_config)
        for key in self.routing_keys:
            have, theirs = getattr(moe_opt, key), getattr(want, key)
            if key == "normalize_top_k":
                have, theirs = normalizes(have, top_k), normalizes(theirs, top_k)
            if have != theirs:
                fix = ", ".join(f"moe_opt.{k}={_yaml(getattr(want, k))}" for k in self.routing_keys)
                family = self.model_types[0]
                raise ConfigError(f"moe_opt.{key}", getattr(moe_opt, key),
                                  f"route as the checkpoint does: {fix}",
                                  f"differs from the {family} checkpoint's routing ({_yaml(theirs)})")


class ExportAdapter(HFAdapter):
    """A family we also write: our model -> its transformers class."""

    hf_class: ClassVar[str]
    router_key: ClassVar[str]  # layer i's router in its files: model.layers.{i}.<router_key>

    @abstractmethod
    def check_exportable(self, cfg: ModelConfig, moe_opt: MoEOptConfig) -> None:
        ...

    @abstractmethod
    def hf_config(self, cfg: ModelConfig, moe_opt: MoEOptConfig):
        ...

    @abstractmethod
    def state_dict(self, model) -> dict[str, torch.Tensor]:
        ...

    @abstractmethod
    def per_expert(self, sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        ...

    def model_class(self):
        import transformers

        return getattr(transformers, self.hf_class)

    def prepare(self, hf_model) -> None:
        """Anything the empty transformers model needs before its weights load (nothing by default)."""


# model keys (and their off values) whose pieces only gpt-oss's transformers class has among our exporters
GPT_OSS_PIECES = {"qkv_bias": False, "o_bias": False, "attention_sinks": False, "router_bias": False,
                  "expert_proj_bias": False, "expert_activation": "swiglu"}


def check_plain_pieces(cfg: ModelConfig, family: str) -> None:
    """An export to a family without gpt-oss's pieces (Mixtral, DeepSeek-V3) refuses a model that has them,
    which that class would drop or compute otherwise; and full_attention layers beside model.sliding_window,
    which needs a class with `layer_types`."""
    for key, off in GPT_OSS_PIECES.items():
        if getattr(cfg, key) != off:
            raise ConfigError(f"model.{key}", getattr(cfg, key),
                              "set model.hf_family=gpt_oss to export it (GptOssForCausalLM has it)",
                              f"has no {family} equivalent: the export would drop it or compute otherwise")
    if {window_of(cfg, i) for i in range(cfg.num_layers)} - {cfg.sliding_window}:
        raise ConfigError("model.attention_layer_types", list(cfg.attention_layer_types),
                          "set model.hf_family=gpt_oss to export it (its layer_types), or "
                          "attention_layer_types=null (every layer model.sliding_window)",
                          f"gives some layers no window; {family} has one window for every layer")


def _yaml(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
