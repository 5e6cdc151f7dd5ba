"""Trainium model path: our decoder rebuilt from neuronx-distributed (NxD) parallel layers.

Imported only by `moe.strategies.neuron.build_neuron`, after neuronx_distributed imported
cleanly. Written against the neuronx-distributed 2.29 sources (lightning/, trainer/,
parallel_layers/, modules/moe/); it needs a Neuron device and torch-xla, so this
repository's tests do not run it (they check the plugin's wiring with import stand-ins).

Layout, same maths and parameter shapes per TP rank as moe/model.py:
- Embedding: ParallelEmbedding (vocab sharded over TP), then scattered over the sequence when SP.
- Attention: one fused ColumnParallelLinear qkv (seed 001: one all-gather under SP), each TP rank
  holding [q | k | v] rows of its own num_heads/tp query and num_kv_heads/tp kv heads;
  RowParallelLinear o_proj (reduce-scatter back to sequence shards under SP).
- Dense FFN: fused ColumnParallelLinear gate_up ([gate | up] rows per rank) + RowParallelLinear down.
- MoE FFN: NxD's MoE (RouterTopK + ExpertMLPs): experts sharded over NxD's EP group, their
  intermediate dimension over TP; capacity_factor null = dropless. Router z-loss and the
  load-balance loss are ours (moe/routing.py), from the router logits NxD returns.
- LM head: ColumnParallelLinear (vocab sharded) and NxD's parallel cross-entropy.
Tensors stay batch-first [B, S, H]; every SP collective is told sequence_dimension=1.
Blocks pass the router loss along with the hidden states, so PP stages need no side channel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch_xla.core.xla_model as xm
from neuronx_distributed.lightning import NeuronLTModule
from neuronx_distributed.modules.moe import ExpertMLPs, MoE, RouterTopK
from neuronx_distributed.parallel_layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    mappings,
    parallel_state,
)
from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
from neuronx_distributed.trainer import initialize_parallel_model, initialize_parallel_optimizer
from torch import nn

from moe.errors import ConfigError
from moe.model import MoETransformer, RMSNorm, alibi_slopes, apply_rope, rope_cos_sin
from moe.model.routing import load_balance_loss, router_probs, top_k_routing, z_loss
from moe.train.optim import build_scheduler
from moe.train.step_stats import StepStats

__all__ = ["NxDMoETransformer", "NxDBlock", "NxDMoE", "NxDSwiGLU", "NeuronLitMoE", "RMSNorm"]
SEQ = 1  # sequence dimension of [B, S, H]


def _normal(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def _sp_norm(dim: int, eps: float, sp: bool) -> RMSNorm:
    """RMSNorm on sequence shards: NxD all-reduces grads of weights marked sequence_parallel_enabled."""
    norm = RMSNorm(dim, eps)
    norm.weight.sequence_parallel_enabled = sp
    return norm


class NxDAttention(nn.Module):
    def __init__(self, cfg, sp: bool, out_std: float):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_size()
        if cfg.num_heads % tp or cfg.num_kv_heads % tp:
            raise ConfigError("parallel.tp", tp, f"use a tp dividing model.num_kv_heads={cfg.num_kv_heads}",
                              problem=f"does not divide the heads ({cfg.num_heads} q, {cfg.num_kv_heads} kv)")
        self.head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
        self.heads, self.kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp  # this TP rank's
        self.position_encoding, self.rope_theta = cfg.position_encoding, cfg.rope_theta
        q, kv = cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        local_q, local_kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.split_sizes = [local_q, local_kv, local_kv]
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, q + 2 * kv, bias=False, gather_output=False,
                                             init_method=_normal(cfg.init_range),
                                             sequence_parallel_enabled=sp, sequence_dimension=SEQ)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, bias=False, input_is_parallel=True,
                                        init_method=_normal(out_std), sequence_parallel_enabled=sp,
                                        sequence_dimension=SEQ)
        if self.position_encoding == "alibi":
            rank = parallel_state.get_tensor_model_parallel_rank()
            slopes = alibi_slopes(cfg.num_heads)[rank * self.heads:(rank + 1) * self.heads]
            self.register_buffer("alibi_slopes", slopes, persistent=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x_BSH)  # SP: all-gathers the sequence; [B, S, (heads + 2 kv_heads) * D]
        B, S, _ = qkv.shape
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        mask, causal = None, True
        if self.position_encoding == "rope":
            cos, sin = rope_cos_sin(0, S, self.head_dim, self.rope_theta, qkv.device, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # ALiBi bias, -inf above the diagonal
            pos = torch.arange(S, device=qkv.device)
            dist = (pos[None, :] - pos[:, None]).float()
            mask = (self.alibi_slopes[:, None, None] * dist[None]).masked_fill(dist[None] > 0, float("-inf"))
            mask, causal = mask.to(q.dtype), False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))


class NxDSwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, init_range: float, out_std: float, sp: bool):
        super().__init__()
        self.local = inter // parallel_state.get_tensor_model_parallel_size()
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, bias=False, gather_output=False,
                                                 init_method=_normal(init_range),
                                                 sequence_parallel_enabled=sp, sequence_dimension=SEQ)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, input_is_parallel=True,
                                           init_method=_normal(out_std), sequence_parallel_enabled=sp,
                                           sequence_dimension=SEQ)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.local, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class NxDMoE(nn.Module):
    """NxD's MoE layer; returns (y, router loss term) with our z-loss and load-balance loss."""

    def __init__(self, cfg, moe_opt, sp: bool, out_std: float):
        super().__init__()
        self.top_k, self.aux_coeff, self.z_coeff = cfg.top_k, moe_opt.aux_loss_coeff, moe_opt.z_loss_coeff
        self.normalize = moe_opt.normalize_top_k
        normalize = cfg.top_k >= 2 if moe_opt.normalize_top_k is None else bool(moe_opt.normalize_top_k)
        router = RouterTopK(num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_size=cfg.hidden_size,
                            sequence_parallel_enabled=sp, sequence_dimension=SEQ, act_fn="softmax",
                            jitter_eps=moe_opt.jitter_eps)
        experts = ExpertMLPs(num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_size=cfg.hidden_size,
                             intermediate_size=cfg.intermediate_size, hidden_act="silu", glu_mlp=True,
                             capacity_factor=moe_opt.capacity_factor, normalize_top_k_affinities=normalize,
                             init_method=_normal(cfg.init_range), output_layer_init_method=_normal(out_std))
        self.moe = MoE(router=router, expert_mlps=experts, return_router_logits=True,
                       sequence_parallel_enabled=sp, sequence_dimension=SEQ)
        self.last_stats: dict = {}

    def forward(self, x_BSH: torch.Tensor):
        y, logits_TE = self.moe(x_BSH)[:2]
        probs_TE = router_probs(logits_TE.float(), torch.float32)
        _, idx_TK = top_k_routing(probs_TE, self.top_k, self.normalize)
        aux, z = load_balance_loss(probs_TE, idx_TK), z_loss(logits_TE)
        self.last_stats = {"aux_loss": aux.detach(), "z_loss": z.detach()}
        return y, self.aux_coeff * aux + self.z_coeff * z


