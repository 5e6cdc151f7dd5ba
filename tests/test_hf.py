"""Hugging Face Mixtral interop: logits parity both ways, save/load dirs, aux-loss normalisation, refusals.

Runs under transformers 5 (stacked experts in memory) and 4.x (per-expert modules, the Trainium pin):
configs are built with `rope_theta`, which both versions accept.
"""
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from moe.config import ModelConfig, MoEOptConfig
from moe.errors import ConfigError, UserError
from moe.hf import from_hf, model_config_from_hf, to_hf
from moe.hf.families import CONVERTERS, exporter_for
from moe.hf.mixtral import Mixtral
from moe.model import MoETransformer

DROPLESS = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)

# (rope_theta, heads, kv_heads, sliding_window, top_k, experts, tied, head_dim)
CASES = [
    (1.0e6, 4, 2, None, 2, 4, False, None),
    (1.0e4, 4, 1, 5, 2, 8, True, None),
    (500.0, 4, 4, None, 1, 4, False, None),
    (1.0e6, 2, 2, 3, 3, 6, True, 8),
]


def hf_model(theta, heads, kv, window, k, experts, tied, head_dim, seed=0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=67, hidden_size=32, intermediate_size=20, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=64, sliding_window=window,
        num_experts_per_tok=k, num_local_experts=experts, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        router_aux_loss_coef=0.02, rope_theta=theta,
    )
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-inits nothing here, but make norms non-trivial so they are tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def ours(theta, heads, kv, window, k, experts, tied, head_dim, seed=0) -> MoETransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=67, hidden_size=32, intermediate_size=20, num_layers=2, num_heads=heads,
                      num_kv_heads=kv, head_dim=head_dim, max_position_embeddings=64, sliding_window=window,
                      top_k=k, num_experts=experts, tie_word_embeddings=tied, rope_theta=theta,
                      rms_norm_eps=1e-6)
    model = MoETransformer(cfg, MoEOptConfig(capacity_factor=None, eval_capacity_factor=None,
                                             normalize_top_k=True)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


IDS = torch.randint(0, 67, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", CASES)
def test_from_hf_matches_transformers_logits(case):
    hf = hf_model(*case)
    model = from_hf(hf)
    assert model.moe_opt.capacity_factor is None and model.moe_opt.normalize_top_k is True
    assert model.moe_opt.aux_loss_coeff == 0.02
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits_BSV, hf(IDS).logits, rtol=0, atol=1e-4)
    if case[6]:
        assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("case", CASES)
def test_to_hf_matches_our_logits(case):
    model = ours(*case)
    hf = to_hf(model)
    assert model_config_from_hf(hf.config).rope_theta == case[0]
    assert hf.config.sliding_window == case[3] and hf.config.num_experts_per_tok == case[4]
    assert hf.config.tie_word_embeddings == case[6]
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS).logits_BSV, rtol=0, atol=1e-4)


def test_round_trip_through_save_pretrained(tmp_path):
    model = ours(1.0e4, 4, 2, 6, 2, 4, False, None)
    to_hf(model).save_pretrained(tmp_path)
    # rope_theta at the top level too: transformers 4.x reads only that, 5.x rope_parameters
    assert json.loads((tmp_path / "config.json").read_text())["rope_theta"] == 1.0e4
    reloaded = MixtralForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    back = from_hf(tmp_path)
    with torch.no_grad():
        expected = model(IDS).logits_BSV
        torch.testing.assert_close(reloaded(IDS).logits, expected, rtol=0, atol=1e-4)
        torch.testing.assert_close(back(IDS).logits_BSV, expected, rtol=0, atol=1e-4)
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_from_hf_dir_without_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        from_hf(tmp_path)


def test_model_config_from_hf_maps_every_field():
    hf = hf_model(2.5e5, 4, 2, 7, 3, 6, True, 16).config
    hf.router_jitter_noise = 0.01
    cfg = model_config_from_hf(hf)
    assert (cfg.rope_theta, cfg.num_heads, cfg.num_kv_heads, cfg.sliding_window, cfg.top_k, cfg.num_experts,
            cfg.tie_word_embeddings, cfg.head_dim, cfg.rms_norm_eps, cfg.max_position_embeddings,
            cfg.intermediate_size, cfg.num_layers) == (2.5e5, 4, 2, 7, 3, 6, True, 16, 1e-6, 64, 20, 2)
    model = from_hf(MixtralForCausalLM(hf))
    assert model.moe_opt.jitter_eps == 0.01 and model.moe_opt.eval_capacity_factor is None


