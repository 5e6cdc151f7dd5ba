"""GLM-4.5 both ways (moe/hf/glm4_moe.py): a tiny random transformers Glm4MoeForCausalLM (3 layers, the first
dense, partial RoPE 0.5, q/k/v biases, sigmoid routing in 2 groups with the expert bias, routed scaling 2.5, a
shared expert) imports with its logits and greedy tokens, our model exports to a directory transformers loads
with no missing or unexpected keys and no warnings, a fine-tuned import round-trips, and its MTP layer
round-trips with it. Two cases: QK-norm on with plain RoPE, QK-norm off with YaRN past the original context.
"""
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from moe.config import ModelConfig, MoEOptConfig, TrainConfig
from moe.config.size import param_breakdown
from moe.errors import ConfigError
from moe.hf import from_hf, read_hf_config, tensor_source, to_hf
from moe.hf.start import hf_start
from moe.infer.generate import generate
from moe.infer.load import model_from_hf_dir
from moe.model import MoETransformer
from tests._hf_loading import decoded_logits, loads_cleanly, perturbed, tunes_and_reimports
from tests.test_hf_families import hf_greedy, infer_greedy_is_generates, relative

V = 97
IDS = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
# the original context (8) shorter than IDS (11 tokens); factor 64 / 8, as transformers expects
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8}
CASES = {"qk_norm": dict(use_qk_norm=True), "yarn": dict(use_qk_norm=False, rope=YARN)}
# bf16 against the fp32 logits, measured over seeds 0-4 as a share of the largest fp32 logit: ours at most
# 9.0e-3, transformers' own bf16 at most 8.6e-3 (both route in fp32), ours against theirs at most 7.0e-3
BF16_RELATIVE = 2e-2


def hf_config(use_qk_norm=True, rope=None, **kw):
    config = transformers.Glm4MoeConfig(**dict(
        vocab_size=V, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
        n_routed_experts=8, num_experts_per_tok=4, n_shared_experts=1, n_group=2, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=use_qk_norm,
        attention_bias=True, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1.0e4, "partial_rotary_factor": 0.5}
        | (rope or {}),
    ) | kw)
    config._attn_implementation = "sdpa"
    return config


def hf_model(case: str = "qk_norm", dtype=torch.float32, seed: int = 0, **kw):
    """Every norm away from 1, every bias and expert bias away from 0, so that they are tested too."""
    torch.manual_seed(seed)
    return perturbed(transformers.Glm4MoeForCausalLM(hf_config(**CASES[case], **kw)).eval()).to(dtype)


def our_model(seed: int = 0, **kw) -> MoETransformer:
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=16, dense_intermediate_size=48,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24, num_experts=8, top_k=4,
                      first_k_dense_replace=1, shared_expert_intermediate_size=16, max_position_embeddings=64,
                      rope_theta=1.0e4, rms_norm_eps=1e-6, qkv_bias=True, qk_norm="per_head",
                      partial_rotary_factor=0.5, hf_family="glm4_moe")
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, score_function="sigmoid",
                       num_groups=2, group_top_k=2, topk_scaling_factor=2.5, enable_expert_bias=True,
                       normalize_top_k=True)
    torch.manual_seed(seed)
    return perturbed(MoETransformer(replace(cfg, **kw), opt).eval())


@pytest.mark.parametrize("case", CASES)
def test_a_directory_imports_with_transformers_logits_and_greedy_tokens(case, tmp_path, capsys):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    model = model_from_hf_dir(tmp_path)  # what infer.py hf_dir= loads
    assert "warning" not in capsys.readouterr().err  # every key of the config.json transformers wrote is read
    cfg, opt = model.model_config, model.moe_opt
    assert (cfg.hf_family, cfg.partial_rotary_factor, cfg.qkv_bias, cfg.o_bias) == \
        ("glm4_moe", 0.5, True, False)
    assert cfg.qk_norm == ("per_head" if case == "qk_norm" else "none")
    assert cfg.rope_type == CASES[case].get("rope", {}).get("rope_type", "default")
    assert [b.is_moe for b in model.layers] == [False, True, True]
    assert (opt.score_function, opt.num_groups, opt.group_top_k, opt.topk_scaling_factor) == \
        ("sigmoid", 2, 2, 2.5)
    assert opt.enable_expert_bias and opt.normalize_top_k and opt.capacity_factor is None
    with torch.no_grad():
        assert relative(model(IDS).logits_BSV, hf(IDS).logits) < 1e-5  # measured: 4.3e-7, 2.6e-7
        assert relative(decoded_logits(model, IDS, 4), hf(IDS).logits) < 1e-5  # the KV cache, token by token
    assert generate(model, IDS, max_new_tokens=6).tokens == hf_greedy(hf, IDS, 6)
    # model.init_from_hf reads a rank's experts only: experts 2-5 of the last layer are those of the whole
    name = "layers.2.ffn.experts.gate_up"
    whole = model.state_dict()[name]
    part = tensor_source(tmp_path, cfg)(name, (4, *whole.shape[1:]), 2)
    assert torch.equal(part, whole[2:6])


