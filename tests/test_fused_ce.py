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
    got_grads = torch.autograd.grad(fused.loss, list(model.parameters()))
    torch.testing.assert_close(fused.lm_loss, want, rtol=0, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_a_half_precision_head_takes_its_weight_gradient_on_the_matrix_units(monkeypatch):
    """A bf16 head on CUDA takes its weight gradient as a bf16 product with an fp32 result (aten::mm's
    out_dtype, whose kernel is CUDA's alone), not as an fp32 SIMT GEMM: the branch runs here on the meta
    device, whose shapes and dtypes are CUDA's, in this torch (the floor's: its CUDA kernel is registered)."""
    import moe.model.fused_ce as fused_ce

    one = torch.empty(1, 1, device="meta", dtype=torch.bfloat16)
    try:
        torch.mm(one, one, out_dtype=torch.float32)
    except TypeError:  # torch 2.9: the meta kernel takes no out_dtype; its CUDA build registers the CUDA one
        if torch.version.cuda:
            assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")
        pytest.skip(f"torch {torch.__version__}'s meta mm takes no out_dtype")
    monkeypatch.setattr(fused_ce, "OUT_DTYPE_MM_DEVICES", ("meta",))
    calls = []
    mm = torch.mm

    def spy(a, b, **kw):
        calls.append((a.dtype, b.dtype, kw))
        return mm(a, b, **kw)

    monkeypatch.setattr(torch, "mm", spy)
    h = torch.empty(2048, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(33, 16, device="meta", requires_grad=True)
    labels = torch.zeros(2048, dtype=torch.long, device="meta")
    loss = fused_ce._LinearCrossEntropy.apply(h, w.to(torch.bfloat16), labels, 1024)  # as a bf16 model's head
    grad_w = torch.autograd.grad(loss, w)[0]
    assert calls == [(torch.bfloat16, torch.bfloat16, {"out_dtype": torch.float32})] * 2
    assert grad_w.dtype == torch.float32 and grad_w.shape == w.shape
