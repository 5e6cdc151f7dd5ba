"""One pipeline stage of the decoder: some of its blocks, with the embeddings on the first stage and the
final norm, LM head and loss on the last (the torch-native backend's pipeline, moe/parallel/pipeline.py).

Parameter names are the whole model's (`layers.5.attn...` stays `layers.5.attn...`, torchtitan keeps its
layers in a ModuleDict for the same reason), so a stage's initial values, its checkpoint keys and its
optimizer state are those of the same parameters in one process, and a checkpoint written at one pp
resumes at another. The forward is what torch.distributed.pipelining calls with a micro-batch: token
ids (first stage) or the previous stage's hidden states in, hidden states (or, on the last stage, the
micro-batch's mean LM loss) out.

The router terms of a stage's MoE layers never travel between stages: each stage's are attached to its
output by `RouterLossGrad` (Megatron-Core's MoEAuxLossAutoScaler, transformer/moe/moe_utils.py: the
identity in the forward, the router loss's own gradient in the backward), so the pipeline's backward
gives every router the gradient one process would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe.model.fused_ce import linear_cross_entropy
from moe.model.loss import router_loss_sum
from moe.model.model import MoETransformer
from moe.model.moe import RoutingStats


class LayerSlice(nn.ModuleDict):
    """A stage's blocks keyed by their index in the whole model (so parameter names stay the model's);
    iterates its blocks in order, as the ModuleList of the whole model does."""

    def __iter__(self):
        return iter(self.values())


class RouterLossGrad(torch.autograd.Function):
    """y = x in the forward; in the backward x's gradient passes through and `router_loss` gets `scale`
    (the weight the pipeline's loss gives this micro-batch), so its routers learn from the router terms
    without them being added to a loss on another stage."""

    @staticmethod
    def forward(ctx, x, router_loss, scale: float):
        ctx.save_for_backward(router_loss)
        ctx.scale = scale
        return x.clone()  # not x itself: a view as a stage's output would escape FSDP2's backward hook

    @staticmethod
    def backward(ctx, grad_x):
        (router_loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(router_loss, ctx.scale), None


class PipelineStageModel(MoETransformer):
    """The blocks `layer_ids` of the model; `first`: it holds the embeddings, `last`: the norm and LM head.

    Each forward appends a StageRecord to `records` (the pipeline clears them before a step), for the
    module's step statistics. `loss_scale` is the weight of one micro-batch in the step's loss
    (1 / micro-batches), set by the pipeline.
    """

    def __init__(self, model_cfg, moe_opt, init_seed: int, layer_ids: range, first: bool, last: bool):
        super().__init__(model_cfg, moe_opt, init_seed)  # on the meta device: nothing is allocated
        self.layers = LayerSlice({str(i): self.layers[i] for i in layer_ids})
        self.first, self.last = first, last
        if not first:
            self.embed_tokens = None
        if not last:
            self.norm = self.lm_head = None
        self.loss_scale = 1.0
        self.hidden_dtype = torch.float32  # what travels between stages (the compute dtype)
        self.records: list[StageRecord] = []

    def forward(self, x: torch.Tensor, labels_BS: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids [B, S] on the first stage, else hidden states; labels_BS (-100 = no loss) reach
        every stage (the schedule passes keyword arguments to all) and the last one uses them."""
        if self.first:
            x = self.embed_tokens(x)
            if self.sequence_shard is not None:
                x = self.sequence_shard.split(x)
        routing = []
        for block in self.layers:
            x, stats = block(x)
            if stats is not None:
                routing.append(stats)
        router_loss = router_loss_sum(routing, self.moe_opt) if routing else None
        if torch.is_tensor(router_loss) and router_loss.requires_grad:
            x = RouterLossGrad.apply(x, router_loss, self.loss_scale)
        lm = None
        if self.last:
            hidden = self.norm(x)
            if self.sequence_shard is not None:
                lm = self.sequence_shard.lm_loss(hidden, self.lm_head.weight, labels_BS)
            else:
                lm = linear_cross_entropy(hidden.flatten(0, 1), self.lm_head.weight, labels_BS.flatten())
        self.records.append(StageRecord(routing, router_loss, lm))
        return x.to(self.hidden_dtype) if lm is None else lm


@dataclass
class StageRecord:
    """What one stage's forward of one micro-batch saw."""

    routing: list[RoutingStats]  # one per MoE layer of the stage
    router_loss: torch.Tensor | float | None  # their router terms (None: no MoE layer here)
    lm_loss: torch.Tensor | None  # the micro-batch's mean LM loss (last stage)
