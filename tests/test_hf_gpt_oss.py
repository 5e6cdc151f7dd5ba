"""gpt-oss interop: attention sinks, per-layer sliding/full attention, q/k/v/o, router and expert biases, the
clamped SwiGLU with its interleaved gate/up columns; logits and greedy tokens equal transformers'
GptOssForCausalLM both ways, each piece against transformers' own code, and what is refused."""
import logging
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

from moe.config import MoEOptConfig
from moe.config.derived import head_dim_of
from moe.config.rules.architecture import validate_model
from moe.config.schema import TrainConfig
from moe.config.size import flops_per_token, param_breakdown
from moe.errors import ConfigError, UserError
from moe.hf import check_exportable, from_hf, tensor_source, to_hf
from moe.hf.gpt_oss import GptOss, deinterleave, interleave
from moe.hf.start import hf_start
from moe.infer.generate import generate
from moe.infer.load import model_from_hf_dir
from moe.model import MoETransformer
from moe.model.routing import clamped_swiglu, router_probs, top_k_routing
from moe.module.optim import param_groups
from tests._hf_loading import decoded_logits, loads_cleanly, relative_error
from tests._tp_attention import attention_grads, two_rank_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops on a shared box (conftest.one_thread)

V, WINDOW = 97, 4
IDS = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))  # longer than the window


def hf_config(**kw) -> GptOssConfig:
    """2 layers (sliding, then full), hidden 64, 4 experts top 2, plain RoPE."""
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 1.0e4})
    return GptOssConfig(**(base | kw))


def hf_model(dtype=torch.float32, seed=0) -> GptOssForCausalLM:
    """Every weight random, biases and sinks large enough to matter, some expert pre-activations past the
    clamp (|x| > 7)."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "bias")):
                p.normal_(0, 1.0)
            elif name.endswith("gate_up_proj"):
                p.normal_(0, 0.6)
            else:
                p.normal_(0, 0.2)
    return model.to(dtype)


def logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.logits_BSV


def assert_relative(got, want, rel):
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= rel, f"max abs error {err:.2e} of the largest value exceeds {rel:.0e}"


def test_import_gives_transformers_logits_past_the_window_and_records_the_pieces():
    hf = hf_model()
    ours = from_hf(hf).eval()
    cfg = ours.model_config
    assert (cfg.attention_layer_types, cfg.sliding_window, cfg.hf_family) == \
        (["sliding_attention", "full_attention"], WINDOW, "gpt_oss")
    assert (cfg.qkv_bias, cfg.o_bias, cfg.attention_sinks, cfg.router_bias, cfg.expert_proj_bias,
            cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit) == \
        (True, True, True, True, True, "clamped_swiglu", 1.702, 7.0)
    assert_relative(logits(ours), logits(hf), 1e-5)  # measured 2.5e-7


def test_export_loads_in_transformers_with_every_key_no_warning_and_the_same_logits(tmp_path):
    ours = from_hf(hf_model()).eval()
    to_hf(ours).save_pretrained(tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with _no_python_warnings():
            back, info = GptOssForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    finally:
        hf_logger.removeHandler(handler)
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched keys
    assert [r.getMessage() for r in records] == []
    assert back.config.layer_types == ["sliding_attention", "full_attention"]
    assert back.config.rope_parameters["rope_type"] == "default"
    assert_relative(logits(back.eval()), logits(ours), 1e-5)  # measured 0 (same weights, same maths)


# the released configs' RoPE, GptOssConfig's default (configuration_gpt_oss.py:89-97, theta :37)
RELEASED_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def test_released_yarn_imports_and_exports_with_transformers_logits(tmp_path):
    """The released configs' RoPE (YaRN: factor 32 over 4096 positions, truncate false) maps onto the
    rope_* keys; our logits equal transformers' on import and after export, which writes the same
    rope_parameters back."""
    torch.manual_seed(0)
    hf = GptOssForCausalLM(hf_config(rope_parameters=dict(RELEASED_YARN), max_position_embeddings=131072))
    plain = GptOssForCausalLM(hf_config()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    plain.load_state_dict(hf.state_dict())  # the same weights under plain RoPE
    hf.eval()
    ours = from_hf(hf).eval()
    m = ours.model_config
    assert (m.rope_type, m.rope_theta, m.rope_factor, m.rope_original_max_position_embeddings,
            m.rope_beta_fast, m.rope_beta_slow, m.rope_truncate, m.rope_attention_factor) == \
        ("yarn", 150000.0, 32.0, 4096, 32.0, 1.0, False, None)
    assert relative_error(logits(plain), logits(hf)) > 1e-2  # YaRN changes these logits
    assert relative_error(logits(ours), logits(hf)) <= 1e-5
    to_hf(ours).save_pretrained(tmp_path)
    back = loads_cleanly(GptOssForCausalLM, tmp_path)
    assert back.config.rope_parameters == RELEASED_YARN
    assert relative_error(logits(back), logits(ours)) <= 1e-5


class _no_python_warnings:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.seen = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert [str(w.message) for w in self.seen] == []


def test_greedy_tokens_with_our_kv_cache_are_transformers_generate(tmp_path):
    """infer.py hf_dir=DIR greedy: the directory read as infer reads it, our generation with the KV cache
    (sliding layer's cache trimmed to its window, the full layer's not) against transformers' generate."""
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    ours = model_from_hf_dir(tmp_path)
    prompt = IDS[:, :6]
    want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                       pad_token_id=0)[:, 6:]
    got = generate(ours, prompt, max_new_tokens=12).tokens
    assert got == want.tolist()


