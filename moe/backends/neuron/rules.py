"""What neuronx-distributed 2.28 cannot do on trn1, beyond what its spec says (moe.backends.neuron.spec),
refused with what to use instead: one paragraph each (moe.config.rules.refusals.need). Imported by the
validator: no NxD or torch here."""
from __future__ import annotations

from moe.config.derived import has_moe_layers, neuron_precision
from moe.config.rules.layout import check_untied_embeddings, check_whole_kv_heads
from moe.config.rules.refusals import need
from moe.config.schema import normalizes


def check_neuron(parallel, model, moe_opt, trainer, hardware, data, planning: bool) -> None:
    """What neuronx-distributed 2.28 (the last release that trains on trn1) cannot do, refused with why.

    Lines are src/neuronx_distributed/ at v2.28.0; docs/TRAINIUM.md explains each choice.
    """
    p, m, r, t = parallel, model, moe_opt, trainer
    need(t.devices >= 2 or planning, "trainer.devices", t.devices,
         "use 2 or more NeuronCores per node (a trn1.2xlarge has 2, a trn1.32xlarge 32)",
         "is too few: neuronx-distributed's XLA strategy fails with a single device (Lightning "
         "XLAStrategy.setup_distributed)")
    need(m.attention == "gqa", "model.attention", m.attention,
         "use model.attention=gqa on trn1, or train MLA with hardware=gpu, gpu_fsdp2 or trn2",
         "is not built on trn1: the backend swaps the fused qkv_proj for neuronx-distributed's "
         "ColumnParallelLinear (moe/backends/neuron/layers.py), and NxD v2.28.0 has no latent attention "
         "(its attention projection is GQAQKVColumnParallelLinear, modules/qkv_linear.py:371)")
    check_whole_kv_heads(m, p.tp)
    check_untied_embeddings(m, "trn1 (the embedding and the LM head are separate parallel layers)")
    check_neuron_model_pieces(parallel, model)
    need(not m.mtp_layers, "model.mtp_layers", m.mtp_layers,
         "set model.mtp_layers=0 on trn1, or train multi-token prediction with hardware=gpu, gpu_fsdp2 or "
         "cpu",
         "is not built on trn1: neuronx-distributed v2.28.0 has no multi-token-prediction module (nothing "
         "under modules/ nor its pipeline, which cuts the model at transformer_layer_cls blocks, "
         "pipeline/model.py:235-242, :346), and the backend's forward runs the main blocks alone "
         "(moe/backends/neuron/causal_lm.py NxDCausalLM)")
    need(not getattr(data, "document_mask", False), "data.document_mask", True,
         "set data.document_mask=false on trn1, or train with hardware=gpu, gpu_fsdp2 or cpu",
         "is not available on trn1: neuronx-distributed's attention kernel takes only `causal: bool`, "
         "no mask (kernels/flash_attn.py:162-169 nki_flash_attn_func, :30 _flash_attn_forward), and its "
         "pipeline carries input_ids and labels only")
    need(p.activation_checkpointing != "every_n", "parallel.activation_checkpointing", "every_n",
         "use none, full, moe_only or selective on trn1",
         "has no neuronx-distributed equivalent (it checkpoints by module class)")
    need(not r.enable_expert_bias, "moe_opt.enable_expert_bias", True,
         "use the load-balance loss on trn1 (moe_opt.aux_loss_coeff), or hardware=gpu / cpu",
         "is not available on trn1: neuronx-distributed's router has no selection bias "
         "(modules/moe/routing.py:155 RouterTopK)")
    need(r.load_balancing_type == "aux_loss", "moe_opt.load_balancing_type", r.load_balancing_type,
         "use aux_loss on trn1 (set aux_loss_coeff=0 to turn it off)",
         "is not wired to neuronx-distributed's MoE layer (moe/backends/neuron/nxd_moe_layer.py)")
    need(r.num_groups is None, "moe_opt.num_groups", r.num_groups, "set moe_opt.num_groups=null on trn1",
         "is not available on trn1: neuronx-distributed's RouterTopK has no group-limited routing "
         "(modules/moe/routing.py:155-205)")
    need(r.topk_scaling_factor is None, "moe_opt.topk_scaling_factor", r.topk_scaling_factor,
         "set moe_opt.topk_scaling_factor=null on trn1",
         "is not available on trn1: neuronx-distributed's ExpertMLPs takes the affinities as they are")
    need(not r.weights_in_activation, "moe_opt.weights_in_activation", True,
         "set moe_opt.weights_in_activation=false on trn1",
         "is not available on trn1: neuronx-distributed's ExpertMLPs weights the experts' outputs when it "
         "unpermutes them, or the input of a top-1 expert (early_expert_affinity_modulation, "
         "modules/moe/expert_mlps_v2.py:384-413), never inside the activation")
    need(not r.fp8_experts, "moe_opt.fp8_experts", True, "set moe_opt.fp8_experts=false on trn1",
         "is not available on trn1: neuronx-distributed's ExpertMLPsV2 runs its own expert GEMMs "
         "(modules/moe/expert_mlps_v2.py:1405 forward, by capacity factor or blockwise), not ours")
    check_neuron_precision(model, trainer, hardware, data)
    if p.ep > 1:
        check_neuron_expert_parallel(parallel, model, moe_opt)
    nxd_routing = "or use moe_opt=nxd (neuronx-distributed's routing)"
    if r.capacity_factor is not None:
        need(r.drop_policy == "position", "moe_opt.drop_policy", r.drop_policy,
             f"set moe_opt.drop_policy=position, {nxd_routing}",
             "is not neuronx-distributed's: it drops the latest tokens (modules/moe/expert_mlps_v2.py:"
             "514-528)")
        need(r.min_capacity == 0, "moe_opt.min_capacity", r.min_capacity,
             f"set moe_opt.min_capacity=0, {nxd_routing}",
             "has no neuronx-distributed equivalent (capacity min(ceil(T*k*cf/E), T), "
             "expert_mlps_v2.py:498-501)")
        need(r.normalize_after_drop or not normalizes(r.normalize_top_k, m.top_k),
             "moe_opt.normalize_after_drop", r.normalize_after_drop,
             f"set moe_opt.normalize_after_drop=true, {nxd_routing}",
             "is not neuronx-distributed's: it renormalises the top-k weights over the experts a capacity "
             "kept (expert_mlps_v2.py:299-318)")
    need(r.eval_capacity_factor == r.capacity_factor, "moe_opt.eval_capacity_factor", r.eval_capacity_factor,
         f"set moe_opt.eval_capacity_factor={r.capacity_factor}, {nxd_routing}",
         "differs from capacity_factor, and neuronx-distributed's MoE has one capacity factor")
    need(r.jitter_eps == 0, "moe_opt.jitter_eps", r.jitter_eps, f"set moe_opt.jitter_eps=0, {nxd_routing}",
         "is not supported on trn1 (NxD's router jitter writes into its input, "
         "modules/moe/routing.py:92-97)")
    need(r.router_dtype == "fp32", "moe_opt.router_dtype", r.router_dtype, "use fp32 on trn1",
         "is not supported on trn1 (NxD's router runs in fp32)")
    need(r.aux_loss_group == "ep", "moe_opt.aux_loss_group", r.aux_loss_group, "use ep on trn1",
         "is not supported on trn1 (load balance over one data-parallel rank's tokens only)")
    need(not (m.top_k == 1 and r.normalize_top_k), "moe_opt.normalize_top_k", True,
         "leave moe_opt.normalize_top_k null or false with top_k=1",
         "with top_k=1 is refused by neuronx-distributed (expert_mlps_v2.py:270-271)")


