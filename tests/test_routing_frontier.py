"""Sigmoid scores, group-limited routing and the top-k scaling factor (DeepSeek-V3's router; DeepSeek-V2's
softmax groups scored by their best expert).

The reference is transformers' DeepseekV3TopkRouter (the DeepSeek-V3 router as released): same
logits, bias, groups and scaling give the same experts and weights. Then the layer trains with them,
the keys are validated, Mixtral export and trn1 refuse what they cannot express.
"""
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from moe.config import ModelConfig, MoEOptConfig
from moe.config.rules.architecture import validate_groups, validate_routing
from moe.errors import ConfigError
from moe.hf import check_exportable
from moe.model import MoETransformer
from moe.model.moe import MoELayer
from moe.model.routing import balance_probs, limit_to_groups, router_probs, top_k_routing

E, K, GROUPS, CHOSEN, H = 16, 4, 4, 2, 24


def deepseek_router(bias_E: torch.Tensor, scaling: float) -> DeepseekV3TopkRouter:
    config = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=GROUPS,
                              topk_group=CHOSEN, norm_topk_prob=True, routed_scaling_factor=scaling)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        router.e_score_correction_bias.copy_(bias_E)
    return router


@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_sigmoid_group_limited_routing_is_deepseek_v3s(scaling):
    bias_E = torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.1
    reference = deepseek_router(bias_E, scaling)
    x_TH = torch.randn(64, H, generator=torch.Generator().manual_seed(2))
    logits_TE, want_w, want_idx = reference(x_TH)

    scores_TE = router_probs(x_TH @ reference.weight.T, score_function="sigmoid")
    weights_TK, idx_TK = top_k_routing(scores_TE, K, None, bias_E, GROUPS, CHOSEN, scaling)

    order, want_order = idx_TK.argsort(-1), want_idx.argsort(-1)  # HF's top-k is unsorted
    assert torch.equal(idx_TK.gather(-1, order), want_idx.gather(-1, want_order))
    torch.testing.assert_close(weights_TK.gather(-1, order), want_w.gather(-1, want_order), rtol=0, atol=1e-6)
    torch.testing.assert_close(weights_TK.sum(-1), torch.full((64,), scaling), rtol=0, atol=1e-5)


