"""DeepSeek-V2 / DeepSeek-V2-Lite both ways (moe/hf/deepseek_v2.py): a tiny random DeepseekV2ForCausalLM
(MLA with and without the query latent, a dense first layer, YaRN, softmax routing greedy or group-limited,
two shared experts) imports with transformers' logits and greedy tokens, our model exports to a directory
transformers loads cleanly with our logits, init_from_hf trains and re-imports; the released DeepSeek-V2-Lite
config.json reads as conf/model/deepseek_v2_lite.yaml, 15.7B parameters.
"""
import json
from dataclasses import asdict, replace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

from moe.config import ModelConfig, MoEOptConfig, TrainConfig
from moe.config.size import param_breakdown
from moe.errors import ConfigError
from moe.hf import from_hf, model_config_from_hf, moe_opt_from_hf, tensor_source, to_hf
from moe.hf.start import hf_start
from moe.infer.generate import generate
from moe.infer.load import model_from_hf_dir
from moe.model import MoETransformer
from moe.model.rope import attention_factor, inverse_frequencies, mla_softmax_scale
from tests._hf_loading import loads_cleanly, relative_error

V = 61
# YaRN over 16 original positions (64 in all): DeepSeek-V2-Lite's mscales (cos/sin unscaled, the softmax
# scale corrected), and mscale_all_dim != mscale (both corrected)
LITE_YARN = {"rope_type": "yarn", "rope_theta": 1.0e4, "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
OTHER_YARN = {"rope_type": "yarn", "rope_theta": 1.0e4, "factor": 4.0, "original_max_position_embeddings": 16,
              "mscale": 1.0, "mscale_all_dim": 0.5}
# V2-Lite's shape (no query latent, greedy top-k, unscaled) and V2's (query latent, scaled, top-4 within 2
# of 4 groups each scored by its best expert: moe_opt.group_score_experts=1, as DeepSeek-V2's top-6 in 3 of 8)
CASES = {
    "lite": dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                 rope_parameters=LITE_YARN),
    "v2": dict(q_lora_rank=16, topk_method="group_limited_greedy", n_group=4, topk_group=2,
               num_experts_per_tok=4, routed_scaling_factor=1.5, rope_parameters=OTHER_YARN),
}
LONG = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(6))  # past the 16 original


def hf_config(**kw) -> DeepseekV2Config:
    config = DeepseekV2Config(**dict(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
        num_attention_heads=4, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=12,
        qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10, first_k_dense_replace=1,
        max_position_embeddings=64, rms_norm_eps=1e-6, norm_topk_prob=False) | kw)
    config._attn_implementation = "sdpa"
    return config