def test_the_kv_cache_gives_the_full_forward_with_sinks_and_windows():
    ours = from_hf(hf_model()).eval()
    assert [c.window for c in ours.new_kv_cache()] == [WINDOW, None]
    torch.testing.assert_close(decoded_logits(ours, IDS, 3), logits(ours), rtol=0, atol=1e-5)


def test_sinks_equal_transformers_eager_attention_and_train():
    """Our SDPA with the sink as a zero key (moe.model.attention) against transformers' gpt_oss
    eager_attention_forward, on a sliding window with GQA; the sinks' gradient equal too."""
    torch.manual_seed(0)
    B, H, KV, S, D = 2, 4, 2, 9, 8
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    ours = from_hf(hf_model()).layers[0].attn  # GQA 4/2 heads, window 4
    hf_attn = type("Stub", (torch.nn.Module,), {})()
    hf_attn.sinks = torch.nn.Parameter(torch.randn(H))
    hf_attn.num_key_value_groups, hf_attn.training = H // KV, False
    ours.sinks = torch.nn.Parameter(hf_attn.sinks.detach().clone())
    allowed = torch.ones(S, S).tril().bool() & ~torch.ones(S, S).tril(-WINDOW).bool()
    additive = torch.zeros(S, S).masked_fill(~allowed, float("-inf"))[None, None]
    want, _ = hf_gpt_oss.eager_attention_forward(hf_attn, q, k, v, additive, scaling=D ** -0.5)
    got = ours.attend(q, k, v, None, 0, None, enable_gqa=True).transpose(1, 2)  # SDPA scales by D ** -0.5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (want * want).sum().backward()
    (got * got).sum().backward()
    torch.testing.assert_close(ours.sinks.grad, hf_attn.sinks.grad, rtol=1e-4, atol=1e-6)


def test_clamped_swiglu_and_routing_equal_transformers_modules():
    """The activation on de-interleaved columns equals GptOssExperts._apply_gate on the interleaved ones
    (values past the clamp both ways); softmax, top-k, renormalise picks and weighs as GptOssTopKRouter's
    top-k then softmax."""
    torch.manual_seed(0)
    experts = hf_gpt_oss.GptOssExperts(hf_config())
    h = torch.randn(64, 2 * 32) * 6  # many |x| > 7
    torch.testing.assert_close(clamped_swiglu(deinterleave(h)), experts._apply_gate(h), rtol=0, atol=0)
    assert torch.equal(interleave(deinterleave(h)), h)
    router = hf_gpt_oss.GptOssTopKRouter(hf_config())
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.bias.normal_(0, 1.0)
    x = torch.randn(256, 64)
    logits_TE, want_w, want_i = router(x)
    got_w, got_i = top_k_routing(router_probs(logits_TE), 2, normalize=True)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