class NxDBlock(nn.Module):
    def __init__(self, cfg, moe_opt, layer_idx: int, sp: bool):
        super().__init__()
        out_std = cfg.init_range / (2 * cfg.num_layers) ** 0.5
        self.is_moe = (layer_idx + 1) % cfg.moe_layer_frequency == 0
        self.attn_norm = _sp_norm(cfg.hidden_size, cfg.rms_norm_eps, sp)
        self.attn = NxDAttention(cfg, sp, out_std)
        self.ffn_norm = _sp_norm(cfg.hidden_size, cfg.rms_norm_eps, sp)
        if self.is_moe:
            self.ffn = NxDMoE(cfg, moe_opt, sp, out_std)
        else:
            self.ffn = NxDSwiGLU(cfg.hidden_size, cfg.dense_intermediate_size or cfg.intermediate_size,
                                 cfg.init_range, out_std, sp)

    def forward(self, x_BSH: torch.Tensor, router_loss: torch.Tensor):
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH))
        if self.is_moe:
            y, layer_loss = self.ffn(self.ffn_norm(x_BSH))
            router_loss = router_loss + layer_loss
        else:
            y = self.ffn(self.ffn_norm(x_BSH))
        return x_BSH + y, router_loss


class NxDMoETransformer(nn.Module):
    """forward(input_ids, labels) -> (loss, lm_loss): loss = CE + router terms averaged over MoE layers."""

    def __init__(self, cfg, moe_opt, sequence_parallel: bool):
        super().__init__()
        if cfg.tie_word_embeddings:
            raise ConfigError("model.tie_word_embeddings", True,
                              "set model.tie_word_embeddings=false on trn1",
                              problem="is not supported by the NxD model path")
        self.sp = sequence_parallel
        self.num_moe = sum((i + 1) % cfg.moe_layer_frequency == 0 for i in range(cfg.num_layers))
        self.embed_tokens = ParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                              init_method=_normal(cfg.init_range))
        self.layers = nn.ModuleList([NxDBlock(cfg, moe_opt, i, self.sp) for i in range(cfg.num_layers)])
        self.norm = _sp_norm(cfg.hidden_size, cfg.rms_norm_eps, self.sp)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, bias=False, gather_output=False,
                                            init_method=_normal(cfg.init_range),
                                            sequence_parallel_enabled=self.sp, sequence_dimension=SEQ)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        x = self.embed_tokens(input_ids)
        if self.sp:
            x = mappings.scatter_to_sequence_parallel_region(x, sequence_dimension=SEQ)
        router_loss = torch.zeros((), device=x.device, dtype=torch.float32)
        for block in self.layers:
            x, router_loss = block(x, router_loss)
        logits = self.lm_head(self.norm(x))  # [B, S, V / tp]
        valid = labels != -100
        token_loss = parallel_cross_entropy(logits.float(), labels.masked_fill(~valid, 0))
        lm_loss = (token_loss * valid).sum() / valid.sum().clamp(min=1)
        return lm_loss + router_loss / max(1, self.num_moe), lm_loss


