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
    mtp_depths(hf_config, keys) -> int            the multi-token-prediction depths its files hold
Writing (the families we export to, `ExportAdapter`):
    check_exportable(cfg, moe_opt)                refuse what the transformers class cannot reproduce
    hf_config(cfg, moe_opt)                       its transformers config
    state_dict(model) -> dict                     our weights under transformers 5.x's keys (stacked)
    per_expert(sd, num_layers) -> dict            5.x's stacked experts -> 4.x's / the files' keys
    model_class()                                 the transformers class (MixtralForCausalLM, ...)
    extra_state_dict(model) -> dict               what the export writes beside that class's weights

`hf_config` is a transformers config object or its config.json as a dict (tensors.config_value
reads either). The adapters are registered by model_type in moe/hf/families.py.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from moe.config.derived import window_of
from moe.config.schema import ModelConfig, MoEOptConfig, group_scored_by, normalizes
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

    def mtp_depths(self, hf_config, keys) -> int:
        """The multi-token-prediction depths a directory's files (`keys`) hold, which the transformers class
        does not load (0: the family has none; moe.hf.mtp lays out DeepSeek's)."""
        return 0

    def check_routing(self, hf_config, moe_opt, top_k: int) -> None:
        """model.init_from_hf: the user's moe_opt must route as the checkpoint does, else the loaded
        experts are chosen differently from how they were trained."""
        want = self.moe_opt(hf_config)
        for key in self.routing_keys:
            have, theirs = getattr(moe_opt, key), getattr(want, key)
            if key == "normalize_top_k":
                have, theirs = normalizes(have, top_k), normalizes(theirs, top_k)
            if key == "group_score_experts":  # null means top_k/group_top_k
                have, theirs = group_scored_by(moe_opt, top_k), group_scored_by(want, top_k)
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

    def extra_state_dict(self, model) -> dict[str, torch.Tensor]:
        """Tensors an export writes beside what the transformers class holds, under the files' keys
        (DeepSeek's multi-token-prediction layers, moe.hf.mtp); none by default."""
        return {}


# model keys whose pieces only some families' transformers classes have: the plain value, and those families
# (model.hf_family). dense_layers: any layers beside the leading ones and the frequency's.
FAMILY_PIECES = {
    "qkv_bias": (False, ("gpt_oss", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe")),
    "o_bias": (False, ("gpt_oss", "qwen3_moe", "olmoe")),
    "attention_sinks": (False, ("gpt_oss",)),
    "router_bias": (False, ("gpt_oss",)),
    "expert_proj_bias": (False, ("gpt_oss",)),
    "expert_activation": ("swiglu", ("gpt_oss",)),
    "qk_norm": ("none", ("qwen3_moe", "olmoe", "glm4_moe")),
    "partial_rotary_factor": (1.0, ("glm4_moe",)),
    "shared_expert_gate": (False, ("qwen2_moe",)),
    "dense_layers": (None, ("qwen3_moe", "qwen2_moe")),
    "mtp_layers": (0, ("deepseek_v3", "glm4_moe")),  # DeepSeek's multi-token-prediction layout (moe.hf.mtp)
}
PER_LAYER_WINDOWS = ("gpt_oss",)  # families whose class windows some layers only (layer_types)


def check_plain_pieces(cfg: ModelConfig, family: str, model_type: str) -> None:
    """An export to `family` (its model_type) refuses a model with a piece its class does not have, which the
    export would drop or compute otherwise, naming the families that have it; and full_attention layers
    beside model.sliding_window, which needs a class with `layer_types`."""
    for key, (off, families) in FAMILY_PIECES.items():
        have = getattr(cfg, key)
        plain = have == off or (off is None and not have)  # dense_layers: [] lists none
        if model_type not in families and not plain:
            raise ConfigError(f"model.{key}", have,
                              f"set model.hf_family={' or '.join(families)} to export it (their classes have "
                              f"it), or train with model.{key}={_yaml(off)}",
                              f"has no {family} equivalent: the export would drop it or compute otherwise")
    windows = {window_of(cfg, i) for i in range(cfg.num_layers)}
    if model_type not in PER_LAYER_WINDOWS and windows - {cfg.sliding_window}:
        raise ConfigError("model.attention_layer_types", list(cfg.attention_layer_types),
                          f"set model.hf_family={' or '.join(PER_LAYER_WINDOWS)} to export it (its "
                          "layer_types), or attention_layer_types=null (every layer model.sliding_window)",
                          f"gives some layers no window; {family} has one window for every layer")


def _yaml(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def refuse_unless(cfg: ModelConfig, family: str, **wanted) -> None:
    """A ConfigError for the first model key whose value is not the one `family` can express."""
    for key, want in wanted.items():
        have = getattr(cfg, key)
        if have != want:
            raise ConfigError(f"model.{key}", have,
                              f"train with model.{key}={_yaml(want)} to export to {family}",
                              f"cannot be expressed by {family}")


def refuse_router_options(moe_opt: MoEOptConfig, family: str) -> None:
    """A ConfigError for the first routing option a softmax top-k router (Mixtral's, Qwen's, OLMoE's)
    cannot express."""
    for key, default, what in (("score_function", "softmax", "scores experts with a sigmoid"),
                               ("num_groups", None, "limits each token to groups of experts"),
                               ("topk_scaling_factor", None, "scales the top-k weights"),
                               ("enable_expert_bias", False, "selects experts with a learned bias")):
        value = getattr(moe_opt, key)
        if value != default:
            raise ConfigError(f"moe_opt.{key}", value,
                              f"export a model trained with moe_opt.{key}={_yaml(default)}",
                              f"{what}, which {family}'s softmax top-k router cannot express")
