"""RoPE scaling (model.rope_type linear, llama3, yarn): our inverse frequencies, cos/sin factor and MLA
softmax scale equal transformers' for the released DeepSeek-V3, gpt-oss and Llama 3.1 settings; Mixtral
and an upcycled Llama carry llama3 and linear scaling both ways with equal logits; decode steps see the
full sequence's cos/sin; partial RoPE (model.partial_rotary_factor) equals GLM-4.5's rotary embedding and
attention with each scaling; the keys are validated."""
from dataclasses import replace

import pytest
import torch
import transformers
from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig, MixtralConfig, MixtralForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeAttention,
    Glm4MoeRotaryEmbedding,
    apply_rotary_pos_emb,
)

from moe.config import ModelConfig, MoEOptConfig
from moe.config.derived import rotary_dim_of
from moe.config.rules.architecture import validate_model
from moe.errors import ConfigError
from moe.hf import from_hf, model_config_from_hf, to_hf, upcycle
from moe.model import MoETransformer
from moe.model.attention import Attention, apply_rope
from moe.model.rope import attention_factor, inverse_frequencies, mla_softmax_scale, rope_cos_sin
from tests._hf_loading import decoded_logits, loads_cleanly, relative_error

# the released DeepSeek-V3 config.json's rope_scaling
DEEPSEEK_V3 = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
           "original_max_position_embeddings": 4096, "truncate": False}
LLAMA_3_1 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}

# (name, transformers config, its rotated dims, theta)
SETTINGS = {
    "deepseek_v3": (lambda: DeepseekV3Config(rope_scaling=dict(DEEPSEEK_V3), rope_theta=1.0e4,
                                             max_position_embeddings=163840, qk_rope_head_dim=64), 64),
    "gpt_oss": (lambda: GptOssConfig(rope_parameters={**GPT_OSS, "rope_theta": 150000.0}, head_dim=64,
                                     max_position_embeddings=131072), 64),
    "llama_3_1": (lambda: LlamaConfig(rope_parameters={**LLAMA_3_1, "rope_theta": 500000.0}, hidden_size=4096,
                                      num_attention_heads=32, max_position_embeddings=131072), 128),
    "linear": (lambda: LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                    "rope_theta": 1.0e4},
                                   hidden_size=256, num_attention_heads=8), 32),
}


def ours_from(hf_config) -> ModelConfig:
    """Our model config's RoPE keys, as the import reads them."""
    from moe.hf.rope import rope_keys

    return ModelConfig(**rope_keys(hf_config, default_theta=1.0e4))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_frequencies_and_attention_factor_equal_transformers(name):
    make, dim = SETTINGS[name]
    hf_config = make()
    rope_type = hf_config.rope_parameters["rope_type"]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    m = ours_from(hf_config)
    assert m.rope_type == rope_type
    assert torch.equal(inverse_frequencies(m, dim), inv_freq)  # bit for bit
    assert attention_factor(m) == factor
    if name == "deepseek_v3":  # MLA's softmax scale: 1/sqrt(192) x (0.1 ln 40 + 1)^2
        qk_dim = 128 + 64
        assert mla_softmax_scale(m, qk_dim) == yarn_apply_mscale(hf_config.rope_parameters, qk_dim ** -0.5)
        assert mla_softmax_scale(m, qk_dim) == pytest.approx(qk_dim ** -0.5 * 1.3688879 ** 2)
    if name == "gpt_oss":
        assert factor == pytest.approx(1.3465736)  # 0.1 ln 32 + 1: no mscales, so cos/sin carry it
        assert mla_softmax_scale(m, 64) is None


def test_a_decode_step_sees_the_full_sequences_cos_sin():
    m = ours_from(SETTINGS["gpt_oss"][0]())
    inv_freq = inverse_frequencies(m, 64)
    full = rope_cos_sin(0, 9000, inv_freq, attention_factor(m), torch.float32)
    step = rope_cos_sin(8191, 3, inv_freq, attention_factor(m), torch.float32)
    for a, b in zip(step, full, strict=True):
        assert torch.equal(a, b[8191:8194])


# -- partial RoPE: GLM-4.5's partial_rotary_factor, with each scaling ------------------------------------

