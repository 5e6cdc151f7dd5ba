"""Build at size: a model built on the meta device and materialised shard by shard holds exactly the
values one process building the whole model gives those parameters, and the MoE layer reads
device values back to the host only where it must (moe/model/sync.py)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe.model.moe as moe_module
import moe.model.routing as routing_module
import moe.parallel.comm as comm_module
from moe.config import ModelConfig, MoEOptConfig
from moe.model import MoETransformer

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
            num_experts=4, top_k=2)


@pytest.mark.parametrize("extra", [{}, {"tie_word_embeddings": True, "position_encoding": "alibi"}],
                         ids=["untied_rope", "tied_alibi"])
def test_meta_build_materialises_the_values_of_an_eager_build(extra):
    cfg, opt = ModelConfig(**TINY, **extra), MoEOptConfig()
    eager = MoETransformer(cfg, opt, init_seed=7)
    with torch.device("meta"):
        lazy = MoETransformer(cfg, opt, init_seed=7)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.materialize("cpu")
    assert eager.state_dict().keys() == lazy.state_dict().keys()
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(lazy.state_dict()[name], value, rtol=0, atol=0, msg=name)
    if cfg.tie_word_embeddings:
        assert lazy.lm_head.weight is lazy.embed_tokens.weight
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lazy(ids).logits_BSV, eager(ids).logits_BSV, rtol=0, atol=0)


def test_a_rank_allocates_and_fills_only_its_experts():
    cfg, opt = ModelConfig(**TINY), MoEOptConfig()
    eager = MoETransformer(cfg, opt, init_seed=3)
    with torch.device("meta"):
        lazy = MoETransformer(cfg, opt, init_seed=3)
    for layer in lazy.layers:
        layer.ffn.experts.shard(2, 2)  # rank 1 of ep 2
    lazy.materialize("cpu")
    for layer, ref in zip(lazy.layers, eager.layers, strict=True):
        experts = layer.ffn.experts
        assert experts.gate_up.shape[0] == 2 and experts.gate_up.first_expert == 2 and experts.down.is_expert
        torch.testing.assert_close(experts.gate_up, ref.ffn.experts.gate_up[2:4], rtol=0, atol=0)
        torch.testing.assert_close(experts.down, ref.ffn.experts.down[2:4], rtol=0, atol=0)


def count_host_reads(monkeypatch) -> list[str]:
    """Every explicit host read of the MoE path (moe.model.sync), by caller."""
    reads: list[str] = []
    for module in (moe_module, routing_module, comm_module):
        for name in ("host_sizes", "host_int"):
            if hasattr(module, name):
                real = getattr(module, name)

                def counted(*args, _real=real, _where=f"{module.__name__}.{name}"):
                    reads.append(_where)
                    return _real(*args)

                monkeypatch.setattr(module, name, counted)
    return reads


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_local_moe_layer_reads_nothing_back(monkeypatch, capacity_factor):
    """Under FakeTensorMode any other host read (.item, .tolist, bincount, boolean masks) raises; with a
    capacity the dropped assignments sort past the experts' slices, so not even the kept count is read."""
    from moe.model.moe import MoELayer

    reads = count_host_reads(monkeypatch)
    opt = MoEOptConfig(capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast after they are built
    try:
        with FakeTensorMode():
            layer = MoELayer(16, 24, 4, 2, opt, init_range=0.02)
    finally:
        torch.set_default_dtype(before)
    layer.experts.use_grouped_mm = True  # fake kernels exist for bf16 grouped_mm only
    with layer.router.weight.fake_mode:
        x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
        y, stats = layer(x)
        (y.float().square().sum() + stats.aux_loss + stats.z_loss).backward()
    assert reads == []


@pytest.mark.parametrize("allow", [True, False])
def test_allow_tf32_sets_the_fp32_matmul_precision(allow):
    from omegaconf import OmegaConf

    from moe.config import TrainConfig
    from moe.train.environment import apply_torch_settings

    cfg = OmegaConf.structured(TrainConfig)
    cfg.hardware.allow_tf32 = allow
    before = torch.get_float32_matmul_precision()
    try:
        apply_torch_settings(cfg.hardware)
        assert torch.get_float32_matmul_precision() == ("high" if allow else "highest")
    finally:
        torch.set_float32_matmul_precision(before)