def test_infer_hf_dir_greedy_gives_transformers_greedy_tokens(tmp_path):
    """`infer.py hf_dir=DIR greedy=true` (its run(), in this process) on a directory with a tokenizer."""
    hf = hf_model(vocab_size=512)  # the bundled sample tokenizer's 512 ids
    infer_greedy_is_generates(hf, tmp_path)


@pytest.mark.parametrize("kw", [{}, dict(qk_norm="none", rope_type="linear", rope_factor=4.0)])
def test_an_export_loads_in_transformers_with_our_logits_and_reimports_as_itself(kw, tmp_path, capsys):
    model = our_model(**kw)
    to_hf(model).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 0  # it holds no multi-token-prediction layer
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.5
    hf = loads_cleanly(transformers.AutoModelForCausalLM, tmp_path)  # no missing keys, no warnings
    assert type(hf).__name__ == "Glm4MoeForCausalLM" and hf.config.use_qk_norm is (not kw)
    assert [hasattr(layer.mlp, "experts") for layer in hf.model.layers] == [False, True, True]
    with torch.no_grad():
        assert relative(hf(IDS).logits, model(IDS).logits_BSV) < 1e-5
    again = model_from_hf_dir(tmp_path)
    assert "warning" not in capsys.readouterr().err
    assert {k: v for k, v in asdict(again.model_config).items() if k != "name"} == \
        {k: v for k, v in asdict(model.model_config).items() if k != "name"}
    for key in ("score_function", "num_groups", "group_top_k", "topk_scaling_factor", "normalize_top_k"):
        assert getattr(again.moe_opt, key) == getattr(model.moe_opt, key), key


def test_an_export_without_a_shared_expert_or_expert_bias_writes_zero_ones_with_our_logits():
    """Glm4MoeMoE always has a shared expert and an expert bias: ours without them export a zero-width one and
    a zero bias (transformers' init of the zero-width MLP warns "Initializing zero-element tensors is a
    no-op", its own class's, so this one is compared in memory)."""
    model = our_model(shared_expert_intermediate_size=0)
    model.moe_opt = replace(model.moe_opt, enable_expert_bias=False)
    model = MoETransformer(model.model_config, model.moe_opt).eval()
    hf = to_hf(model)
    assert hf.config.n_shared_experts == 0 and not hf.model.layers[1].mlp.gate.e_score_correction_bias.any()
    with torch.no_grad():
        assert relative(hf(IDS).logits, model(IDS).logits_BSV) < 1e-5


def test_init_from_hf_then_training_then_export_reimports_with_the_loss_it_trained_to(tmp_path):
    """model.init_from_hf=DIR as train.py settles and materialises it (the checkpoint's routing required),
    3 optimizer steps, the export, and its import again: the same model (its loss)."""
    hf = hf_model("yarn")
    hf.save_pretrained(tmp_path / "start")
    cfg = OmegaConf.structured(TrainConfig)
    cfg.data.tokenizer, cfg.model.init_from_hf = None, str(tmp_path / "start")
    with pytest.raises(ConfigError) as err:  # our default softmax router is not the checkpoint's
        hf_start(cfg.model, cfg.moe_opt, cfg.data)
    assert err.value.field == "moe_opt.score_function"
    for key, value in vars(from_hf(hf).moe_opt).items():
        if key != "name":
            cfg.moe_opt[key] = value
    start = hf_start(cfg.model, cfg.moe_opt, cfg.data)
    model_cfg = OmegaConf.to_object(OmegaConf.merge(cfg.model, start.model))
    assert (model_cfg.hf_family, model_cfg.partial_rotary_factor, model_cfg.rope_type) == \
        ("glm4_moe", 0.5, "yarn")
    with torch.device("meta"):
        model = MoETransformer(model_cfg, OmegaConf.to_object(cfg.moe_opt), init_seed=0)
    model.materialize("cpu", tensor_source(tmp_path / "start", model_cfg))  # tensor by tensor, as ranks do
    tunes_and_reimports(model, hf, IDS, tmp_path / "tuned", "glm4_moe")


