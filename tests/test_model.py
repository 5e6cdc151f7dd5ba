"""The decoder: shapes, causality, positions, sliding window, KV cache, init, layer pattern, errors."""
import math

import pytest
import torch

from moe.config import ModelConfig, MoEOptConfig
from moe.config.size import flops_per_token, param_breakdown
from moe.errors import ConfigError
from moe.model import Attention, MoETransformer, SwiGLU, alibi_slopes, attention_mask

DROPLESS = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, jitter_eps=0.0)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, num_experts=4, top_k=2, max_position_embeddings=64)
    return ModelConfig(**(base | kw))


def build(seed=0, moe_opt=DROPLESS, **kw) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(tiny(**kw), moe_opt).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_shapes_and_dtype(dtype):
    model = build().to(dtype)
    ids = torch.randint(0, 61, (3, 10))
    out = model(ids)
    assert out.logits_BSV.shape == (3, 10, 61) and out.logits_BSV.dtype == dtype
    assert len(out.routing) == 2 and out.kv_cache is None
    assert out.aux_loss.shape == () and out.z_loss.shape == ()
    assert torch.isfinite(out.logits_BSV.float()).all()
    # aux/z losses are the mean over MoE layers
    assert torch.allclose(out.aux_loss, torch.stack([s.aux_loss for s in out.routing]).mean())
    assert torch.allclose(out.z_loss, torch.stack([s.z_loss for s in out.routing]).mean())


def test_losses_carry_grad_and_zero_without_moe_layers():
    model = build().train()
    out = model(torch.randint(0, 61, (2, 8)))
    out.aux_loss.backward()
    assert model.layers[0].ffn.router.weight.grad.abs().sum() > 0
    dense = build(moe_layer_frequency=3)  # 2 layers, none MoE
    out = dense(torch.randint(0, 61, (2, 8)))
    assert out.routing == [] and out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0


@pytest.mark.parametrize("pe", ["rope", "alibi"])
@pytest.mark.parametrize("window", [None, 3])
def test_causal(pe, window):
    model = build(position_encoding=pe, sliding_window=window)
    ids = torch.randint(0, 61, (2, 12))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 61
    a, b = model(ids).logits_BSV, model(changed).logits_BSV
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)  # grouped expert matmuls may re-block
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


def test_rope_and_alibi_differ_and_slopes_are_standard():
    ids = torch.randint(0, 61, (1, 9))
    rope, alibi = build(position_encoding="rope"), build(position_encoding="alibi")
    assert (rope(ids).logits_BSV - alibi(ids).logits_BSV).abs().max() > 1e-4
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # non power of two (Press et al.): 4 slopes of n=4 then every other slope of n=8
    expected6 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    torch.testing.assert_close(alibi_slopes(6), torch.tensor(expected6))


def test_sliding_window_mask_matches_transformers():
    masking = pytest.importorskip("transformers.masking_utils", reason="transformers 5's mask functions")
    sliding_window_causal_mask_function = masking.sliding_window_causal_mask_function

    for window in (1, 3, 5):
        hf_fn = sliding_window_causal_mask_function(window)
        for q_start, k_start, q_len, k_len in [(0, 0, 8, 8), (6, 2, 3, 7), (9, 5, 1, 5)]:
            ours = attention_mask(q_start, q_len, k_start, k_len, window, "cpu")
            ref = torch.tensor([[bool(hf_fn(0, 0, torch.tensor(q_start + i), torch.tensor(k_start + j)))
                                 for j in range(k_len)] for i in range(q_len)])
            assert torch.equal(ours, ref), (window, q_start, k_start)


def test_sliding_window_only_changes_positions_past_the_window():
    ids = torch.randint(0, 61, (2, 12))
    full, windowed = build(), build(sliding_window=4)
    a, b = full(ids).logits_BSV, windowed(ids).logits_BSV
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-6)  # first 4 tokens see everything
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-4
    torch.testing.assert_close(a, build(sliding_window=12)(ids).logits_BSV, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pe,window,kv_heads", [("rope", None, 2), ("rope", 4, 1), ("rope", None, 4),
                                                 ("alibi", None, 2), ("alibi", 3, 2)])
def test_kv_cache_decoding_matches_full_forward(pe, window, kv_heads):
    model = build(position_encoding=pe, sliding_window=window, num_kv_heads=kv_heads)
    ids = torch.randint(0, 61, (2, 14))
    full = model(ids).logits_BSV
    cache = model.new_kv_cache()
    pieces, pos = [], 0
    for step in (5, 1, 3, 1, 1, 2, 1):  # chunked prefill, then single tokens
        out = model(ids[:, pos:pos + step], kv_cache=cache, position_offset=pos)
        assert out.kv_cache is cache
        pieces.append(out.logits_BSV)
        pos += step
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    k = cache[0].k
    assert k.shape[1] == kv_heads  # kv heads stored, not repeated
    assert k.shape[2] == (14 if window is None else window - 1)  # window: older positions dropped
    assert cache[0].end == 14