def hf_model(case: str, seed: int = 0, **kw) -> DeepseekV2ForCausalLM:
    """Every weight random (norms about 1)."""
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(hf_config(**CASES[case] | kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.2)
    return model


def ours(seed: int = 0, routing: dict | None = None, **kw) -> MoETransformer:
    """Our MLA model with DeepSeek-V2-Lite's pieces at CPU size, routed as DeepSeek-V2 (softmax, top-k weights
    as they are, scaled 1.5, 4 groups of which 2; `routing`: other moe_opt values)."""
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=12, dense_intermediate_size=40,
                      num_layers=3, num_heads=4, num_kv_heads=4, num_experts=8, top_k=2,
                      first_k_dense_replace=1, shared_expert_intermediate_size=24, rms_norm_eps=1e-6,
                      attention="mla", q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6,
                      qk_rope_head_dim=8, v_head_dim=10,
                      max_position_embeddings=64, rope_theta=1.0e4, rope_type="yarn", rope_factor=4.0,
                      rope_original_max_position_embeddings=16, rope_mscale=0.707, rope_mscale_all_dim=0.707,
                      hf_family="deepseek_v2")
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, normalize_top_k=False, num_groups=4,
                       group_top_k=2, topk_scaling_factor=1.5)
    torch.manual_seed(seed)
    model = MoETransformer(replace(cfg, **kw), replace(opt, **routing or {})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_greedy(hf, ids_BS: torch.Tensor, n: int) -> list[list[int]]:
    out = hf.generate(input_ids=ids_BS, attention_mask=torch.ones_like(ids_BS), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, ids_BS.shape[1]:].tolist()


@pytest.mark.parametrize("case", CASES)
def test_a_directory_imports_with_transformers_logits_and_greedy_tokens(case, tmp_path, capsys):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    model = model_from_hf_dir(tmp_path)  # what infer.py hf_dir= loads
    assert "warning" not in capsys.readouterr().err
    cfg, opt = model.model_config, model.moe_opt
    assert (cfg.hf_family, cfg.q_lora_rank, cfg.rope_mscale_all_dim) == \
        ("deepseek_v2", CASES[case]["q_lora_rank"], CASES[case]["rope_parameters"]["mscale_all_dim"])
    assert [b.is_moe for b in model.layers] == [False, True, True]
    assert (opt.score_function, opt.normalize_top_k, opt.enable_expert_bias) == ("softmax", False, False)
    assert (opt.num_groups, opt.group_score_experts, opt.topk_scaling_factor) == \
        ((None, None, None) if case == "lite" else (4, 1, 1.5))
    with torch.no_grad():
        assert relative_error(model(LONG).logits_BSV, hf(LONG).logits) < 1e-5
    assert generate(model, LONG[:, :12], max_new_tokens=14).tokens == hf_greedy(hf, LONG[:, :12], 14)


@pytest.mark.parametrize("kw, opt", [
    ({}, {}),
    ({"q_lora_rank": 16, "tie_word_embeddings": True}, {}),
    ({"first_k_dense_replace": 0, "dense_intermediate_size": None},
     {"group_top_k": 1, "group_score_experts": 1}),  # top-2 in 1 group, scored by its best 1
])
def test_an_export_loads_in_transformers_with_our_logits_and_reimports_as_itself(kw, opt, tmp_path):
    model = ours(routing=opt, **kw)
    to_hf(model).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["model_type"], written["topk_method"], written["n_group"], written["topk_group"],
            written["routed_scaling_factor"], written["norm_topk_prob"]) == \
        ("deepseek_v2", "group_limited_greedy", 4, opt.get("group_top_k", 2), 1.5, False)
    hf = loads_cleanly(DeepseekV2ForCausalLM, tmp_path)  # no missing or unexpected keys, no warnings
    with torch.no_grad():
        assert relative_error(hf(LONG).logits, model(LONG).logits_BSV) < 1e-5
    back = model_from_hf_dir(tmp_path)
    assert back.model_config == replace(model.model_config, name=str(tmp_path))
    assert asdict(back.moe_opt) | {"name": None} == asdict(moe_opt_from_hf(hf.config)) | {"name": None}
    r = back.moe_opt
    assert (r.num_groups, r.group_top_k, r.group_score_experts, r.topk_scaling_factor) == \
        (4, opt.get("group_top_k", 2), opt.get("group_score_experts"), 1.5)


def test_an_export_without_shared_experts_computes_our_logits():
    """DeepseekV2Moe always builds its shared experts (modeling_deepseek_v2.py:126-128): zero-wide here (its
    initialisation warns "Initializing zero-element tensors is a no-op" when built)."""
    model = ours(shared_expert_intermediate_size=0)
    hf = to_hf(model)
    assert hf.config.n_shared_experts == 0
    with torch.no_grad():
        assert relative_error(hf(LONG).logits, model(LONG).logits_BSV) < 1e-5