def test_bf16_logits_are_as_close_to_fp32_as_transformers_own_bf16():
    reference = hf_model()
    hf = hf_model(dtype=torch.bfloat16)
    model = from_hf(hf).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        want = reference(IDS).logits
        ours, theirs = relative(model(IDS).logits_BSV, want), relative(hf(IDS).logits, want)
        assert ours < BF16_RELATIVE and ours <= 2 * theirs
        assert relative(model(IDS).logits_BSV, hf(IDS).logits) < BF16_RELATIVE


def test_a_directory_with_an_mtp_layer_round_trips_with_it(tmp_path, capsys):
    """GLM-4.5's released directories keep a multi-token-prediction layer after the main ones (GLM-4.5-Air:
    model.layers.46.*) in DeepSeek-V3's layout (moe/hf/mtp.py): it imports as depth 0 (model.mtp_layers=1),
    every tensor as the files hold it, the main model's logits transformers'; trained, exported and
    re-imported, every tensor and both losses are kept; the export holds exactly the directory's tensors
    when untrained and loads in transformers with no warning."""
    from moe.hf.convert import write_extra
    from moe.hf.tensors import SafetensorsDir

    def export_hf(model, directory):  # infer.py export_hf='s writing, without a tokenizer
        to_hf(model).save_pretrained(directory)
        write_extra(model, directory)

    hf = hf_model()
    src = tmp_path / "src"
    hf.save_pretrained(src)
    files = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    mtp = {k.replace("layers.2.", "layers.3."): v + 0.01 * torch.randn(v.shape, generator=g)
           for k, v in files.items() if ".layers.2." in k}
    mtp |= {f"model.layers.3.{n}.weight": torch.rand(64, generator=g) + 0.5 for n in ("enorm", "hnorm",
                                                                                      "shared_head.norm")}
    mtp["model.layers.3.eh_proj.weight"] = 0.1 * torch.randn(64, 128, generator=g)
    mtp |= {"model.layers.3.embed_tokens.weight": files["model.embed_tokens.weight"].clone(),  # the copies
            "model.layers.3.shared_head.head.weight": files["lm_head.weight"].clone()}
    files |= mtp
    save_file(files, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))

    read_hf_config(src, "hf_dir")
    model = from_hf(src).eval()
    said = capsys.readouterr().err
    assert "note:" not in said and "UNEXPECTED" not in said
    assert model.model_config.num_layers == 3 and model.model_config.mtp_layers == 1
    sd = model.state_dict()
    for ours, key in (("mtp.0.eh_proj.weight", "eh_proj"), ("mtp.0.hnorm.weight", "hnorm"),
                      ("mtp.0.norm.weight", "shared_head.norm"),
                      ("mtp.0.block.ffn.router.weight", "mlp.gate")):
        assert torch.equal(sd[ours], files[f"model.layers.3.{key}.weight"]), ours
    with torch.no_grad():
        assert relative(model(IDS).logits_BSV, hf(IDS).logits) < 1e-5

    untouched = tmp_path / "untouched"
    export_hf(model, untouched)
    written = SafetensorsDir(untouched)
    assert set(written.file_of) == set(files)
    assert all(torch.equal(written.get(key), value) for key, value in files.items())

    model.train()
    batch = dict(input_ids_BS=IDS[:, :-1], labels_BS=IDS[:, 1:])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = tmp_path / "export"
    export_hf(model, out)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = from_hf(out)
    assert all(torch.equal(back.state_dict()[name], value) for name, value in model.state_dict().items())
    model.eval(), back.eval()
    with torch.no_grad():
        want, got = model(**batch), back(**batch)
        assert torch.equal(got.mtp_loss, want.mtp_loss) and torch.equal(got.lm_loss, want.lm_loss)
        theirs = loads_cleanly(transformers.Glm4MoeForCausalLM, out)
        assert relative(theirs(IDS).logits, model(IDS).logits_BSV) < 1e-5


