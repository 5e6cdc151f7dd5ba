"""The training loss: CE plus per-layer router losses, summed over MoE layers (moe/model/loss.py)."""
import pytest
import torch
from omegaconf import OmegaConf

from moe.config import ModelConfig, MoEOptConfig, TrainConfig
from moe.model.loss import router_loss_sum
from tests.conftest import single_process_module


def test_loss_is_ce_plus_coefficients_times_router_losses_of_every_layer():
    cfg = OmegaConf.structured(TrainConfig(model=ModelConfig(num_layers=2, moe_layer_frequency=1),
                                           moe_opt=MoEOptConfig(aux_loss_coeff=0.5, z_loss_coeff=0.25),
                                           run_name="t"))
    torch.manual_seed(0)
    module = single_process_module(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    out = module.model(batch["input_ids"], labels_BS=batch["labels"])
    loss, lm_loss = out.loss, out.lm_loss
    assert module.micro_batch_loss(batch)[0] == loss
    assert len(out.routing) == 2
    expected = lm_loss + sum(0.5 * r.aux_loss + 0.25 * r.z_loss for r in out.routing)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    # out.aux_loss is the per-layer mean that metrics.csv logs; the loss uses the sum
    assert float(router_loss_sum(out.routing, cfg.moe_opt)) == pytest.approx(
        2 * (0.5 * float(out.aux_loss) + 0.25 * float(out.z_loss)), rel=1e-6)
    logits = module.model(ids).logits_BSV  # the plain LM head: training's chunked one gives the same loss
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), ids.roll(-1, 1).reshape(-1))
    assert float(lm_loss) == pytest.approx(float(ce), rel=1e-5)
    assert float(out.router_loss) == pytest.approx(float(expected - lm_loss), rel=1e-6)  # the model's own sum
