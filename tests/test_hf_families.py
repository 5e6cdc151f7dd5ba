"""Qwen3-MoE, Qwen2-MoE and OLMoE both ways (moe/hf/qwen3_moe.py, qwen2_moe.py, olmoe.py): a tiny random
transformers model imports with its logits and greedy tokens, our model exports to a directory transformers
loads with no missing or unexpected keys and no warnings, and the pieces these families add (QK-norm per
head and full, q/k/v biases, the gated shared expert, an explicit dense pattern) equal transformers' own
modules. Each model: 2 layers, hidden 64, 4 experts, top 2, fp32 unless said.
"""
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from transformers.models.olmoe.modeling_olmoe import OlmoeAttention
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeRotaryEmbedding

from moe.config import ModelConfig, MoEOptConfig, TrainConfig
from moe.config.infer import InferConfig
from moe.errors import ConfigError
from moe.hf import from_hf, model_config_from_hf, tensor_source, to_hf
from moe.hf.start import hf_start
from moe.infer.command import run
from moe.infer.generate import generate
from moe.infer.load import model_from_hf_dir
from moe.model import MoETransformer
from moe.model.attention import Attention
from moe.model.moe import MoELayer
from tests._hf_loading import loads_cleanly, relative_error, tunes_and_reimports

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
              rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1.0e4}, router_aux_loss_coef=0.02)
# each family's own keys: Qwen with a dense layer (mlp_only_layers, or decoder_sparse_step 2), Qwen3 with a
# head_dim other than hidden / heads and a 5-token window on every layer, Qwen2 with its shared expert;
# OLMoE's defaults name its tokenizer's ids
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=48, moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[0], head_dim=24, use_sliding_window=True,
                                         sliding_window=5)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=48, moe_intermediate_size=32,
                                         decoder_sparse_step=2, shared_expert_intermediate_size=40)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, eos_token_id=None, pad_token_id=None)),
}
# our model keys for the same families (the export direction)
OURS = {
    "qwen3_moe": dict(qk_norm="per_head", head_dim=24, dense_layers=[1], dense_intermediate_size=48,
                      sliding_window=5),
    "qwen2_moe": dict(qkv_bias=True, shared_expert_intermediate_size=40, shared_expert_gate=True,
                      first_k_dense_replace=1),
    "olmoe": dict(qk_norm="full"),
}
IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
# bf16 against transformers in bf16, measured over seeds 0-4: at most 2.4e-2 (Qwen3-MoE), 9.1e-3 (Qwen2-MoE),
# 7.1e-3 (OLMoE); each is as far from the fp32 logits as transformers' own bf16 (2.3e-2, 8.1e-3, 1.1e-2)
BF16_RELATIVE = 5e-2


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    """Norm weights away from 1 and biases away from 0, so that they are tested too."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
        elif name.endswith("bias"):
            p.uniform_(-0.5, 0.5)


def hf_config(family: str, **kw):
    cls, own = FAMILIES[family]
    config = getattr(transformers, cls)(**COMMON | own | kw)
    config._attn_implementation = "sdpa"
    return config


def hf_model(family: str, dtype=torch.float32, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **kw)).eval()
    _perturb(model)
    return model.to(dtype)


def our_config(family: str, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, num_experts=4, top_k=2, max_position_embeddings=64, rope_theta=1.0e4,
                       rms_norm_eps=1e-6, hf_family=family, **OURS.get(family, {}) | kw)


def our_model(family: str, seed: int = 0, **kw) -> MoETransformer:
    torch.manual_seed(seed)
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, normalize_top_k=family == "qwen3_moe")
    model = MoETransformer(our_config(family, **kw), opt).eval()
    _perturb(model)
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """tests._hf_loading.relative_error in fp32 (bf16 logits too)."""
    return relative_error(a.float(), b.float())


def infer_greedy_is_generates(hf, tmp_path) -> None:
    """`infer.py hf_dir=DIR greedy=true` (its run(), in this process) on `hf` saved with the bundled sample's
    tokenizer (512 ids) gives transformers' greedy tokens."""
    hf.save_pretrained(tmp_path)
    sample = Path(__file__).resolve().parents[1] / "data" / "sample"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(sample / name, tmp_path)
    cfg = OmegaConf.merge(OmegaConf.structured(InferConfig), dict(
        hf_dir=str(tmp_path), prompt="Once upon a time", max_new_tokens=6, greedy=True, stop_at_eos=False))
    [result] = run(cfg)
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path)("Once upon a time")["input_ids"]
    assert result["tokens"] == hf_greedy(hf, torch.tensor([ids]), 6)[0]