EXPORT_REFUSALS = [
    (dict(o_bias=True), {}, "model.o_bias"),  # attention_bias: q, k and v only
    (dict(qk_norm="full"), {}, "model.qk_norm"),
    (dict(shared_expert_gate=True), {}, "model.shared_expert_gate"),
    (dict(dense_layers=[2]), {}, "model.dense_layers"),
    (dict(moe_layer_frequency=2, first_k_dense_replace=0), {}, "model.moe_layer_frequency"),
    (dict(sliding_window=8), {}, "model.sliding_window"),
    (dict(shared_expert_intermediate_size=24), {}, "model.shared_expert_intermediate_size"),
    ({}, dict(score_function="softmax"), "moe_opt.score_function"),
    ({}, dict(num_groups=2, group_top_k=1), "moe_opt.group_score_experts"),  # groups by their best 4, not 2
    (dict(partial_rotary_factor=0.5, hf_family="qwen3_moe"), {}, "model.partial_rotary_factor"),
]


@pytest.mark.parametrize("kw,opt,field", EXPORT_REFUSALS)
def test_an_export_refuses_what_glm_cannot_express_naming_the_key(kw, opt, field):
    model = our_model(**kw)
    model.moe_opt = replace(model.moe_opt, **opt)
    with pytest.raises(ConfigError) as err:
        to_hf(model)
    assert err.value.field == field


def test_the_glm4_5_air_preset_is_106b_with_12b_active():
    """conf/model/glm4_5_air.yaml: GLM-4.5-Air's released 106B total / 12B active, the active count without
    the embedding and the unembedding (its MTP layer not built)."""
    from omegaconf import OmegaConf as Conf

    preset = Conf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "glm4_5_air.yaml")
    cfg = Conf.to_object(Conf.merge(Conf.structured(ModelConfig), preset))
    counts = param_breakdown(cfg)
    assert round(counts.total / 1e9, 2) == 106.85 and round(counts.active / 1e9, 2) == 13.42
    assert round((counts.active - counts.embedding - counts.lm_head) / 1e9, 2) == 12.18
    assert (cfg.partial_rotary_factor, cfg.hf_family, cfg.first_k_dense_replace) == (0.5, "glm4_moe", 1)


@pytest.mark.slow  # two processes
def test_partial_rope_qk_norm_and_biases_split_with_their_heads_under_tp2_and_experts_under_ep2(tmp_path):
    """Two TP ranks, each filled from the directory as training fills it: every head keeps its partial
    RoPE, the per-head QK-norm's gradient is summed over the pair, the q/k/v biases split with their rows;
    logits and every attention gradient equal one process's. Two EP ranks: each reads and holds half the
    experts, routed by the sigmoid router with its expert bias; logits equal, each expert's gradient its own
    in one process (twice: both ranks feed the batch)."""
    from conftest import on_gloo_ranks

    from tests._tp_attention import attention_grads, two_rank_grads

    hf = hf_model()
    hf.save_pretrained(tmp_path)
    reference = from_hf(hf)
    want = attention_grads(reference, IDS)
    assert {"layers.0.attn.q_norm.weight", "layers.0.attn.qkv_proj.bias"} <= set(want)
    experts = {name: p.grad for name, p in reference.named_parameters() if ".experts." in name}
    assert len(experts) == 4  # gate_up and down of the 2 MoE layers
    out = on_gloo_ranks(2, two_rank_grads, str(tmp_path), IDS)
    for rank in (0, 1):
        tp2, ep2 = out[rank]["tp2"], out[rank]["ep2"]
        assert set(tp2) == set(want)
        for name, value in want.items():
            assert relative(tp2[name], value) < 1e-5, name
        assert relative(ep2["logits"], want["logits"]) < 1e-5
        first = int(ep2["first_expert"])
        assert first == 4 * rank
        for name, grad in experts.items():
            assert relative(ep2[name], 2 * grad[first:first + 4]) < 1e-5, name
