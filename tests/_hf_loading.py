"""Helpers for the Hugging Face parity tests: a relative logit error, and a from_pretrained that must load
cleanly (what "transformers loads our export with no missing or unexpected keys and no warnings" means)."""
from __future__ import annotations

import logging
import warnings

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max())


def loads_cleanly(model_cls, path):
    """model_cls.from_pretrained(path) in eval mode: no missing, unexpected or mismatched keys, no warning
    logged by transformers or raised by Python."""
    import transformers

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model, info = model_cls.from_pretrained(path, local_files_only=True, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert [r.getMessage() for r in records] == []
    return model.eval()


def decoded_logits(model, ids: torch.Tensor, prefix: int, mask_BS: torch.Tensor | None = None,
                   latent: bool = True, step: int = 1) -> torch.Tensor:
    """The logits of `ids` as KV-cache decoding computes them: `prefix` tokens prefilled, then `step` tokens a
    call (to compare with one full forward); `mask_BS` the left padding's, `latent` new_kv_cache's."""
    def mask(end: int):
        return None if mask_BS is None else mask_BS[:, :end]

    with torch.no_grad():
        cache = model.new_kv_cache(latent=latent)
        first = model(ids[:, :prefix], kv_cache=cache, attention_mask_BS=mask(prefix), generating=True)
        steps = [model(ids[:, i:i + step], kv_cache=cache, position_offset=i, generating=True,
                       attention_mask_BS=mask(min(i + step, ids.shape[1]))).logits_BSV
                 for i in range(prefix, ids.shape[1], step)]
    return torch.cat([first.logits_BSV, *steps], dim=1)


def tunes_and_reimports(model, hf, ids_BS: torch.Tensor, directory, family: str) -> None:
    """A model started from a directory (materialised tensor by tensor, as ranks do) gives transformers'
    logits (fp32, 1e-5); 3 AdamW steps lower its loss; its export re-imports as `family` with the loss it
    trained to (1e-6): model.init_from_hf + training + export + re-import keeps the loss."""
    from moe.hf import from_hf, to_hf

    with torch.no_grad():
        assert relative_error(model.eval()(ids_BS).logits_BSV, hf(ids_BS).logits) < 1e-5
    labels = torch.roll(ids_BS, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(3):
        out = model(ids_BS, labels_BS=labels)
        losses.append(float(out.lm_loss))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = float(model.eval()(ids_BS, labels_BS=labels).lm_loss)
        assert trained < losses[0]
        to_hf(model).save_pretrained(directory)
        again = from_hf(directory).eval()
        assert again.model_config.hf_family == family
        assert abs(float(again(ids_BS, labels_BS=labels).lm_loss) - trained) <= 1e-6 * abs(trained)


@torch.no_grad()
def perturbed(model):
    """`model` with every norm weight drawn from [0.5, 1.5], every bias parameter from [-0.5, 0.5] and every
    router expert bias (ours `expert_bias`, transformers' `e_score_correction_bias`) from [-0.1, 0.1], from
    torch's generator: none at its initial 1 or 0, so that a conversion that dropped one would show."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
        elif name.endswith("bias"):
            p.uniform_(-0.5, 0.5)
    for name, b in model.named_buffers():
        if name.endswith(("expert_bias", "e_score_correction_bias")):
            b.uniform_(-0.1, 0.1)
    return model