def test_softmax_groups_scored_by_their_best_expert_are_deepseek_v2s():
    """group_score_experts=1: transformers' DeepseekV2TopkRouter (group_limited_greedy: a group's score is
    its best expert's, modeling_deepseek_v2.py:105), top-4 in 2 of 4 groups (top_k/group_top_k would be 2)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=GROUPS,
                              topk_group=CHOSEN, topk_method="group_limited_greedy",
                              routed_scaling_factor=1.5, num_attention_heads=4)
    reference = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        reference.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    x_TH = torch.randn(256, H, generator=torch.Generator().manual_seed(2))
    _, want_w, want_idx = reference(x_TH)
    scores_TE = router_probs(x_TH @ reference.weight.T)
    weights_TK, idx_TK = top_k_routing(scores_TE, K, False, None, GROUPS, CHOSEN, 1.5, group_scored_by=1)
    order, want_order = idx_TK.argsort(-1), want_idx.argsort(-1)  # HF's top-k is unsorted
    assert torch.equal(idx_TK.gather(-1, order), want_idx.gather(-1, want_order))
    torch.testing.assert_close(weights_TK.gather(-1, order), want_w.gather(-1, want_order), rtol=0, atol=1e-6)
    _, by_two_TK = top_k_routing(scores_TE, K, False, None, GROUPS, CHOSEN, 1.5)  # Megatron-Core's count
    assert not torch.equal(by_two_TK.sort(-1).values, idx_TK.sort(-1).values)


def test_groups_limit_every_token_to_group_top_k_groups():
    scores_TE = torch.rand(200, E, generator=torch.Generator().manual_seed(3))
    _, idx_TK = top_k_routing(scores_TE, K, None, None, GROUPS, CHOSEN)
    groups_used = (idx_TK // (E // GROUPS)).sort(-1).values
    assert all(len(set(row.tolist())) <= CHOSEN for row in groups_used)
    masked = limit_to_groups(scores_TE, K, GROUPS, CHOSEN)
    assert (masked.isinf().sum(-1) == (GROUPS - CHOSEN) * (E // GROUPS)).all()
    # without groups the same scores spread over more groups: the limit does something
    _, free_TK = top_k_routing(scores_TE, K)
    assert any(len(set((row // (E // GROUPS)).tolist())) > CHOSEN for row in free_TK)


def test_sigmoid_balance_loss_reads_scores_normalised_over_the_experts():
    scores_TE = router_probs(torch.randn(10, E), score_function="sigmoid")
    assert (scores_TE.sum(-1) - 1).abs().max() > 0.5  # sigmoid scores do not sum to 1...
    torch.testing.assert_close(balance_probs(scores_TE, "sigmoid").sum(-1), torch.ones(10))  # ...these do
    assert balance_probs(scores_TE, "softmax") is scores_TE


def deepseek_layer_opt(**kw):
    return MoEOptConfig(capacity_factor=None, score_function="sigmoid", num_groups=GROUPS, group_top_k=CHOSEN,
                        topk_scaling_factor=2.5, enable_expert_bias=True, **kw)


def test_a_deepseek_v3_shaped_layer_trains_and_its_router_gets_gradient():
    torch.manual_seed(0)
    layer = MoELayer(H, 16, E, K, deepseek_layer_opt(), shared_expert_intermediate_size=32)
    x = torch.randn(2, 8, H)
    y, stats = layer(x)
    (y.square().mean() + 0.01 * stats.aux_loss).backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert 0.5 < float(stats.aux_loss) < 4 and torch.isfinite(stats.entropy)
    assert int(stats.tokens_per_expert_E.sum()) == 16 * K


@pytest.mark.parametrize("model", ["tiny_fine_grained", "tiny_deepseek_v3"])
def test_the_fine_grained_presets_compose_validate_and_train(tmp_path, model):
    from conftest import compose_cfg

    from moe.config.validate import validate
    from moe.train.run import train

    overrides = [f"model={model}", "moe_opt=deepseek_v3", "trainer.max_steps=3",
                 "trainer.progress_bar=false",
                 "trainer.val_check_interval=100", "trainer.limit_val_batches=1", "optimizer.warmup_steps=1"]
    cfg = compose_cfg(*overrides)
    validate(cfg)
    assert (cfg.moe_opt.score_function, cfg.moe_opt.num_groups, cfg.moe_opt.group_top_k) == ("sigmoid", 4, 2)
    train(cfg, tmp_path)
    resumed = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["hyper_parameters"]["cfg"]["moe_opt"]["topk_scaling_factor"] == 2.5  # round-trips
    saved = resumed["hyper_parameters"]["cfg"]["model"]
    if model == "tiny_deepseek_v3":  # the MLA and dense-layer keys round-trip too
        assert (saved["attention"], saved["kv_lora_rank"], saved["first_k_dense_replace"]) == ("mla", 32, 1)
    routing = MoEOptConfig(**resumed["hyper_parameters"]["cfg"]["moe_opt"])
    rebuilt = MoETransformer(ModelConfig(**saved), routing)
    rebuilt.load_state_dict({k.removeprefix("model."): v for k, v in resumed["state_dict"].items()})


@pytest.mark.parametrize("kw, field, needle", [
    ({"score_function": "tanh"}, "moe_opt.score_function", "use one of softmax, sigmoid"),
    ({"topk_scaling_factor": 0.0}, "moe_opt.topk_scaling_factor", "positive factor"),
    ({"topk_scaling_factor": float("nan")}, "moe_opt.topk_scaling_factor", "positive factor"),
])
def test_routing_keys_are_checked(kw, field, needle):
    with pytest.raises(ConfigError) as info:
        validate_routing(MoEOptConfig(**kw))
    assert info.value.field == field and needle in info.value.fix


@pytest.mark.parametrize("kw, field, needle", [
    ({"num_groups": 3, "group_top_k": 1}, "moe_opt.num_groups", "divisor of model.num_experts=16"),
    ({"num_groups": 4}, "moe_opt.group_top_k", "1 <= group_top_k <= min(num_groups=4, top_k=4)"),
    ({"num_groups": 4, "group_top_k": 5}, "moe_opt.group_top_k", "1 <= group_top_k"),
    ({"group_top_k": 2}, "moe_opt.group_top_k", "set moe_opt.num_groups too"),
    ({"num_groups": 16, "group_top_k": 2}, "moe_opt.group_top_k", "pick at least 4 groups of 1 experts"),
    ({"group_score_experts": 1}, "moe_opt.group_score_experts", "set moe_opt.num_groups too"),
    ({"num_groups": 4, "group_top_k": 2, "group_score_experts": 5}, "moe_opt.group_score_experts",
     "1 <= group_score_experts <= 4"),
])
def test_group_keys_are_checked(kw, field, needle):
    model = ModelConfig(num_experts=E, top_k=K)
    with pytest.raises(ConfigError) as info:
        validate_groups(model, MoEOptConfig(**kw))
    assert info.value.field == field and needle in info.value.fix


@pytest.mark.parametrize("kw, field", [
    ({"score_function": "sigmoid"}, "moe_opt.score_function"),
    ({"num_groups": 2, "group_top_k": 1}, "moe_opt.num_groups"),
    ({"topk_scaling_factor": 2.5}, "moe_opt.topk_scaling_factor"),
])
def test_mixtral_export_refuses_what_its_router_cannot_express(kw, field):
    with pytest.raises(ConfigError) as info:
        check_exportable(ModelConfig(num_experts=8, top_k=2), MoEOptConfig(capacity_factor=None, **kw))
    assert info.value.field == field and "Mixtral's softmax top-k router cannot express" in info.value.problem