def test_both_expert_kernels_add_the_biases_and_the_size_counts_them():
    """The grouped GEMM (a row's expert found from the group ends) and the per-expert loop give the same
    outputs with biases and the clamped SwiGLU, rows past the last expert's (dropped) included as zeros
    by the loop only; the stacked biases get no weight decay where biases get none; param_breakdown and
    flops_per_token count the new pieces and each layer's window."""
    model = from_hf(hf_model())
    experts = model.layers[0].ffn.experts
    x = torch.randn(10, 64)
    counts = torch.tensor([3, 0, 4, 2])  # 9 rows in experts, the 10th dropped
    experts.use_grouped_mm = True
    grouped = experts(x, counts)
    experts.use_grouped_mm = False
    loop = experts(x, counts)
    torch.testing.assert_close(grouped[:9], loop[:9], rtol=1e-5, atol=1e-6)
    cfg = model.model_config
    no_decay = {id(p) for p in param_groups(model, 0.1, no_decay_norms_and_biases=True)[1]["params"]}
    assert {id(experts.gate_up_bias), id(experts.down_bias)} <= no_decay and id(experts.down) not in no_decay
    assert param_breakdown(cfg).total == sum(p.numel() for p in model.parameters())
    full = replace(cfg, attention_layer_types=None, sliding_window=None)
    attention = 6 * cfg.num_heads * 2 * head_dim_of(cfg)  # per layer and context token
    assert flops_per_token(full, 16) - flops_per_token(cfg, 16) == attention * (16 - WINDOW)


def test_bf16_logits_are_as_close_to_fp32_as_transformers_own_bf16():
    """bf16 both sides, against the fp32 model: transformers routes in bf16, we in fp32 (router_dtype), so a
    token near a tie can pick another expert on either side. Measured as a share of the largest fp32 logit:
    ours 4.3e-2, transformers' 2.9e-2, ours against theirs 6.5e-2 (this small random model has large
    biases and pre-activations past the clamp: bf16 rounding moves it more than a trained one)."""
    reference = logits(hf_model())
    hf = hf_model(torch.bfloat16)
    ours = from_hf(hf).eval()
    assert next(ours.parameters()).dtype == torch.bfloat16

    def error(model):
        return float((logits(model).float() - reference).abs().max() / reference.abs().max())

    assert error(ours) <= 2 * error(hf) and error(ours) < 0.05


def test_init_from_hf_reads_each_ranks_experts_and_a_fine_tuned_model_round_trips(tmp_path):
    """model.init_from_hf=DIR: the architecture settled from config.json, the model built on the meta device
    and filled tensor by tensor as training does, the stacked experts (and their biases) sliced per rank;
    then 20 steps, an export and a re-import keep the loss."""
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    reference = from_hf(hf)
    cfg = OmegaConf.structured(TrainConfig)
    cfg.data.tokenizer, cfg.model.init_from_hf = None, str(tmp_path / "hf")
    for key, value in vars(reference.moe_opt).items():
        if key != "name":
            cfg.moe_opt[key] = value
    settled = OmegaConf.merge(cfg.model, hf_start(cfg.model, cfg.moe_opt, cfg.data).model)
    assert (settled.attention_layer_types, settled.attention_sinks, settled.expert_activation) == \
        (["sliding_attention", "full_attention"], True, "clamped_swiglu")
    model_cfg = OmegaConf.to_object(settled)
    source = tensor_source(tmp_path / "hf", model_cfg)
    for name, p in reference.named_parameters():  # a rank holding experts 2 and 3 reads only theirs
        if getattr(p, "is_expert", False):
            torch.testing.assert_close(source(name, (2, *p.shape[1:]), 2), p.detach()[2:4], rtol=0, atol=0)
    with torch.device("meta"):
        model = MoETransformer(model_cfg, reference.moe_opt)
    model.materialize("cpu", source)
    assert_relative(logits(model.eval()), logits(hf), 1e-5)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    labels = IDS.roll(-1, dims=1)
    losses = []
    for _ in range(20):
        loss = model(IDS, labels_BS=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in model.named_parameters()
               if n.endswith(("sinks", "bias")))  # the new pieces train
    model.eval()
    to_hf(model).save_pretrained(tmp_path / "tuned")
    again = from_hf(tmp_path / "tuned").eval()
    with torch.no_grad():
        want, got = model(IDS, labels_BS=labels).lm_loss, again(IDS, labels_BS=labels).lm_loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, field", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.5e5}},
     "rope_parameters.rope_type"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config.quant_method"),
])
def test_import_refuses_a_rope_type_we_do_not_compute_and_mxfp4_naming_the_fix(change, field):
    config = hf_config()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError) as err:
        GptOss().model_config(config)
    assert err.value.field == field
    if "quant" in field:
        assert "Mxfp4Config(dequantize=True)" in err.value.fix


