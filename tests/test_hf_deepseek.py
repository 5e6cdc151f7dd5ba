"""DeepSeek-V3 interop: multi-head latent attention and first-k-dense layers, logits
parity with transformers' DeepseekV3ForCausalLM both ways, save/load directories, lazy per-tensor reads,
refusals, parameter counts, generation with the KV cache.
"""
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from moe.config import ModelConfig, MoEOptConfig
from moe.config.size import flops_per_token, param_breakdown
from moe.errors import ConfigError
from moe.hf import from_hf, model_config_from_hf, moe_opt_from_hf, tensor_source, to_hf
from moe.hf.deepseek_v3 import DeepSeekV3, deinterleave_order
from moe.model import MoETransformer
from tests._hf_loading import decoded_logits, perturbed

V = 61
# (q_lora_rank, rope_interleave, first_k_dense, n_group/topk_group, tied, n_shared, scaling, norm_topk)
CASES = [
    (16, True, 1, (2, 1), False, 1, 2.5, True),
    (None, False, 0, (1, 1), True, 0, 1.0, False),
    (8, True, 2, (4, 2), False, 2, 1.5, True),
]


def hf_model(q_rank, interleave, dense, groups, tied, shared, scaling, norm, seed=0,
             rope=None, **kw) -> DeepseekV3ForCausalLM:
    """A DeepseekV3ForCausalLM with every weight, norm and expert bias random (nothing left at its init);
    `rope`: its rope_parameters besides theta (plain RoPE when None); `kw`: other config keys."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(**dict(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=shared, n_routed_experts=8,
        num_experts_per_tok=2 * groups[1], routed_scaling_factor=scaling, kv_lora_rank=12, q_lora_rank=q_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10, n_group=groups[0], topk_group=groups[1],
        first_k_dense_replace=dense, norm_topk_prob=norm, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, rope_interleave=interleave,
        rope_parameters={"rope_type": "default", "rope_theta": 1.0e4} | (rope or {})) | kw)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model


def ours(seed=0, **kw) -> MoETransformer:
    """A tiny_deepseek_v3-shaped model with DeepSeek-V3 routing and a non-zero expert bias."""
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=12, dense_intermediate_size=40,
                      num_layers=3, num_heads=4, num_experts=8, top_k=4, first_k_dense_replace=1,
                      shared_expert_intermediate_size=12, rope_theta=1.0e4, rms_norm_eps=1e-6,
                      attention="mla", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=6,
                      qk_rope_head_dim=8, v_head_dim=10)
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, score_function="sigmoid",
                       num_groups=4, group_top_k=2, topk_scaling_factor=2.5, enable_expert_bias=True)
    torch.manual_seed(seed)
    return perturbed(MoETransformer(replace(cfg, **kw), opt).eval())


IDS = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers_logits(case):
    hf = hf_model(*case)
    model = from_hf(hf).eval()
    assert model.model_config.attention == "mla" and model.model_config.first_k_dense_replace == case[2]
    assert [layer.is_moe for layer in model.layers] == [i >= case[2] for i in range(3)]
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits_BSV, hf(IDS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": None, "tie_word_embeddings": True},
                                {"first_k_dense_replace": 0, "shared_expert_intermediate_size": 0}])
def test_to_hf_matches_our_logits(kw):
    model = ours(**kw)
    hf = to_hf(model)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM" and hf.config.rope_interleave is True
    assert (hf.config.n_group, hf.config.topk_group, hf.config.routed_scaling_factor) == (4, 2, 2.5)
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS).logits_BSV, rtol=0, atol=1e-5)
        bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
        torch.testing.assert_close(bias, model.layers[1].ffn.router.expert_bias, rtol=0, atol=0)


def test_the_rope_rows_are_deepseeks_interleaved_pairs():
    """DeepSeek's pairs (x0, x1), (x2, x3) are our halves [x0 x2 ... | x1 x3 ...]: the export's query rows
    at rope positions 0 and 1 are ours at 0 and rope_dim/2."""
    model = ours()
    hf = to_hf(model)
    assert deinterleave_order(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    nope, rope = 6, 8
    theirs = hf.model.layers[0].self_attn.q_b_proj.weight.view(4, nope + rope, -1)
    mine = model.layers[0].attn.q_b_proj.weight.view(4, nope + rope, -1)
    torch.testing.assert_close(theirs[:, nope + 1], mine[:, nope + rope // 2], rtol=0, atol=0)
    torch.testing.assert_close(theirs[:, :nope], mine[:, :nope], rtol=0, atol=0)


def test_round_trip_through_save_pretrained_and_lazy_reads(tmp_path):
    model = ours()
    to_hf(model).save_pretrained(tmp_path / "ds")
    files = load_file(tmp_path / "ds" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in files  # per expert on disk, as DeepSeek's
    assert "model.layers.0.mlp.gate_proj.weight" in files  # the dense first layer
    back = from_hf(tmp_path / "ds").eval()
    # num_kv_heads: unused by MLA
    assert back.model_config == replace(model.model_config, name=str(tmp_path / "ds"), num_kv_heads=4)
    assert back.moe_opt.num_groups == 4 and back.moe_opt.topk_scaling_factor == 2.5
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits_BSV, model(IDS).logits_BSV, rtol=0, atol=1e-6)
    # as model.init_from_hf fills a model built on the meta device: tensor by tensor, expert bias included
    with torch.device("meta"):
        lazy = MoETransformer(back.model_config, back.moe_opt)
    lazy.materialize("cpu", tensor_source(tmp_path / "ds", back.model_config))
    for name, value in back.state_dict().items():
        torch.testing.assert_close(lazy.state_dict()[name], value, rtol=0, atol=0, msg=name)
    source = tensor_source(tmp_path / "ds", back.model_config)
    experts = back.layers[2].ffn.experts  # down: 3 experts from the 5th, 12 inputs -> 32 outputs
    torch.testing.assert_close(source("layers.2.ffn.experts.down", experts.layout.shape(3, 12, 32), 5),
                               experts.down[5:8], rtol=0, atol=0)


def test_groups_are_scored_by_their_best_2_whatever_top_k_and_topk_group():
    """top-2 within 2 of 4 groups: Megatron-Core's count would score a group by its best 1; the import sets
    moe_opt.group_score_experts=2, transformers' count, and the logits are equal both ways."""
    hf = hf_model(*CASES[2], num_experts_per_tok=2)
    model = from_hf(hf).eval()
    opt = model.moe_opt
    assert (opt.num_groups, opt.group_top_k, opt.group_score_experts) == (4, 2, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits_BSV, hf(IDS).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(to_hf(model)(IDS).logits, hf(IDS).logits, rtol=0, atol=1e-5)


def test_model_config_from_hf_maps_every_field():
    hf = hf_model(*CASES[0])
    cfg = model_config_from_hf(hf.config)
    got = (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
           cfg.v_head_dim, cfg.intermediate_size, cfg.dense_intermediate_size, cfg.first_k_dense_replace,
           cfg.shared_expert_intermediate_size, cfg.num_experts, cfg.top_k, cfg.rope_theta)
    assert got == ("mla", 16, 12, 6, 8, 10, 12, 40, 1, 12, 8, 2, 1.0e4)
    opt = moe_opt_from_hf(hf.config)
    assert (opt.score_function, opt.num_groups, opt.group_top_k, opt.topk_scaling_factor, opt.capacity_factor,
            opt.enable_expert_bias) == ("sigmoid", 2, 1, 2.5, None, True)


@pytest.mark.parametrize("kw, opt, field", [
    ({}, {"score_function": "softmax"}, "moe_opt.score_function"),
    ({"moe_layer_frequency": 2, "first_k_dense_replace": 0}, {}, "model.moe_layer_frequency"),
    ({"sliding_window": 4}, {}, "model.sliding_window"),
    ({"shared_expert_intermediate_size": 20}, {}, "model.shared_expert_intermediate_size"),
    ({}, {"group_top_k": 1}, "moe_opt.group_score_experts"),  # groups scored by their best 4, DeepSeek's 2
])
def test_export_refuses_what_deepseek_v3_cannot_express(kw, opt, field):
    model = ours(**kw)
    model.moe_opt = replace(model.moe_opt, **opt)
    with pytest.raises(ConfigError) as err:
        to_hf(model)
    assert err.value.field == field and "Fix:" in str(err.value)


@pytest.mark.parametrize("attr, value, field", [
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
     "rope_parameters.rope_type"),
    ("attention_bias", True, "attention_bias"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_import_refuses_what_we_do_not_implement(attr, value, field):
    config = hf_model(*CASES[1]).config
    setattr(config, attr, value)
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(config)
    assert err.value.field == field


def test_init_from_hf_needs_the_checkpoints_routing():
    config = hf_model(*CASES[0]).config
    DeepSeekV3().check_routing(config, moe_opt_from_hf(config), config.num_experts_per_tok)  # its own
    with pytest.raises(ConfigError) as err:
        DeepSeekV3().check_routing(config, MoEOptConfig(), config.num_experts_per_tok)
    assert err.value.field == "moe_opt.score_function"
    assert "moe_opt.num_groups=2, moe_opt.group_top_k=1, moe_opt.topk_scaling_factor=2.5" in err.value.fix


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": None}, {"first_k_dense_replace": 3}])
def test_parameter_counts_are_the_built_models(kw):
    model = ours(**kw)
    assert param_breakdown(model.model_config).total == sum(p.numel() for p in model.parameters())


def test_the_full_size_preset_is_deepseek_v3s_671b_with_37b_active():
    from conftest import REPO
    from omegaconf import OmegaConf

    preset = ModelConfig(**OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/deepseek_v3.yaml")))
    assert preset.mtp_layers == 1  # the released model's multi-token-prediction layer (tests/test_mtp.py)
    cfg = replace(preset, mtp_layers=0)
    counts = param_breakdown(cfg)
    assert round(counts.total / 1e9, 1) == 671.0 and round(counts.active / 1e9, 1) == 37.6
    assert counts.num_moe_layers == 58  # 61 layers, the first 3 dense
    # attention FLOPs read MLA's head dims: 6 * L * heads * (192 + 128) * S per token
    attention = flops_per_token(cfg, 4096) - 6 * (counts.active - cfg.vocab_size * cfg.hidden_size)
    assert attention == 6 * 61 * 128 * (192 + 128) * 4096
    # with it: one more MoE block's attention, and the shared LM head once more per token
    counts = param_breakdown(preset)
    assert counts.num_moe_layers == 59 and round(counts.active / 1e9, 1) == 38.2
    attention = flops_per_token(preset, 4096) - 6 * counts.active
    assert attention == 6 * 62 * 128 * (192 + 128) * 4096


def test_generation_with_the_kv_cache_equals_the_full_forward():
    model = ours()
    with torch.no_grad():
        full = model(IDS, generating=True).logits_BSV
    torch.testing.assert_close(decoded_logits(model, IDS, 7), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw, field", [
    ({"kv_lora_rank": None}, "model.kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "model.qk_rope_head_dim"),
    ({"q_lora_rank": 0}, "model.q_lora_rank"),
    ({"position_encoding": "alibi"}, "model.position_encoding"),
    ({"attention": "mqa"}, "model.attention"),
    ({"first_k_dense_replace": 4}, "model.first_k_dense_replace"),
])
def test_mla_and_dense_layer_keys_are_checked(kw, field):
    from moe.config.rules.architecture import validate_model

    with pytest.raises(ConfigError) as err:
        validate_model(replace(ours().model_config, **kw))
    assert err.value.field == field and "Fix:" in str(err.value)


def test_init_from_hf_takes_a_deepseek_v3_directory(tmp_path):
    """train.py model.init_from_hf=DIR: the architecture from config.json (MLA keys, dense layers), and a
    moe_opt that routes otherwise than the checkpoint is refused naming every key to set."""
    from omegaconf import OmegaConf

    from moe.config.schema import TrainConfig
    from moe.hf.start import hf_start

    model = ours()
    to_hf(model).save_pretrained(tmp_path / "ds")
    cfg = OmegaConf.structured(TrainConfig)
    cfg.data.tokenizer, cfg.model.init_from_hf = None, str(tmp_path / "ds")
    with pytest.raises(ConfigError) as err:
        # the default moe_opt: softmax, no groups
        hf_start(cfg.model, cfg.moe_opt, cfg.data)
    assert err.value.field == "moe_opt.score_function" and "moe_opt.num_groups=4" in err.value.fix
    for key, value in vars(model.moe_opt).items():
        if key != "name":
            cfg.moe_opt[key] = value
    m = OmegaConf.merge(cfg.model, hf_start(cfg.model, cfg.moe_opt, cfg.data).model)
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.first_k_dense_replace, m.dense_intermediate_size) \
        == ("mla", 16, 12, 1, 40)


# -- YaRN (the released DeepSeek-V3's RoPE, at CPU size) and multi-token-prediction layers ------------------

# factor 4 over 16 original positions (64 in all, as max_position_embeddings); mscale_all_dim != mscale
# makes cos/sin's factor differ from 1 as well as the softmax scale
YARN = [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
         "mscale_all_dim": 0.5}]
OURS_YARN = dict(rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=16, rope_mscale=1.0,
                 rope_mscale_all_dim=0.5, max_position_embeddings=64)
LONG = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(6))  # past the 16 original


@pytest.mark.parametrize("rope", YARN)
def test_yarn_from_hf_matches_transformers_logits_past_the_original_context(rope):
    from tests._hf_loading import relative_error

    hf = hf_model(*CASES[0], rope=rope)
    model = from_hf(hf).eval()
    cfg = model.model_config
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_mscale_all_dim) == ("yarn", 4.0, rope["mscale_all_dim"])
    with torch.no_grad():
        assert relative_error(model(LONG).logits_BSV, hf(LONG).logits) < 1e-5