def hf_greedy(hf, ids_BS: torch.Tensor, n: int) -> list[list[int]]:
    out = hf.generate(input_ids=ids_BS, attention_mask=torch.ones_like(ids_BS), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, ids_BS.shape[1]:].tolist()


def is_sparse(hf_layer) -> bool:
    return hasattr(hf_layer.mlp, "experts")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_directory_imports_with_transformers_logits_and_greedy_tokens(family, tmp_path, capsys):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    model = model_from_hf_dir(tmp_path)  # what infer.py hf_dir= loads
    assert "warning" not in capsys.readouterr().err  # every key of the config.json transformers wrote is read
    assert model.model_config.hf_family == family  # it exports back to its family
    assert [b.is_moe for b in model.layers] == [is_sparse(layer) for layer in hf.model.layers]
    assert model.moe_opt.capacity_factor is None and model.moe_opt.aux_loss_coeff == 0.02
    assert model.moe_opt.normalize_top_k is hf.config.norm_topk_prob
    with torch.no_grad():
        assert relative(model(IDS).logits_BSV, hf(IDS).logits) < 1e-5
    assert generate(model, IDS, max_new_tokens=6).tokens == hf_greedy(hf, IDS, 6)  # our KV cache
    # model.init_from_hf reads a rank's experts only: experts 1-2 of the last layer are those of the whole
    name = "layers.1.ffn.experts.gate_up"
    whole = model.state_dict()[name]
    part = tensor_source(tmp_path, model.model_config)(name, (2, *whole.shape[1:]), 1)
    assert torch.equal(part, whole[1:3])