def test_pieces_are_refused_where_they_cannot_run(tmp_path):
    """FP8 experts and weights inside the activation cannot add the experts' biases; a layer type per layer;
    an export without sinks is no gpt-oss, and a Mixtral export refuses each gpt-oss piece (and full layers
    beside a window) rather than drop it; a directory without config.json is named."""
    cfg = GptOss().model_config(hf_config())
    opt = MoEOptConfig(capacity_factor=None)
    for kw, field in (({"fp8_experts": True}, "moe_opt.fp8_experts"),
                      ({"weights_in_activation": True}, "moe_opt.weights_in_activation")):
        with pytest.raises(ConfigError) as err:
            validate_model(cfg, replace(opt, **kw))
        assert err.value.field == field
    with pytest.raises(ConfigError) as err:
        validate_model(replace(cfg, attention_layer_types=["full_attention"]))
    assert err.value.field == "model.attention_layer_types"
    with pytest.raises(ConfigError) as err:
        GptOss().check_exportable(replace(cfg, attention_sinks=False), replace(opt, normalize_top_k=True))
    assert err.value.field == "model.attention_sinks"
    plain = dict(qkv_bias=False, o_bias=False, attention_sinks=False, router_bias=False,
                 expert_proj_bias=False, expert_activation="swiglu", attention_layer_types=None)
    check_exportable(replace(cfg, **plain, hf_family=None), opt)  # a Mixtral then
    for key in plain:
        with pytest.raises(ConfigError, match="hf_family=gpt_oss") as err:  # Mixtral would drop it
            check_exportable(replace(cfg, **(plain | {key: getattr(cfg, key)}), hf_family=None), opt)
        assert err.value.field == f"model.{key}"
    with pytest.raises(UserError, match="has no config.json"):
        model_from_hf_dir(tmp_path)


@pytest.mark.slow  # two processes, 24-36 s
def test_sinks_and_biases_split_with_their_heads_under_tp2_and_experts_under_ep2(tmp_path):
    """Two TP ranks, each filled from the directory as training fills them: the q/k/v biases split with their
    TP-interleaved rows, the sinks by head (Shard(0)), the o bias whole and added once; logits and every
    attention gradient equal one process's. Two EP ranks: each reads and holds half the experts with their
    biases; logits equal, each expert's gradients its own in one process (twice: both ranks feed the
    batch)."""
    from conftest import on_gloo_ranks

    hf = hf_model()
    hf.save_pretrained(tmp_path)
    reference = from_hf(hf)
    want = attention_grads(reference, IDS)
    assert {"layers.0.attn.sinks", "layers.0.attn.qkv_proj.bias", "layers.1.attn.o_proj.bias"} <= set(want)
    experts = {name: p.grad for name, p in reference.named_parameters() if ".experts." in name}
    assert len(experts) == 8  # gate_up, down and their biases, 2 layers
    out = on_gloo_ranks(2, two_rank_grads, str(tmp_path), IDS)
    for rank in (0, 1):
        tp2, ep2 = out[rank]["tp2"], out[rank]["ep2"]
        assert set(tp2) == set(want)
        for name, value in want.items():  # measured: within 1e-6 of each tensor's largest value
            assert_relative(tp2[name], value, 1e-5)
        assert_relative(ep2["logits"], want["logits"], 1e-5)
        first = int(ep2["first_expert"])
        assert first == 2 * rank
        for name, grad in experts.items():
            assert_relative(ep2[name], 2 * grad[first:first + 2], 1e-5)