def test_kv_cache_rejects_wrong_position_offset():
    model = build()
    cache = model.new_kv_cache()
    model(torch.randint(0, 61, (1, 4)), kv_cache=cache, position_offset=0)
    with pytest.raises(ValueError, match="position_offset=4"):
        model(torch.randint(0, 61, (1, 1)), kv_cache=cache, position_offset=0)


def test_init_std():
    torch.manual_seed(0)
    cfg = tiny(hidden_size=256, intermediate_size=256, num_layers=8, num_heads=4, num_kv_heads=4,
               vocab_size=512, moe_layer_frequency=2, init_range=0.02)
    model = MoETransformer(cfg, DROPLESS)
    out_std = 0.02 / math.sqrt(2 * 8)

    def close(t, std):
        assert abs(t.float().std().item() - std) / std < 0.05, (t.std().item(), std)

    close(model.embed_tokens.weight, 0.02)
    close(model.lm_head.weight, 0.02)
    dense, moe = model.layers[0], model.layers[1]
    close(dense.attn.qkv_proj.weight, 0.02)
    close(dense.attn.o_proj.weight, out_std)
    close(dense.ffn.gate_up_proj.weight, 0.02)
    close(dense.ffn.down_proj.weight, out_std)
    close(moe.ffn.router.weight, 0.02)
    close(moe.ffn.experts.gate_up, 0.02)
    close(moe.ffn.experts.down, out_std)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name


def test_tied_embeddings_share_one_tensor():
    model = build(tie_word_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert param_breakdown(model.model_config).total == sum(p.numel() for p in model.parameters())


def test_moe_layer_frequency_two_alternates():
    model = build(num_layers=6, moe_layer_frequency=2, dense_intermediate_size=40)
    assert [b.is_moe for b in model.layers] == [False, True, False, True, False, True]
    assert isinstance(model.layers[0].ffn, SwiGLU) and model.layers[0].ffn.down_proj.in_features == 40
    assert len(model(torch.randint(0, 61, (1, 5))).routing) == 3


@pytest.mark.parametrize("kw", [dict(), dict(tie_word_embeddings=True), dict(moe_layer_frequency=2),
                                dict(head_dim=16), dict(num_layers=3, moe_layer_frequency=2)])
def test_num_params_matches_the_parameters(kw):
    model = build(**kw)
    sizes = param_breakdown(model.model_config)
    assert sizes.total == sum(p.numel() for p in model.parameters())
    expert = 3 * 32 * 24  # gate_up + down of one routed expert
    n_moe = sum(b.is_moe for b in model.layers)
    assert sizes.total - sizes.active == n_moe * (4 - 2) * expert


def test_flops_per_token_formula():
    model = build(sliding_window=16)
    n = param_breakdown(model.model_config).active - 61 * 32  # embedding lookup has no matmul
    assert flops_per_token(model.model_config, 64) == 6 * n + 12 * 2 * 4 * 8 * 16
    assert flops_per_token(model.model_config, 8) == 6 * n + 12 * 2 * 4 * 8 * 8


@pytest.mark.parametrize("kw,field,fix_word", [
    (dict(num_heads=4, num_kv_heads=3), "model.num_kv_heads", "divisor"),
    (dict(hidden_size=30, num_heads=4), "model.hidden_size", "multiple"),
    (dict(num_experts=4, top_k=5), "model.top_k", "top_k <="),
    (dict(position_encoding="learned"), "model.position_encoding", "rope, alibi"),
    (dict(sliding_window=0), "model.sliding_window", "positive"),
    (dict(moe_layer_frequency=0), "model.moe_layer_frequency", "positive"),
])
def test_config_errors_name_field_value_and_fix(kw, field, fix_word):
    with pytest.raises(ConfigError) as err:
        MoETransformer(tiny(**kw), DROPLESS)
    assert err.value.field == field
    assert err.value.value == kw[field.split(".")[1]]
    assert fix_word in err.value.fix
    assert field in str(err.value) and "Fix:" in str(err.value)


def test_attention_uses_one_fused_qkv_projection():
    attn = Attention(tiny(num_heads=4, num_kv_heads=2))
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 8, 32)
    assert attn.qkv_proj.bias is None


def test_init_values_do_not_depend_on_how_the_model_is_split():
    """Each parameter and each expert draws from its own seed: a rank holding experts [2, 4) of a layer,
    initialised on its own, gets exactly the rows one process gives them (moe.model.init)."""
    from moe.model.init import initial_values

    torch.manual_seed(3)
    model = build()
    std, out_std = model.init_std
    full = model.layers[0].ffn.experts.gate_up
    shard = initial_values("layers.0.ffn.experts.gate_up", (2, *full.shape[1:]), model.init_seed, std,
                           out_std, first_expert=2)
    assert torch.equal(shard, full[2:4])
    assert torch.equal(initial_values("norm.weight", (32,), model.init_seed, std, out_std), model.norm.weight)
    torch.manual_seed(3)
    assert torch.equal(build().layers[1].attn.qkv_proj.weight, model.layers[1].attn.qkv_proj.weight)