def test_yarn_export_loads_cleanly_with_equal_logits_and_no_mtp_layer(tmp_path):
    import json

    from tests._hf_loading import loads_cleanly, relative_error

    model = ours(**OURS_YARN)
    to_hf(model).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 0
    assert written["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1.0e4, "factor": 4.0,
                                          "original_max_position_embeddings": 16, "mscale": 1.0,
                                          "mscale_all_dim": 0.5}
    hf = loads_cleanly(DeepseekV3ForCausalLM, tmp_path)
    assert hf.config.num_nextn_predict_layers == 0
    with torch.no_grad():
        assert relative_error(hf(LONG).logits, model(LONG).logits_BSV) < 1e-5
    back = from_hf(tmp_path)
    assert back.model_config == replace(model.model_config, name=str(tmp_path), num_kv_heads=4)


def test_a_directory_declaring_an_mtp_layer_it_does_not_hold_is_read_without_one(tmp_path, capsys):
    """transformers' DeepseekV3Config declares num_nextn_predict_layers=1 by default, and its save_pretrained
    writes no such layer: the import reads the main model (model.mtp_layers=0), quietly. A directory that
    holds its MTP layer (the released one's layer 61) is read with it: tests/test_mtp.py."""
    from moe.hf.families import read_hf_config

    hf = hf_model(*CASES[0], rope=YARN[0])
    hf.save_pretrained(tmp_path)
    assert hf.config.num_nextn_predict_layers == 1
    read_hf_config(tmp_path, "hf_dir")
    model = from_hf(tmp_path).eval()
    assert (model.model_config.num_layers, model.model_config.mtp_layers) == (3, 0)
    with torch.no_grad():
        torch.testing.assert_close(model(LONG).logits_BSV, hf(LONG).logits, rtol=0, atol=1e-5)
    said = capsys.readouterr().err
    assert "note:" not in said and "does not define" not in said and "UNEXPECTED" not in said