def test_load_balance_loss_is_hf_over_k():
    hf = hf_model(1.0e6, 4, 2, None, 2, 4, False, None)
    model = from_hf(hf)
    with torch.no_grad():
        router_logits = hf(IDS, output_router_logits=True).router_logits
        routing = model(IDS).routing
    for layer_logits, stats in zip(router_logits, routing, strict=True):
        hf_loss = load_balancing_loss_func((layer_logits,), num_experts=4, top_k=2)
        torch.testing.assert_close(hf_loss, 2 * stats.aux_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw,opt,field", [
    (dict(position_encoding="alibi"), {}, "model.position_encoding"),
    (dict(moe_layer_frequency=2), {}, "model.moe_layer_frequency"),
    (dict(first_k_dense_replace=1), {}, "model.first_k_dense_replace"),
    (dict(shared_expert_intermediate_size=16), {}, "model.shared_expert_intermediate_size"),
    (dict(top_k=1), {}, "moe_opt.normalize_top_k"),  # null -> raw prob at top-1
    (dict(top_k=2), dict(normalize_top_k=False), "moe_opt.normalize_top_k"),
])
def test_export_refuses_what_mixtral_cannot_express(kw, opt, field):
    cfg = ModelConfig(vocab_size=67, hidden_size=32, intermediate_size=20, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, **({"top_k": 2} | kw))
    model = MoETransformer(cfg, MoEOptConfig(**({"capacity_factor": None} | opt)))
    with pytest.raises(ConfigError) as err:
        to_hf(model)
    assert err.value.field == field and "Fix:" in str(err.value)


@pytest.mark.parametrize("field,scaling", [
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1.0e6, "factor": 2.0}),  # transformers 5
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),  # transformers 4.x
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}),  # older 4.x spelling
])
@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # 5.x, on the 4.x spelling
def test_import_refuses_rope_scaling_we_do_not_compute(field, scaling):
    config = hf_model(1.0e6, 4, 2, None, 2, 4, False, None).config
    setattr(config, field, scaling)
    with pytest.raises(ConfigError, match="rope_type"):
        model_config_from_hf(config)


def test_per_expert_layout_is_what_save_pretrained_writes(tmp_path):
    """transformers 4.x's in-memory layout is the on-disk layout of both versions: check our
    stacked <-> per-expert conversion against the file transformers itself writes."""
    model = ours(1.0e6, 4, 2, None, 2, 4, False, None)
    to_hf(model).save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    stacked = Mixtral().state_dict(model)
    per_expert = Mixtral().per_expert(stacked, num_layers=2)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in disk
    assert sorted(per_expert) == sorted(disk)
    for key, value in disk.items():
        assert torch.equal(per_expert[key], value), key



def test_safetensors_read_lazily_give_our_tensors_expert_by_expert(tmp_path):
    """tensor_source (trn1's init_from_hf) reads one tensor, or a run of experts, from the files
    save_pretrained wrote, and gives exactly our model's values, for every parameter."""
    from moe.hf import tensor_source

    model = ours(1.0e6, 4, 2, None, 2, 4, False, None)
    to_hf(model).save_pretrained(tmp_path)
    source = tensor_source(tmp_path, model.model_config)
    for name, value in model.state_dict().items():
        assert torch.equal(source(name, tuple(value.shape), None), value), name
    gate_up = model.state_dict()["layers.1.ffn.experts.gate_up"]
    assert torch.equal(source("layers.1.ffn.experts.gate_up", (2, *gate_up.shape[1:]), 1), gate_up[1:3])
    with pytest.raises(UserError, match=r"holds our layers.0.attn.o_proj.weight as \(32, 32\), where its "
                                        r"config.json implies \(3, 3\)"):
        source("layers.0.attn.o_proj.weight", (3, 3), None)


def test_the_default_config_in_eval_mode_gives_the_logits_of_its_export():
    """moe_opt=default trains with capacity 1.25 and evaluates dropless, so validation sees the model that
    is exported. Every token the same: all route to the same two experts, which a capacity drops."""
    from conftest import compose_cfg
    from omegaconf import OmegaConf

    cfg = compose_cfg()
    assert cfg.moe_opt.name == "default" and cfg.moe_opt.capacity_factor == 1.25
    torch.manual_seed(0)
    model = MoETransformer(OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.moe_opt)).eval()
    same_token = torch.full((2, 32), 5)
    with torch.no_grad():
        ours_logits = model(same_token).logits_BSV
        torch.testing.assert_close(to_hf(model)(same_token).logits, ours_logits, rtol=0, atol=1e-4)
        capacity_2 = replace(model.moe_opt, eval_capacity_factor=2.0)
        with_capacity = MoETransformer(model.model_config, capacity_2).eval()
        with_capacity.load_state_dict(model.state_dict())
        assert (with_capacity(same_token).logits_BSV - ours_logits).abs().max() > 0.01  # 2.0 drops: 100x atol


