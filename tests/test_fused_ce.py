"""The chunked LM head + cross-entropy (moe/model/fused_ce.py) equals the plain one: loss and the
gradients of the hidden states and of the head (tied to the embedding too), -100 labels, any chunk."""
import pytest
import torch
import torch.nn.functional as F

from moe.config import ModelConfig, MoEOptConfig
from moe.model import MoETransformer
from moe.model.fused_ce import linear_cross_entropy


def plain(h, w, labels):
    return F.cross_entropy((h @ w.T).float(), labels, ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_loss_and_gradients_equal_the_plain_head(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    w = (torch.randn(33, 16, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, 33, (50,), generator=g)
    labels[::4] = -100
    want = plain(h, w, labels)
    want_h, want_w = torch.autograd.grad(want * 3.0, (h, w))  # a scale from above reaches both
    got = linear_cross_entropy(h, w, labels, chunk)
    got_h, got_w = torch.autograd.grad(got * 3.0, (h, w))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)
    with torch.no_grad():  # validation: the loss alone
        torch.testing.assert_close(linear_cross_entropy(h, w, labels, chunk), want, rtol=0, atol=1e-6)


def test_all_labels_ignored_gives_zero_and_zero_gradients():
    h = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((5,), -100))
    loss.backward()
    assert float(loss) == 0 and not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize("tied", [False, True])
def test_the_models_labels_path_trains_as_the_logits_path(tied):
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, num_experts=4, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = MoETransformer(cfg, MoEOptConfig(capacity_factor=None))
    ids = torch.randint(0, 97, (2, 12))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    out = model(ids)
    want = F.cross_entropy(out.logits_BSV.flatten(0, 1), labels.flatten(), ignore_index=-100)
    want_grads = torch.autograd.grad(want + out.router_loss, list(model.parameters()))
    fused = model(ids, labels_BS=labels)
    assert fused.logits_BSV is None
    got_grads = torch.autograd.grad(fused.lm_loss + fused.router_loss, list(model.parameters()))
    torch.testing.assert_close(fused.lm_loss, want, rtol=0, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