# -- the latent KV cache: decode steps read each token's latent and RoPE key, W_UK and W_UV absorbed -------

PADDED = [[5, 9, 3, 7, 11, 2, 8, 40, 41, 12], [4, 1, 57]]


# each way MLA is set up: the query latent with DeepSeek's interleaved RoPE and YaRN (mscale_all_dim !=
# mscale: the softmax scale corrected), no query latent (DeepSeek-V2-Lite's q_lora_rank: null) with
# rotate-half RoPE, and a sliding window (the cache trimmed to it)
LATENT_CACHE_MODELS = {"q_lora, interleaved, YaRN": lambda: from_hf(hf_model(*CASES[0], rope=YARN[1])).eval(),
                       "no q_lora": lambda: from_hf(hf_model(*CASES[1])).eval(),
                       "window 4": lambda: ours(sliding_window=4)}


@pytest.mark.parametrize("name", list(LATENT_CACHE_MODELS))
@pytest.mark.parametrize("step", [1, 3])  # one token a call, and calls of 3 tokens after the prefill
def test_latent_cache_logits_equal_the_expanded_caches_and_the_full_forward(name, step):
    from moe.infer.generate import left_pad
    from tests._hf_loading import relative_error

    model = LATENT_CACHE_MODELS[name]()
    ids_BS, mask_BS = left_pad(PADDED, pad_token_id=0)
    with torch.no_grad():
        full = model(ids_BS, attention_mask_BS=mask_BS, generating=True).logits_BSV
    latent = decoded_logits(model, ids_BS, 4, mask_BS, step=step)
    expanded = decoded_logits(model, ids_BS, 4, mask_BS, latent=False, step=step)
    real = mask_BS.bool()  # a pad's own logits are not used
    assert relative_error(latent[real], expanded[real]) < 2e-6  # measured <= 6.6e-7 of the largest logit
    assert relative_error(latent[real], full[real]) < 2e-6