PARTIAL = {"default": {}, "linear": {"rope_type": "linear", "factor": 4.0},
           "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8}}


def glm_config(rope: dict, **kw):
    config = transformers.Glm4MoeConfig(**dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
        attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1.0e4, "partial_rotary_factor": 0.5} | rope)
        | kw)
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("kind", list(PARTIAL))
def test_partial_rope_equals_glm4_moes_rotary_embedding_and_apply_rotary_pos_emb(kind):
    """Glm4MoeRotaryEmbedding's cos/sin over int(24 x 0.5) = 12 dims and apply_rotary_pos_emb (the first 12
    dims of each head rotated, the other 12 passed through), bit for bit."""
    config = glm_config(PARTIAL[kind])
    m = replace(ours_from(config), hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=24)
    assert (m.partial_rotary_factor, rotary_dim_of(m)) == (0.5, 12)
    cos, sin = Glm4MoeRotaryEmbedding(config)(torch.zeros(1), torch.arange(11)[None])
    ours_cos, ours_sin = rope_cos_sin(0, 11, inverse_frequencies(m, rotary_dim_of(m)), attention_factor(m),
                                      torch.float32)
    assert torch.equal(ours_cos, cos[0]) and torch.equal(ours_sin, sin[0])
    q, k = torch.randn(2, 4, 11, 24), torch.randn(2, 2, 11, 24)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(apply_rope(q, ours_cos, ours_sin), want_q)
    assert torch.equal(apply_rope(k, ours_cos, ours_sin), want_k)
    assert torch.equal(want_q[..., 12:], q[..., 12:])  # the unrotated half


@pytest.mark.parametrize("kind", list(PARTIAL))
def test_partial_rope_attention_equals_glm4_moes_and_decodes_as_the_full_forward(kind):
    """Glm4MoeAttention (q/k/v biases, per-head QK-norm, partial RoPE) against our fused attention, whole and
    as KV-cache decode steps past YaRN's original 8 positions."""
    from moe.model.attention import KVCache

    config = glm_config(PARTIAL[kind])
    torch.manual_seed(0)
    theirs = Glm4MoeAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.2)
    cfg = replace(ours_from(config), hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=24, qkv_bias=True,
                  qk_norm="per_head", rms_norm_eps=1e-6)
    ours = Attention(cfg).eval()
    a = theirs
    ours.load_state_dict({
        "qkv_proj.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
        "qkv_proj.bias": torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
        "o_proj.weight": a.o_proj.weight, "q_norm.weight": a.q_norm.weight, "k_norm.weight": a.k_norm.weight})
    x = torch.randn(2, 11, 64)
    cos_sin = Glm4MoeRotaryEmbedding(config)(x, torch.arange(11)[None])
    with torch.no_grad():
        want, _ = theirs(x, cos_sin, attention_mask=None, is_causal=True)
        assert relative_error(ours(x), want) < 1e-6
        cache = KVCache()
        steps = [ours(x[:, :4], kv_cache=cache)] + [ours(x[:, i:i + 1], kv_cache=cache, position_offset=i)
                                                     for i in range(4, 11)]
        assert relative_error(torch.cat(steps, dim=1), want) < 1e-6


# -- Mixtral (and a Llama upcycle) with llama3 and linear scaling, both ways ------------------------------

SCALINGS = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16},
            "linear": {"rope_type": "linear", "factor": 3.0}}
IDS = torch.randint(0, 67, (2, 40), generator=torch.Generator().manual_seed(0))  # past 16 positions


def hf_mixtral(scaling: dict) -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=67, hidden_size=32, intermediate_size=20, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                           rms_norm_eps=1e-6, rope_parameters={**scaling, "rope_theta": 1.0e4})
    return MixtralForCausalLM(config).eval()


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_mixtral_with_scaled_rope_both_ways(tmp_path, kind):
    hf = hf_mixtral(SCALINGS[kind])
    model = from_hf(hf).eval()
    assert model.model_config.rope_type == kind and model.model_config.rope_factor == SCALINGS[kind]["factor"]
    with torch.no_grad():
        assert relative_error(model(IDS).logits_BSV, hf(IDS).logits) < 1e-5
    to_hf(model).save_pretrained(tmp_path)
    back = loads_cleanly(MixtralForCausalLM, tmp_path)
    assert back.config.rope_parameters == {**SCALINGS[kind], "rope_theta": 1.0e4}
    with torch.no_grad():
        assert relative_error(back(IDS).logits, model(IDS).logits_BSV) < 1e-5