def test_weights_holding_nan_are_refused_naming_the_tensor(tmp_path):
    """model.init_from_hf / upcycle_from_hf (tensor_source) and infer.py hf_dir= (from_hf): a tensor saved
    with NaN would train or generate NaN; refused, exit 2, naming the directory and our parameter."""
    from safetensors.torch import save_file

    from moe.errors import UserError
    from moe.hf import tensor_source

    model = ours(1.0e6, 4, 2, None, 2, 4, False, None)
    to_hf(model).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.self_attn.o_proj.weight"][0, :3] = float("nan")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    source = tensor_source(tmp_path, model.model_config)
    assert torch.equal(source("layers.0.attn.o_proj.weight", (32, 32), None),
                       model.state_dict()["layers.0.attn.o_proj.weight"])
    says = r"model.init_from_hf=.* holds 3 NaN or infinite values in the tensor that becomes our layers.1"
    with pytest.raises(UserError, match=says):
        source("layers.1.attn.o_proj.weight", (32, 32), None)
    with pytest.raises(UserError, match="hf_dir=.* holds 3 NaN"):
        from_hf(tmp_path)


def test_config_keys_the_model_type_does_not_define_are_named_and_biases_refused(tmp_path, capsys):
    from moe.hf.families import read_hf_config

    to_hf(ours(1.0e6, 4, 2, None, 2, 4, False, None)).save_pretrained(tmp_path)
    read_hf_config(tmp_path, "model.init_from_hf")  # our own export (rope_theta for transformers 4.x too)
    assert "does not define" not in capsys.readouterr().err
    config = json.loads((tmp_path / "config.json").read_text())
    released_spelling = {"torch_dtype": "bfloat16"}  # transformers 4's name of dtype: no unknown key
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layer": 3, "rope_scalling": 2,
                                                      **released_spelling}))
    assert read_hf_config(tmp_path, "model.init_from_hf").num_hidden_layers == 2
    said = capsys.readouterr().err
    assert "has keys mixtral does not define, ignored: num_hidden_layer, rope_scalling" in said
    biased = hf_model(1.0e6, 4, 2, None, 2, 4, False, None).config
    biased.attention_bias = True
    with pytest.raises(ConfigError, match="attention_bias=True is not supported"):
        model_config_from_hf(biased)


def test_hf_family_picks_the_exporter_and_an_unknown_one_is_refused_naming_the_key():
    assert exporter_for(ModelConfig()).hf_class == "MixtralForCausalLM"
    assert exporter_for(ModelConfig(hf_family="deepseek_v3")).hf_class == "DeepseekV3ForCausalLM"
    with pytest.raises(ConfigError, match="model.hf_family"):
        exporter_for(ModelConfig(hf_family="llama4"))


@pytest.mark.parametrize("family", list(CONVERTERS))
def test_the_start_up_fit_check_reads_the_tensors_a_run_reads(family):
    """moe.hf.start checks a directory's final norm and first and last routers by their keys in the files
    (fit_tensors, ExportAdapter.router_key): the same keys the family's reader takes them from when the run
    materialises its weights."""
    from moe.hf.start import fit_tensors

    adapter = CONVERTERS[family]()
    dense_first = 1 if family == "deepseek_v3" else 0
    model_cfg = replace(ModelConfig(), num_layers=3, first_k_dense_replace=dense_first)
    read = adapter.reader(model_cfg, {})
    for name, (key, shape) in fit_tensors(model_cfg, adapter.router_key).items():
        asked = []

        def get(k, asked=asked, shape=shape):
            asked.append(k)
            return torch.zeros(shape)

        read(name, get)
        assert asked == [key], name
    assert set(fit_tensors(model_cfg, adapter.router_key)) == {
        "norm.weight", f"layers.{model_cfg.num_layers - 1}.ffn.router.weight",
        f"layers.{model_cfg.first_k_dense_replace}.ffn.router.weight"}