@pytest.mark.parametrize("case, rope", [(CASES[0], YARN[1]), (CASES[1], None)])
def test_latent_cache_greedy_tokens_equal_the_expanded_caches_and_transformers(case, rope):
    """A left-padded batch past YaRN's original context; the cache's bytes are the latent's: layers x tokens
    x (kv_lora_rank + qk_rope_head_dim) x 4 (fp32), pads included, the last new token never fed."""
    from moe.infer.generate import generate, left_pad

    hf = hf_model(*case, rope=rope)
    model = from_hf(hf).eval()
    ids_BS, mask_BS = left_pad(PADDED, pad_token_id=0)
    n = 14  # to position 24, past the 16 original ones
    want = hf.generate(input_ids=ids_BS, attention_mask=mask_BS, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, eos_token_id=None)[:, ids_BS.shape[1]:].tolist()
    latent = generate(model, ids_BS, mask_BS, max_new_tokens=n)
    expanded = generate(model, ids_BS, mask_BS, max_new_tokens=n, latent_cache=False)
    assert latent.tokens == expanded.tokens == want
    cfg = model.model_config
    tokens = ids_BS.shape[0] * (ids_BS.shape[1] + n - 1)
    assert latent.cache_bytes == cfg.num_layers * tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    # the expanded cache: every head's key and value, the value padded to the key's width (moe/model/mla.py)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert expanded.cache_bytes == cfg.num_layers * tokens * cfg.num_heads * 2 * qk * 4