def test_a_llama_3_1_style_dense_model_upcycles_with_its_llama3_rope():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={**SCALINGS["llama3"], "rope_theta": 1.0e4})
    dense = transformers.LlamaForCausalLM(config).eval()
    model = upcycle(dense, num_experts=4, top_k=2).eval()
    assert model.model_config.rope_low_freq_factor == 1.0 and model.model_config.rope_type == "llama3"
    with torch.no_grad():
        assert relative_error(model(IDS).logits_BSV, dense(IDS).logits) < 1e-5


def test_kv_cache_decoding_with_llama3_equals_the_full_forward():
    cfg = ModelConfig(vocab_size=67, hidden_size=32, intermediate_size=20, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64, rope_theta=1.0e4, rope_type="llama3",
                      rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_position_embeddings=16)
    torch.manual_seed(0)
    model = MoETransformer(cfg, MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)).eval()
    ids = IDS[:, :24]  # decode steps at positions 12..23, past the 16 original ones
    with torch.no_grad():
        full = model(ids, generating=True).logits_BSV
    torch.testing.assert_close(decoded_logits(model, ids, 12), full, rtol=0, atol=1e-5)


# -- the keys' rules ---------------------------------------------------------------------------------------

YARN = dict(rope_type="yarn", rope_factor=40.0, rope_original_max_position_embeddings=4096)


@pytest.mark.parametrize("kw, field, says", [
    (dict(rope_type="ntk"), "model.rope_type", "use one of default, linear, llama3, yarn"),
    (dict(rope_factor=4.0), "model.rope_factor", "rope_type is default"),
    (dict(YARN, rope_factor=0.5), "model.rope_factor", "is below 1"),
    (dict(YARN, rope_original_max_position_embeddings=None), "model.rope_original_max_position_embeddings",
     "is required by rope_type=yarn"),
    (dict(rope_type="llama3", rope_factor=8.0, rope_original_max_position_embeddings=8192,
          rope_low_freq_factor=1.0), "model.rope_high_freq_factor", "is required by rope_type=llama3"),
    (dict(rope_type="llama3", rope_factor=8.0, rope_original_max_position_embeddings=8192,
          rope_low_freq_factor=4.0, rope_high_freq_factor=1.0), "model.rope_high_freq_factor",
     "must exceed rope_low_freq_factor"),
    (dict(rope_type="linear", rope_factor=2.0, rope_beta_fast=32.0), "model.rope_beta_fast",
     "is not read by rope_type=linear"),
    (dict(YARN, rope_low_freq_factor=1.0), "model.rope_low_freq_factor", "is not read by rope_type=yarn"),
    (dict(YARN, rope_beta_fast=1.0, rope_beta_slow=2.0), "model.rope_beta_fast", "is below rope_beta_slow"),
    (dict(YARN, rope_mscale_all_dim=-1.0), "model.rope_mscale_all_dim", "must be positive"),
    (dict(YARN, position_encoding="alibi"), "model.rope_type", "scales RoPE, which this model does not use"),
    (dict(partial_rotary_factor=0.0), "model.partial_rotary_factor", "is outside (0, 1]"),
    (dict(partial_rotary_factor=1.5), "model.partial_rotary_factor", "is outside (0, 1]"),
    (dict(partial_rotary_factor=0.3), "model.partial_rotary_factor", "= 9 dims; RoPE rotates pairs"),
    (dict(partial_rotary_factor=0.5, position_encoding="alibi"), "model.partial_rotary_factor",
     "applies to RoPE only"),
    (dict(partial_rotary_factor=0.5, attention="mla", kv_lora_rank=32, qk_nope_head_dim=16,
          qk_rope_head_dim=8, v_head_dim=16), "model.partial_rotary_factor", "is read by GQA attention only"),
])
def test_rope_keys_are_checked(kw, field, says):
    with pytest.raises(ConfigError) as err:
        validate_model(replace(ModelConfig(), **kw))
    assert err.value.field == field and says in str(err.value) and "Fix:" in str(err.value)


def test_the_released_deepseek_v3_config_imports():
    """Its config.json's fields (rope_scaling in 4.x's spelling, MTP layer declared) as transformers reads
    them: YaRN factor 40 over 4096 positions, 163840 in all."""
    config = DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000, rope_scaling=dict(DEEPSEEK_V3), num_nextn_predict_layers=1)
    cfg = model_config_from_hf(config)
    validate_model(cfg)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position_embeddings, cfg.rope_beta_fast,
            cfg.rope_beta_slow, cfg.rope_mscale, cfg.rope_mscale_all_dim, cfg.max_position_embeddings) == \
        ("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0, 163840)