def check_neuron_model_pieces(parallel, model) -> None:
    """The architecture pieces of the Hugging Face families (docs/TRAINIUM.md has the table). Trained:
    q/k/v and o biases (ColumnParallelLinear's bias shards with its rows, parallel_layers/layers.py:661-670,
    707-711; RowParallelLinear adds its whole bias once after the reduce, :916-917, :1013), a per-head
    QK-norm and attention sinks (our attention on each rank's heads, moe/backends/neuron/layers.py), the
    router's bias (RouterTopK(bias=True), modules/moe/routing.py:73). Refused: what NxD's expert
    modules lack, or compute otherwise in training."""
    p, m = parallel, model
    need(not (m.qk_norm == "full" and p.tp > 1), "model.qk_norm", m.qk_norm,
         "use model.qk_norm=per_head, or parallel.tp=1 on trn1",
         "with tensor parallelism is not built on trn1: an RMSNorm over the whole q and k width needs every "
         "head, and neuronx-distributed's ColumnParallelLinear(gather_output=False) leaves each rank its own "
         "heads' rows (parallel_layers/layers.py:661-670, :763)")
    need(not m.expert_proj_bias, "model.expert_proj_bias", True,
         "set model.expert_proj_bias=false on trn1, or train with hardware=gpu, gpu_fsdp2 or cpu",
         "is not trained right by neuronx-distributed v2.28.0: its experts' down projection adds its bias to "
         "every tensor-parallel rank's partial sum before the MoE output's reduction (modules/moe/experts.py:"
         "130-137 reduce_output=False, moe_parallel_layers.py:312 'bias needs to be divided by TP degree', "
         ":418-430), so each step trains tp copies of it; at tp 1 it would be NxD's, but this backend does "
         "not map our [E, width] expert biases onto its layers")
    need(m.expert_activation == "swiglu", "model.expert_activation", m.expert_activation,
         "use model.expert_activation=swiglu on trn1, or train with hardware=gpu, gpu_fsdp2 or cpu",
         "is not neuronx-distributed v2.28.0's in training: its dropless path runs SiLU GLU only and falls "
         "back to the capacity path, with capacity 0 (modules/moe/expert_mlps_v2.py:1456-1459), and its "
         "clamped SWIGLU moves the up projection's clamp by hidden_act_bias (expert_mlps_v2.py:150-154) "
         "where the experts clamp before adding it (modules/moe/experts.py:224-230): a clamp at limit + 1, "
         "not gpt-oss's")
    need(not m.shared_expert_gate, "model.shared_expert_gate", True,
         "set model.shared_expert_gate=false on trn1, or train with hardware=gpu, gpu_fsdp2 or cpu",
         "is not in neuronx-distributed v2.28.0: its MoE adds the shared experts' output ungated "
         "(modules/moe/model.py:355-359; SharedExperts, modules/moe/shared_experts.py:73, has no gate)")
    need(m.shared_expert_intermediate_size == 0, "model.shared_expert_intermediate_size",
         m.shared_expert_intermediate_size,
         "use 0 on trn1, or train with hardware=gpu, gpu_fsdp2 or cpu",
         "is not built on trn1: neuronx-distributed v2.28.0's MoE takes a SharedExperts module "
         "(modules/moe/model.py:91, shared_experts.py:73), which this backend does not build (its "
         "sequence-parallel mode replicates the weights for inference, shared_experts.py:118-127)")


