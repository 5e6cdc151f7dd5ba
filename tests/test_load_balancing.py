"""Load balancing beyond the Switch loss: aux-loss-free balancing (moe_opt.enable_expert_bias: the bias
picks the experts, the unbiased probabilities weight them, the update moves it against the load, it
lives in checkpoints) and moe_opt.load_balancing_type (seq_aux_loss, none)."""
from __future__ import annotations

import pytest
import torch
from conftest import trained_rows

from moe.config import ModelConfig, MoEOptConfig
from moe.model import MoETransformer
from moe.model.routing import RoutingStats, top_k_routing
from moe.module.expert_bias import ExpertBiasUpdate

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
            num_experts=4, top_k=2)


def test_bias_chooses_the_experts_and_the_probabilities_weight_them():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    weights, idx = top_k_routing(probs, 2, normalize=False, bias_E=torch.tensor([0.0, 0.0, 0.5, 0.0]))
    assert idx.tolist() == [[2, 0]]  # 0.2 + 0.5 wins, then 0.4
    assert torch.allclose(weights, torch.tensor([[0.2, 0.4]]))  # unbiased probabilities
    weights, _ = top_k_routing(probs, 2, normalize=True, bias_E=torch.tensor([0.0, 0.0, 0.5, 0.0]))
    assert torch.allclose(weights, torch.tensor([[0.2, 0.4]]) / 0.6)


def stats(counts):
    zero = torch.zeros(())
    return RoutingStats(zero, zero, torch.tensor(counts), zero, zero, zero, zero)


def test_update_moves_each_bias_against_its_experts_load_summed_over_micro_batches_and_ranks():
    model = MoETransformer(ModelConfig(**TINY), MoEOptConfig(enable_expert_bias=True), init_seed=0)
    update = ExpertBiasUpdate(model, rate=0.01)
    update.add([stats([6, 1, 0, 1]), stats([2, 2, 2, 2])])  # micro-batch 1, layers 0 and 1
    update.add([stats([4, 1, 0, 3]), stats([2, 2, 2, 2])])  # micro-batch 2
    seen = []
    update.step(lambda t: seen.append(t.clone()) or 2 * t)  # "all-reduce" over two identical ranks
    assert seen[0].tolist() == [[10, 2, 0, 4], [4, 4, 4, 4]]
    bias = [layer.ffn.router.expert_bias for layer in model.layers]
    assert torch.equal(bias[0], torch.tensor([-0.01, 0.01, 0.01, 0.0]))  # mean load 4
    assert torch.equal(bias[1], torch.zeros(4))  # balanced: no change
    assert update.loads is None  # counting starts anew for the next step


def test_the_bias_is_a_checkpointed_buffer_that_starts_at_zero_also_on_meta():
    cfg, opt = ModelConfig(**TINY), MoEOptConfig(enable_expert_bias=True)
    model = MoETransformer(cfg, opt, init_seed=0)
    assert "layers.0.ffn.router.expert_bias" in model.state_dict()
    assert not any(n.endswith("expert_bias") for n, _ in model.named_parameters())  # not trained by AdamW
    with torch.device("meta"):
        lazy = MoETransformer(cfg, opt, init_seed=0)
    lazy.materialize("cpu")
    assert torch.equal(lazy.layers[1].ffn.router.expert_bias, torch.zeros(4))
    model.layers[0].ffn.router.expert_bias += 0.5
    lazy.load_state_dict(model.state_dict())
    assert torch.equal(lazy.layers[0].ffn.router.expert_bias, torch.full((4,), 0.5))
    assert model.to(torch.bfloat16).layers[0].ffn.router.expert_bias.dtype == torch.float32  # as Megatron
    plain = MoETransformer(cfg, MoEOptConfig(), init_seed=0)
    assert not any(k.endswith("expert_bias") for k in plain.state_dict())  # old checkpoints still load


def test_sequence_balance_loss_is_the_batch_loss_within_each_sequence_averaged():
    from moe.model.moe import MoELayer
    from moe.model.routing import load_balance_loss, router_probs, sequence_load_balance_loss

    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2 * 8, 4, generator=gen), -1)
    idx = torch.topk(probs, 2).indices
    per_sequence = [load_balance_loss(probs[s * 8:(s + 1) * 8], idx[s * 8:(s + 1) * 8]) for s in range(2)]
    torch.testing.assert_close(sequence_load_balance_loss(probs, idx, 2), torch.stack(per_sequence).mean())

    x = torch.randn(2, 8, 16, generator=gen)
    layers = {kind: MoELayer(16, 24, 4, 2, MoEOptConfig(load_balancing_type=kind, capacity_factor=None))
              for kind in ("aux_loss", "seq_aux_loss", "none")}
    torch.manual_seed(0)
    for layer in layers.values():
        layer.load_state_dict(layers["aux_loss"].state_dict())
    aux = {kind: layer(x)[1].aux_loss for kind, layer in layers.items()}
    probs = router_probs(layers["aux_loss"].router(x.reshape(-1, 16)))
    idx = torch.topk(probs, 2).indices
    torch.testing.assert_close(aux["seq_aux_loss"], sequence_load_balance_loss(probs, idx, 2))
    torch.testing.assert_close(aux["aux_loss"], load_balance_loss(probs, idx))
    assert aux["none"].item() == 0.0
    aux["seq_aux_loss"].backward()  # it trains the router
    assert layers["seq_aux_loss"].router.weight.grad.abs().sum() > 0


def test_aux_free_training_moves_the_bias_and_a_resume_continues_it_exactly(tmp_path, train_here):
    import shutil

    args = ("moe_opt=aux_free", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3",
            "trainer.limit_val_batches=0", "optimizer.warmup_steps=1")
    run = train_here(*args)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    bias = ckpt["state_dict"]["model.layers.0.ffn.router.expert_bias"]
    assert bias.abs().sum() > 0 and torch.allclose(bias.abs(), torch.full_like(bias, 6e-3), atol=6e-3)

    def losses(d):
        return [float(r["loss"]) for r in trained_rows(d)]

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    for name in ("step-000003.ckpt", "step-000003.ckpt.meta.json"):
        shutil.copy(run / "checkpoints" / name, resumed / "checkpoints")
    train_here(*args, run_dir=resumed)
    assert losses(resumed) == pytest.approx(losses(run)[3:], abs=1e-6)
    again = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert torch.equal(again["state_dict"]["model.layers.0.ffn.router.expert_bias"], bias)