class NeuronLitMoE(NeuronLTModule):
    """NxD's NeuronLTModule for our model: manual optimization, NxD optimizer (ZeRO-1, clipping)."""

    def __init__(self, cfg, nxd_config: dict, backend=None):
        model_cfg, moe_opt, sp = cfg.model, cfg.moe_opt, bool(cfg.parallel.sequence_parallel)
        super().__init__(
            nxd_config=nxd_config, opt_cls=torch.optim.AdamW, scheduler_cls=None,
            model_fn=lambda: NxDMoETransformer(model_cfg, moe_opt, sp),
            grad_accum_steps=cfg.trainer.accumulate_grad_batches,
            train_batch_size=cfg.trainer.micro_batch_size, manual_opt=True,
        )
        self.run_cfg, self.backend = cfg, backend
        with torch.device("meta"):  # config-only twin: parameter and FLOP counts until setup() builds NxD's
            self.model = MoETransformer(model_cfg, moe_opt)
        self.step_stats = StepStats()
        self.pp = cfg.parallel.pp
        self._pending: list[dict] = []  # PP: micro-batches of one step, run by NxD's pipeline at once
        self._grad_norm = float("nan")

    def setup(self, stage=None):
        self.model = initialize_parallel_model(self.nxd_config, self.model_fn, False)
        self.averaged_loss = torch.zeros(1, dtype=torch.double).to(xm.xla_device())

    def configure_optimizers(self):
        """Our AdamW groups (no decay on 1-D weights) over this rank's parameters, our LR schedule."""
        opt = self.run_cfg.optimizer
        partitioned = getattr(self.model, "partitioned", False)  # PP: only this stage's parameters
        named = self.model.local_named_parameters() if partitioned else self.model.named_parameters()
        params = [p for _, p in named if p.requires_grad]
        no_decay = [p for p in params if opt.no_decay_norms_and_biases and p.ndim < 2]
        decay = [p for p in params if not any(p is q for q in no_decay)]
        groups = [{"params": decay, "weight_decay": opt.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        optimizer = initialize_parallel_optimizer(self.nxd_config, torch.optim.AdamW, groups, lr=opt.lr,
                                                  betas=tuple(opt.betas), eps=opt.eps)
        optimizer.zero_grad()
        scheduler = build_scheduler(optimizer, opt, self.run_cfg.trainer.max_steps)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def training_step(self, batch, batch_idx):
        xm.mark_step()
        tokens = batch["input_ids"].numel()
        if self.pp > 1:
            self._pending.append(batch)
            if len(self._pending) < self.grad_accum_steps:
                return None
            joined = {k: torch.cat([b[k] for b in self._pending]) for k in ("input_ids", "labels")}
            self._pending.clear()
            loss = lm_loss = self.model.run_train(input_ids=joined["input_ids"], labels=joined["labels"])
            aux = z = float("nan")  # router terms live on the stages that hold the MoE layers
        else:
            loss, lm_loss = self.model(batch["input_ids"], batch["labels"])
            (loss / self.grad_accum_steps).backward()
            aux, z = self._router_terms()
        self.step_stats.add(loss=loss.detach(), lm_loss=lm_loss.detach(), aux_loss=aux, z_loss=z, routing=[],
                            tokens=tokens)
        xm.mark_step()
        if (batch_idx + 1) % self.grad_accum_steps == 0:
            optimizer, scheduler = self.optimizers(), self.lr_schedulers()
            optimizer.step()
            self._grad_norm = optimizer.grad_norm
            optimizer.zero_grad()
            scheduler.step()
            xm.mark_step()
        return loss

    def _router_terms(self):
        """Mean load-balance and z-loss over the MoE layers of the last forward."""
        stats = [m.last_stats for m in self.model.modules() if isinstance(m, NxDMoE) and m.last_stats]
        if not stats:
            return 0.0, 0.0
        return (sum(s["aux_loss"] for s in stats) / len(stats), sum(s["z_loss"] for s in stats) / len(stats))

    def last_grad_norm(self) -> float:
        """The global norm NxD's optimizer computed (before clipping) in its last step."""
        norm = self._grad_norm
        return float(norm.detach().cpu()) if torch.is_tensor(norm) else float(norm)

    def grad_norm(self) -> torch.Tensor:
        return torch.tensor(self.last_grad_norm())

    def validation_step(self, batch, batch_idx):
        if self.pp > 1:
            return None  # NxD's pipeline evaluates through run_eval; validation runs on pp=1 layouts
        _, lm_loss = self.model(batch["input_ids"], batch["labels"])
        self.log("val_loss", lm_loss.detach().cpu(), prog_bar=True)
        return lm_loss
