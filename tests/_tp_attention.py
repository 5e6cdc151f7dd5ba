"""Attention gradients of a gpt-oss model on two TP ranks and in one process (tests/test_hf_gpt_oss.py): the
rank body lives here, apart from the test module, so that the spawned ranks import no transformers model."""
from __future__ import annotations

import torch


def attention_grads(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits and every attention parameter's gradient of one forward/backward, as one process holds them
    (TP shards gathered, the fused q/k/v rows and biases back from the TP-interleaved order)."""
    from moe.parallel.tensor_parallel import fused_segments, interleave_order

    out = model(ids).logits_BSV
    out.float().pow(2).mean().backward()
    grads = {"logits": out.detach()}
    for name, p in model.named_parameters():
        if ".attn." not in name:
            continue
        grad = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        segments = fused_segments(name, model.model_config)
        if segments is not None and hasattr(p.grad, "full_tensor"):
            canonical = torch.empty_like(grad)
            canonical[interleave_order(segments, 2)] = grad
            grad = canonical
        grads[name] = grad
    return grads


def tp2_attention_grads(rank: int, hf_dir: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """On each of 2 TP ranks: a gpt-oss directory's model built on the meta device, split by TP, filled from
    the files as training fills it; then attention_grads."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe.hf import read_hf_config, tensor_source
    from moe.hf.gpt_oss import GptOss
    from moe.model import MoETransformer
    from moe.parallel.placement import materialize_distributed
    from moe.parallel.tensor_parallel import apply_tp

    config = read_hf_config(hf_dir, "hf_dir")
    model_cfg = GptOss().model_config(config)
    with torch.device("meta"):
        model = MoETransformer(model_cfg, GptOss().moe_opt(config))
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    materialize_distributed(model, "cpu", tensor_source(hf_dir, model_cfg), model_cfg, tp=2)
    return attention_grads(model, ids)
