"""FSDP2 with the experts offloaded to host memory (parallel.offload_experts): Lightning's move of the model
to its device leaves them there. On an H100 (torch 2.11) that move reached the pinned expert shards and
stopped `make gpu-check`'s fsdp2_offload_experts path before step 1; on the CPU the device is the host, so
the move is a no-op. Here the rest of the model moves to another device (meta) through the strategy's own
model_to_device, and the experts must not follow."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import free_port

from moe.backends.fsdp2.backend import FSDP2Strategy
from moe.config.schema import ModelConfig, MoEOptConfig
from moe.model.model import MoETransformer
from moe.parallel.fsdp import apply_fsdp, experts_held_back


@pytest.fixture
def offloaded_model():
    """A tiny model under fully_shard on one gloo rank, its experts under CPUOffloadPolicy."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, top_k=2)
    model = MoETransformer(cfg, MoEOptConfig(), init_seed=0)
    mesh = init_device_mesh("cpu", (1,))

    class OneRank:  # moe.parallel.dims.Meshes' two fields apply_fsdp reads
        dense = experts = mesh

    yield apply_fsdp(model, OneRank, expert_divide_factor=1, reshard_after_forward=True, offload_experts=True)
    dist.destroy_process_group()


def _devices(model) -> dict[str, str]:
    return {name: p.device.type for name, p in model.named_parameters()}


class _OnAnotherDevice(FSDP2Strategy):
    """The strategy as on an accelerator: its root device is not where the host memory is."""

    root_device = torch.device("meta")


def test_moving_the_model_leaves_offloaded_experts_in_host_memory(offloaded_model):
    strategy = _OnAnotherDevice.__new__(_OnAnotherDevice)
    strategy._model = offloaded_model
    strategy.offload_experts = True
    strategy.model_to_device()
    where = _devices(offloaded_model)
    experts = {n: d for n, d in where.items() if ".experts." in n}
    assert experts and set(experts.values()) == {"cpu"}
    assert {d for n, d in where.items() if n not in experts} == {"meta"}
    # the module tree is whole again: every parameter is still reachable under its name
    whole = MoETransformer(offloaded_model.model_config, MoEOptConfig())
    assert len(where) == len(dict(whole.named_parameters()))


def test_without_the_hold_the_move_takes_the_experts_too(offloaded_model):
    """What Lightning's plain model_to_device does (the GPU failure's cause); and the hold restores the tree
    even when the move raises."""
    with pytest.raises(RuntimeError, match="boom"), experts_held_back(offloaded_model):
        raise RuntimeError("boom")
    offloaded_model.to("meta")
    assert set(_devices(offloaded_model).values()) == {"meta"}
