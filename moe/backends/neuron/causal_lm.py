"""What neuronx-distributed trains: our MoETransformer, its layers swapped for NxD's parallel ones
(moe/backends/neuron/layers.py), under a forward(input_ids, labels) -> (loss, lm_loss) that NxD's
pipeline can trace and cut into stages.

The blocks are ours (StageBlock is moe.model.model.Block with the router loss carried through its
signature), the objective is moe.model.loss's. Two things differ from MoETransformer.forward, both
because NxD's pipeline traces this forward with torch.fx and sends only tensors between stages:
the router loss travels with the hidden states from block to block instead of as a list of
RoutingStats (each block adds its own layer's term, moe.model.loss.router_loss), and the
statistics a block computes stay on the block until the training step collects them
(`pop_routing`). neuronx-distributed v2.28.0 source lines are cited as src/neuronx_distributed/...
"""
from __future__ import annotations

import torch
from neuronx_distributed.parallel_layers import mappings
from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
from torch import nn

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.model.loss import lm_loss, router_loss
from moe.model.model import Block, MoETransformer
from moe.model.routing import RoutingStats

# Under sequence parallelism activations are [S / tp, B, H], as in NxD's own models: its parallel
# layers' backward and its MoE router `.view` tensors gathered over the sequence, which only works
# on dim 0 (parallel_layers/layers.py LinearWithAsyncCommunication, modules/moe/routing.py:102-112;
# found running NxD's real code, tests/neuron_real). Without it they are [B, S, H].
SEQUENCE_DIM = 0


class StageBlock(Block):
    """A Block whose forward carries the router loss: (x, router loss so far) -> (x, + this layer's).

    NxD's pipeline partitions at these blocks (pipeline_config transformer_layer_cls) and keeps them
    as leaves when tracing (src/neuronx_distributed/pipeline/model.py:585-586).
    """

    def __init__(self, cfg: ModelConfig, moe_opt: MoEOptConfig, layer_idx: int):
        super().__init__(cfg, moe_opt, layer_idx)
        self.moe_opt = moe_opt
        self.routing: list[RoutingStats] = []  # this step's statistics, until pop_routing

    def forward(self, x_BSH: torch.Tensor, router_loss_so_far: torch.Tensor):
        x_BSH, stats = super().forward(x_BSH)
        if stats is None:
            return x_BSH, router_loss_so_far
        if not recomputing():  # activation checkpointing runs this forward again in the backward
            self.routing.append(stats)
        return x_BSH, router_loss_so_far + router_loss(stats, self.moe_opt)


def recomputing() -> bool:
    """True inside the autograd engine, where checkpointed forwards are recomputed."""
    return torch._C._current_graph_task_id() != -1


def nxd_lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """moe.model.loss.lm_loss over vocabulary-sharded logits: NxD's parallel cross-entropy gives
    unreduced per-token losses and has no ignore_index (loss_functions.py:217-219, :36-52), so the
    -100 labels are masked out by lm_loss. Listed in the pipeline's autowrap_functions: traced as
    one call, not into (pipeline/trace.py:174-186)."""
    return lm_loss(logits_BSV, labels_BS, cross_entropy=parallel_cross_entropy)


class NxDCausalLM(nn.Module):
    def __init__(self, model: MoETransformer, sequence_parallel: bool):
        super().__init__()
        self.model, self.sequence_parallel = model, sequence_parallel

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        # ParallelEmbedding returns the whole sequence, all-reduced over TP (NxD's embedding is not
        # built sequence parallel, parallel_layers/layers.py:369-375); with sequence parallelism it is
        # turned sequence-first and scattered here, as NxD's Mixtral model does (modeling_mixtral_moe_nxd.py).
        x = self.model.embed_tokens(input_ids)  # [B, S, H]
        if self.sequence_parallel:
            x = x.transpose(0, 1).contiguous()
            x = mappings.scatter_to_sequence_parallel_region(x, sequence_dimension=SEQUENCE_DIM)  # S/tp, B, H
            labels = labels.transpose(0, 1).contiguous()  # as the logits [S, B, V / tp]; pipelines send it on
        router_loss_so_far = torch.zeros((), dtype=torch.float32, device=x.device)
        for block in self.model.layers:
            x, router_loss_so_far = block(x, router_loss_so_far)
        logits = self.model.lm_head(self.model.norm(x))  # [B, S, V / tp] or [S, B, V / tp]
        lm = nxd_lm_loss(logits, labels)
        return lm + router_loss_so_far, lm


def pop_routing(modules) -> list[RoutingStats]:
    """Every RoutingStats the StageBlocks among `modules` recorded since the last call (and forget them)."""
    routing = []
    for module in modules:
        if isinstance(module, StageBlock):
            routing += module.routing
            module.routing = []
    return routing