def check_neuron_precision(model, trainer, hardware, data) -> None:
    """NxD's MoE computes its slot indices in float64 (expert_mlps_v2.py:285-294, :518, :531-545):
    XLA_USE_BF16=1 (bf16_sr) runs them in bf16, exact for integers up to 256 only, which misplaces
    most tokens' slots; XLA_DOWNCAST_BF16=1 (mixed) runs them in float32, exact up to 2**24 slots."""
    m, t = model, trainer
    precision = neuron_precision(hardware, model)
    moe_layers = has_moe_layers(m)
    fix = ("use hardware.neuron_precision=mixed (bf16 compute, fp32 master weights; float64 runs as float32) "
           "or fp32, or auto, which picks mixed for MoE models")
    need(not (moe_layers and precision == "bf16_sr"), "hardware.neuron_precision", "bf16_sr", fix,
         "would corrupt neuronx-distributed's MoE routing: XLA_USE_BF16=1 turns its float64 slot arithmetic "
         "(modules/moe/expert_mlps_v2.py:285-294, 518, 531-545) into bf16, exact for counts up to 256 only")
    slots = m.num_experts * t.micro_batch_size * data.seq_len  # the largest slot index, at capacity T
    need(not (moe_layers and precision == "mixed" and slots > 2**24), "trainer.micro_batch_size",
         t.micro_batch_size, "use hardware.neuron_precision=fp32, or fewer tokens per micro-batch",
         f"gives {slots:,} MoE slots (num_experts x micro_batch_size x seq_len), past 2**24, where "
         "float32 (mixed precision's float64) stops counting exactly")


def check_neuron_expert_parallel(parallel, model, moe_opt) -> None:
    """What neuronx-distributed's training-time expert parallelism (EP carved out of data parallelism,
    the capacity path's all-to-all, moe/backends/neuron/nxd_moe_layer.py) needs; lines are v2.28.0's."""
    p, m, r = parallel, model, moe_opt
    need(r.capacity_factor is not None, "moe_opt.capacity_factor", None,
         "set moe_opt.capacity_factor (e.g. 2.0, moe_opt=nxd) with parallel.ep > 1 on trn1, or "
         "parallel.ep=1 for dropless",
         "(dropless) is not expert-parallel in neuronx-distributed's training: its blockwise path runs "
         "this rank's experts on this rank's tokens only, with no all-to-all (modules/moe/"
         "expert_mlps_v2.py:713-716, 776-781), which is right for inference, where every rank holds the "
         "same tokens")
    full = m.num_experts / m.top_k
    need(r.capacity_factor < full, "moe_opt.capacity_factor", r.capacity_factor,
         f"use a capacity factor below num_experts / top_k = {full:g} with parallel.ep > 1 (e.g. 2.0)",
         f"is at least num_experts / top_k = {full:g}, which neuronx-distributed turns into full capacity "
         "(expert_mlps_v2.py:268-269): every token through every local expert, with no all-to-all under "
         "expert parallelism (modules/moe/experts.py:172-174, 182-189)")
    need(p.zero_stage == 1, "parallel.zero_stage", p.zero_stage,
         "set parallel.zero_stage=1 with parallel.ep > 1 on trn1 (NxD's expert-parallel ZeRO-1, "
         "NeuronEPZero1Optimizer; every trn1 preset uses it)",
         "cannot be resumed with expert parallelism: without ZeRO-1 neuronx-distributed saves the optimizer "
         "state of expert-parallel rank 0 only (the first rank of each data-parallel group, "
         "trainer/checkpoint.py:765-770, :580) and loads every rank's own _ep_rank_ file (:923-924)")
    need(p.tp != 4, "parallel.tp", p.tp, "use tp 2 or 8 with parallel.ep > 1 on trn1",
         "with expert parallelism is refused by neuronx-distributed on trn1 (its TP 4 groups are not "
         "contiguous; parallel_layers/parallel_state.py:605-606)")