@pytest.mark.parametrize("family", FAMILIES)
def test_infer_hf_dir_greedy_gives_transformers_greedy_tokens(family, tmp_path):
    """`infer.py hf_dir=DIR greedy=true` (its run(), in this process) on a directory with a tokenizer."""
    hf = hf_model(family, vocab_size=512)  # the bundled sample tokenizer's 512 ids
    infer_greedy_is_generates(hf, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_export_loads_in_transformers_with_our_logits_and_reimports_as_itself(family, tmp_path, capsys):
    model = our_model(family)
    to_hf(model).save_pretrained(tmp_path)
    hf = loads_cleanly(transformers.AutoModelForCausalLM, tmp_path)  # no missing keys, no warnings
    assert type(hf).__name__ == type(to_hf(model)).__name__ and hf.config.model_type == family
    assert [b.is_moe for b in model.layers] == [is_sparse(layer) for layer in hf.model.layers]
    with torch.no_grad():
        assert relative(hf.eval()(IDS).logits, model(IDS).logits_BSV) < 1e-5
    again = model_from_hf_dir(tmp_path)
    assert "warning" not in capsys.readouterr().err
    pattern = ("name", "first_k_dense_replace", "dense_layers")  # Qwen writes both as mlp_only_layers
    assert {k: v for k, v in asdict(again.model_config).items() if k not in pattern} == \
        {k: v for k, v in asdict(model.model_config).items() if k not in pattern}
    assert [b.is_moe for b in again.layers] == [b.is_moe for b in model.layers]
    assert again.moe_opt.normalize_top_k == model.moe_opt.normalize_top_k


@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_hf_then_training_then_export_reimports_with_the_loss_it_trained_to(family, tmp_path):
    """model.init_from_hf=DIR as train.py settles and materialises it, 3 optimizer steps, the export, and
    its import again: the same model (its loss), still of the family."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "start")
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.init_from_hf = str(tmp_path / "start")
    if not hf.config.norm_topk_prob:  # our default renormalises the top 2: not how the checkpoint routes
        with pytest.raises(ConfigError) as err:
            hf_start(cfg.model, cfg.moe_opt, cfg.data)
        assert err.value.field == "moe_opt.normalize_top_k"
    cfg.moe_opt.normalize_top_k = hf.config.norm_topk_prob  # the checkpoint's routing
    start = hf_start(cfg.model, cfg.moe_opt, cfg.data)
    model_cfg = OmegaConf.to_object(OmegaConf.merge(cfg.model, start.model))
    moe_opt = OmegaConf.to_object(cfg.moe_opt)
    assert model_cfg.hf_family == family and model_cfg.init_from_hf == str(tmp_path / "start")
    with torch.device("meta"):
        model = MoETransformer(model_cfg, moe_opt, init_seed=0)
    model.materialize("cpu", tensor_source(tmp_path / "start", model_cfg))  # tensor by tensor, as ranks do
    tunes_and_reimports(model, hf, IDS, tmp_path / "tuned", family)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_are_close(family):
    hf = hf_model(family, dtype=torch.bfloat16)
    model = from_hf(hf).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        assert relative(model(IDS).logits_BSV, hf(IDS).logits) < BF16_RELATIVE


# each family with one scaled RoPE (moe.hf.rope), its original context (8) shorter than IDS (11 tokens)
SCALED_ROPE = {
    "qwen3_moe": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "qwen2_moe": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8},
    "olmoe": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_rope_imports_and_exports_with_transformers_logits(family, tmp_path):
    """A checkpoint with YaRN, llama3 or linear RoPE imports with its logits and greedy tokens (KV cache),
    and our export writes the same rope_parameters, loading with the same logits."""
    rope = {**SCALED_ROPE[family], "rope_theta": 1.0e4}
    hf = hf_model(family, rope_parameters=rope)
    model = from_hf(hf).eval()
    assert model.model_config.rope_type == rope["rope_type"]
    with torch.no_grad():
        assert relative(model(IDS).logits_BSV, hf(IDS).logits) < 1e-5
    assert generate(model, IDS, max_new_tokens=6).tokens == hf_greedy(hf, IDS, 6)
    to_hf(model).save_pretrained(tmp_path)
    again = loads_cleanly(transformers.AutoModelForCausalLM, tmp_path)
    assert {k: again.config.rope_parameters[k] for k in rope} == rope
    with torch.no_grad():
        assert relative(again(IDS).logits, hf(IDS).logits) < 1e-5


@pytest.mark.parametrize("kind", ["per_head", "full"])
def test_qk_norm_equals_transformers_attention(kind):
    """Qwen3-MoE's per-head q_norm/k_norm and OLMoE's full-width ones, in our fused attention."""
    family, hf_cls = ("qwen3_moe", Qwen3MoeAttention) if kind == "per_head" else ("olmoe", OlmoeAttention)
    # no window: transformers builds the sliding mask in the model, not in the attention module
    config = hf_config(family, **{"use_sliding_window": False} if kind == "per_head" else {})
    torch.manual_seed(0)
    theirs = hf_cls(config, layer_idx=0).eval()
    _perturb(theirs)
    cfg = model_config_from_hf(config)
    assert cfg.qk_norm == kind
    ours = Attention(cfg).eval()
    a = theirs
    ours.load_state_dict({"qkv_proj.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                          "o_proj.weight": a.o_proj.weight, "q_norm.weight": a.q_norm.weight,
                          "k_norm.weight": a.k_norm.weight})
    x = torch.randn(2, 7, 64)
    cos_sin = Qwen3MoeRotaryEmbedding(config)(x, torch.arange(7)[None])
    with torch.no_grad():
        want, _ = theirs(x, cos_sin, attention_mask=None)
        assert relative(ours(x), want) < 1e-6


def test_gated_shared_expert_equals_transformers_qwen2_moe_block():
    config = hf_config("qwen2_moe")
    torch.manual_seed(0)
    theirs = transformers.Qwen2MoeForCausalLM(config).model.layers[1].mlp.eval()
    assert isinstance(theirs, Qwen2MoeSparseMoeBlock)
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, normalize_top_k=False)
    ours = MoELayer(64, 32, 4, 2, opt, shared_expert_intermediate_size=40, shared_expert_gate=True).eval()
    s, layout = theirs.shared_expert, ours.experts.layout
    gate_up, down = (layout.from_out_in(t) for t in (theirs.experts.gate_up_proj, theirs.experts.down_proj))
    ours.load_state_dict({
        "router.weight": theirs.gate.weight, layout.layer_names[0]: gate_up, layout.layer_names[1]: down,
        "shared_expert.gate_up_proj.weight": torch.cat([s.gate_proj.weight, s.up_proj.weight]),
        "shared_expert.down_proj.weight": s.down_proj.weight,
        "shared_expert_gate.weight": theirs.shared_expert_gate.weight})
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert relative(ours(x)[0], theirs(x)) < 1e-6


EXPORT_REFUSALS = [
    ("qwen3_moe", dict(qk_norm="none"), {}, "model.qk_norm"),
    ("qwen3_moe", dict(qkv_bias=True), {}, "model.o_bias"),  # attention_bias: q, k, v and o together
    ("qwen3_moe", dict(attention_sinks=True), {}, "model.attention_sinks"),  # gpt-oss's
    ("qwen3_moe", dict(shared_expert_intermediate_size=40), {}, "model.shared_expert_intermediate_size"),
    ("qwen3_moe", {}, dict(score_function="sigmoid"), "moe_opt.score_function"),
    ("qwen2_moe", dict(shared_expert_gate=False), {}, "model.shared_expert_gate"),
    ("qwen2_moe", dict(qk_norm="per_head"), {}, "model.qk_norm"),
    ("qwen2_moe", dict(sliding_window=8), {}, "model.sliding_window"),
    ("qwen2_moe", dict(o_bias=True), {}, "model.o_bias"),
    ("olmoe", dict(qk_norm="per_head"), {}, "model.qk_norm"),
    ("olmoe", dict(dense_layers=[0]), {}, "model.dense_layers"),
    ("olmoe", dict(head_dim=8), {}, "model.head_dim"),
    ("olmoe", {}, dict(enable_expert_bias=True), "moe_opt.enable_expert_bias"),
    ("olmoe", dict(router_bias=True), {}, "model.router_bias"),
    ("gpt_oss", dict(qk_norm="per_head"), {}, "model.qk_norm"),
    ("gpt_oss", dict(dense_layers=[1]), {}, "model.dense_layers"),
    ("mixtral", dict(qk_norm="per_head"), {}, "model.qk_norm"),
    ("mixtral", dict(dense_layers=[1]), {}, "model.dense_layers"),
]


@pytest.mark.parametrize("family,kw,opt,field", EXPORT_REFUSALS)
def test_an_export_refuses_what_the_family_cannot_express_naming_the_key(family, kw, opt, field):
    moe_opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, **opt)
    with pytest.raises(ConfigError) as err:
        to_hf(MoETransformer(our_config(family, **kw), moe_opt))
    assert err.value.field == field


def test_an_export_names_every_family_whose_class_has_the_piece():
    """Mixtral's and DeepSeek-V3's refusals of another family's piece say which model.hf_family has it."""
    moe_opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)
    for kw, families in ((dict(qkv_bias=True), "gpt_oss or qwen2_moe or qwen3_moe or olmoe or glm4_moe"),
                         (dict(o_bias=True), "gpt_oss or qwen3_moe or olmoe to"),
                         (dict(qk_norm="per_head"), "qwen3_moe or olmoe or glm4_moe"),
                         (dict(partial_rotary_factor=0.5), "glm4_moe to"),
                         (dict(attention_sinks=True), "gpt_oss to")):
        with pytest.raises(ConfigError, match=f"set model.hf_family={families}"):
            to_hf(MoETransformer(our_config("mixtral", **kw), moe_opt))
    with pytest.raises(ConfigError, match="set model.hf_family=qwen3_moe or qwen2_moe") as err:
        to_hf(MoETransformer(our_config("deepseek_v3", dense_layers=[1]), moe_opt))
    assert "has no DeepSeek-V3 equivalent" in err.value.problem


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_attention_bias_imports_as_qkv_and_o_biases_and_exports_back(family, tmp_path):
    """Qwen3-MoE's and OLMoE's attention_bias (q, k, v and o biased) reads as model.qkv_bias and o_bias with
    transformers' logits and greedy tokens; its export writes attention_bias, loading with the same logits."""
    hf = hf_model(family, attention_bias=True)
    model = from_hf(hf).eval()
    assert model.model_config.qkv_bias and model.model_config.o_bias
    with torch.no_grad():
        assert relative(model(IDS).logits_BSV, hf(IDS).logits) < 1e-5
    assert generate(model, IDS, max_new_tokens=6).tokens == hf_greedy(hf, IDS, 6)
    to_hf(model).save_pretrained(tmp_path)
    again = loads_cleanly(transformers.AutoModelForCausalLM, tmp_path)
    assert again.config.attention_bias is True
    with torch.no_grad():
        assert relative(again(IDS).logits, hf(IDS).logits) < 1e-5


@pytest.mark.parametrize("family,kw,field", [
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), "use_sliding_window"),
])
def test_an_import_refuses_what_ours_does_not_compute_naming_the_key(family, kw, field):
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(hf_config(family, **kw))
    assert err.value.field == field