def test_init_from_hf_then_training_then_export_reimports_with_the_loss_it_trained_to(tmp_path):
    """model.init_from_hf=DIR as train.py settles it (the default moe_opt refused: no groups), each
    tensor read as ranks do, 3 optimizer steps, the export and its import again: the same loss."""
    hf = hf_model("v2")
    hf.save_pretrained(tmp_path / "start")
    cfg = OmegaConf.structured(TrainConfig)
    cfg.data.tokenizer, cfg.model.init_from_hf = None, str(tmp_path / "start")
    with pytest.raises(ConfigError) as err:
        hf_start(cfg.model, cfg.moe_opt, cfg.data)
    assert err.value.field == "moe_opt.num_groups" and "moe_opt.normalize_top_k=false" in err.value.fix
    for key, value in asdict(moe_opt_from_hf(hf.config)).items():
        if key != "name":
            cfg.moe_opt[key] = value
    start = hf_start(cfg.model, cfg.moe_opt, cfg.data)
    model_cfg = OmegaConf.to_object(OmegaConf.merge(cfg.model, start.model))
    assert model_cfg.hf_family == "deepseek_v2" and model_cfg.q_lora_rank == 16
    with torch.device("meta"):
        model = MoETransformer(model_cfg, OmegaConf.to_object(cfg.moe_opt), init_seed=0)
    model.materialize("cpu", tensor_source(tmp_path / "start", model_cfg))
    with torch.no_grad():
        assert relative_error(model.eval()(LONG).logits_BSV, hf(LONG).logits) < 1e-5
    labels = torch.roll(LONG, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    first = None
    for _ in range(3):
        out = model(LONG, labels_BS=labels)
        first = float(out.lm_loss) if first is None else first
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = float(model.eval()(LONG, labels_BS=labels).lm_loss)
        assert trained < first
        to_hf(model).save_pretrained(tmp_path / "tuned")
        again = from_hf(tmp_path / "tuned").eval()
        assert float(again(LONG, labels_BS=labels).lm_loss) == pytest.approx(trained, rel=1e-6)


@pytest.mark.parametrize("kw, field", [
    ({"norm_topk_prob": True}, "norm_topk_prob"),  # transformers ignores it, DeepSeek's code renormalises
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_import_refuses_what_transformers_and_ours_compute_otherwise(kw, field):
    config = hf_config(**CASES["lite"] | kw)
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(config)
    assert err.value.field == field


@pytest.mark.parametrize("opt, field", [
    ({"score_function": "sigmoid"}, "moe_opt.score_function"),
    ({"enable_expert_bias": True}, "moe_opt.enable_expert_bias"),
    ({"normalize_top_k": None}, "moe_opt.normalize_top_k"),  # top-2 renormalised by default
    ({"group_top_k": 1}, "moe_opt.group_score_experts"),  # groups scored by their best 2 (top_k/group_top_k)
])
def test_export_refuses_routing_deepseek_v2_cannot_express(opt, field):
    model = ours()
    model.moe_opt = replace(model.moe_opt, **opt)
    with pytest.raises(ConfigError) as err:
        to_hf(model)
    assert err.value.field == field and "Fix:" in str(err.value)


# the released DeepSeek-V2-Lite config.json (deepseek-ai/DeepSeek-V2-Lite), 4.x's spelling
RELEASED_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "greedy", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


def test_the_released_deepseek_v2_lite_config_reads_as_the_preset_with_its_yarn(tmp_path):
    from conftest import REPO

    from moe.hf.families import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(RELEASED_LITE))
    hf_cfg = read_hf_config(tmp_path, "hf_dir")
    preset = ModelConfig(**OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/deepseek_v2_lite.yaml")))
    cfg = model_config_from_hf(hf_cfg)
    assert cfg == replace(preset, name=str(tmp_path))
    opt = moe_opt_from_hf(hf_cfg)
    assert (opt.score_function, opt.normalize_top_k, opt.num_groups, opt.topk_scaling_factor) == \
        ("softmax", False, None, None)
    # YaRN as transformers computes it: frequencies bit for bit, cos/sin unscaled (mscale = mscale_all_dim),
    # the softmax scale 1/sqrt(192) x (0.0707 ln 40 + 1)^2
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    assert torch.equal(inverse_frequencies(cfg, 64), inv_freq) and attention_factor(cfg) == factor == 1.0
    assert mla_softmax_scale(cfg, 192) == yarn_apply_mscale(hf_cfg.rope_parameters, 192 ** -0.5)
    counts = param_breakdown(preset)
    # 15.7B; 2.66B active per token, 2.45B without the input embedding (DeepSeek's "2.4B")
    assert round(counts.total / 1e9, 1) == 15.7 and round(counts.active / 1e9, 2) == 2.66
    assert counts.num_moe_layers == 26
