"""A Hugging Face directory's model's gradients on two TP ranks, on two EP ranks and in one process (gpt-oss:
tests/test_hf_gpt_oss.py; GLM-4.5: tests/test_hf_glm4_moe.py): the rank bodies live here, apart from the test
modules, so that the spawned ranks import no transformers model."""
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


def meta_model(hf_dir: str):
    """The directory's model on the meta device, with its family's config and routing."""
    from moe.hf import read_hf_config
    from moe.hf.families import converter_for
    from moe.model import MoETransformer

    config = read_hf_config(hf_dir, "hf_dir")
    adapter = converter_for(config.model_type)
    with torch.device("meta"):
        return MoETransformer(adapter.model_config(config), adapter.moe_opt(config))


def tp2_attention_grads(rank: int, hf_dir: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """On each of 2 TP ranks: the directory's model built on the meta device, split by TP, filled from the
    files as training fills it; then attention_grads."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe.hf import tensor_source
    from moe.parallel.placement import materialize_distributed
    from moe.parallel.tensor_parallel import apply_tp

    model = meta_model(hf_dir)
    model_cfg = model.model_config
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    materialize_distributed(model, "cpu", tensor_source(hf_dir, model_cfg), model_cfg, tp=2)
    return attention_grads(model, ids)


def ep2_expert_grads(rank: int, hf_dir: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """On each of 2 expert-parallel ranks: the directory's model with half of every layer's experts (read from
    the files, biases included), rows exchanged all-to-all; the logits and this rank's experts' gradients
    (both ranks feed the same batch, so an expert's gradient is twice one process's)."""
    import torch.distributed as dist

    from moe.hf import tensor_source
    from moe.parallel.apply import apply_ep

    model = meta_model(hf_dir)
    apply_ep(model, dist.group.WORLD)
    model.materialize("cpu", tensor_source(hf_dir, model.model_config))
    out = model(ids).logits_BSV
    out.float().pow(2).mean().backward()
    first_moe = next(block for block in model.layers if block.is_moe)
    grads = {"logits": out.detach(), "first_expert": torch.tensor(first_moe.ffn.experts.first_expert)}
    grads |= {name: p.grad.detach().clone() for name, p in model.named_parameters() if ".experts." in name}
    return grads


def two_rank_grads(rank: int, hf_dir: str, ids: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """Both layouts in one pair of processes (each spawn costs seconds): tp2, then ep2."""
    return {"tp2": tp2_attention_grads(rank, hf_dir, ids), "ep2": ep2_expert_grads(rank, hf_dir, ids)}
