"""What each backend cannot do, refused with what to use instead: the capabilities are its spec's
(moe/config/specs.py); these rules turn a capability it lacks, or a limit of its library (neuronx-distributed
v2.28.0, torch.distributed.pipelining, DeepSpeed), into one paragraph."""
from __future__ import annotations

from moe.config.choices import (
    NEURON_PRECISIONS,
)
from moe.config.derived import (
    PP_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    dense_width,
    has_moe_layers,
    neuron_precision,
    precision_of,
    stages_per_rank,
)
from moe.config.rules.base import need, one_of
from moe.config.rules.layout import check_untied_embeddings, check_whole_kv_heads
from moe.config.schema import normalizes
from moe.config.specs import SPECS
from moe.errors import ConfigError


def check_backend(hardware, trainer) -> None:
    hw, t = hardware, trainer
    one_of("hardware.strategy", hw.strategy, tuple(SPECS), "strategy")
    need(t.devices <= hw.devices_per_node, "trainer.devices", t.devices,
         f"use at most {hw.devices_per_node} devices per node and raise trainer.num_nodes instead",
         f"exceeds hardware.devices_per_node={hw.devices_per_node} ({hw.name})")
    one_of("hardware.neuron_precision", hw.neuron_precision, NEURON_PRECISIONS, "Neuron precision preset")
    spec = SPECS[hw.strategy]
    precision = precision_of(t, hw)
    if spec.precisions is None:
        need(t.precision is None, "trainer.precision", t.precision,
             "leave trainer.precision=null and pick hardware.neuron_precision "
             f"({', '.join(NEURON_PRECISIONS)})",
             f"is not used by {spec.library} (hardware={hw.name})")
    else:
        key = "trainer.precision" if t.precision else "hardware.precision"
        need(precision in spec.precisions, key, precision, f"use one of {', '.join(spec.precisions)}",
             f"is not a precision the {spec.library} backend runs")


def check_backend_degrees(parallel, hardware, spec) -> None:
    """A degree the backend would ignore is refused, so no run silently trains another layout."""
    p, hw = parallel, hardware
    capable = {"tp": spec.tensor_parallel, "pp": spec.pipeline_parallel}
    for key, able in capable.items():
        if getattr(p, key) > 1 and not able:
            others = [s.name for s in SPECS.values()
                      if (s.tensor_parallel if key == "tp" else s.pipeline_parallel)]
            raise ConfigError(f"parallel.{key}", getattr(p, key),
                              f"set parallel.{key}=1 (use parallel.ep and data parallelism), or a backend "
                              f"that has it (hardware.strategy: {', '.join(others)}; e.g. hardware=trn1)",
                              problem=f"is not implemented by {spec.library} (hardware={hw.name})")


def check_pp_schedule(parallel, spec) -> None:
    """Only the torch-native backend picks a pipeline schedule; NxD runs its own 1F1B."""
    p = parallel
    if len(spec.pp_schedules) > 1:
        return
    need(p.pp_schedule == "1F1B" and p.pp_stages_per_rank in (None, 1), "parallel.pp_schedule",
         p.pp_schedule, "leave parallel.pp_schedule=1F1B and parallel.pp_stages_per_rank=null, or use the "
         "torch-native backend (hardware=gpu_fsdp2, trn2, cpu_fsdp2) for other schedules",
         f"is not chosen on {spec.library}: neuronx-distributed runs its own 1F1B schedule")


def check_offload(parallel, model, spec) -> None:
    """parallel.offload_experts is FSDP2's CPUOffloadPolicy on the experts' units (the torch-native
    backend's)."""
    if not parallel.offload_experts:
        return
    need(spec.offload_experts, "parallel.offload_experts", True,
         "use the torch-native backend (hardware=gpu_fsdp2 or gpu_a100_fsdp2), or "
         "parallel.offload_experts=false",
         f"is FSDP2's CPUOffloadPolicy, which {spec.library} does not run (DeepSpeed's own "
         "offload is not built here)")
    need(has_moe_layers(model), "parallel.offload_experts", True, "set parallel.offload_experts=false",
         f"has no experts to offload in model={model.name}")


def check_overlap_comm(parallel, spec) -> None:
    """parallel.overlap_comm is a DeepSpeed ZeRO setting."""
    p = parallel
    if p.overlap_comm is None:
        return
    need(spec.overlap_comm, "parallel.overlap_comm", p.overlap_comm,
         "leave parallel.overlap_comm=null, or use DeepSpeed (hardware=gpu or cpu_deepspeed)",
         f"is DeepSpeed's ZeRO setting, which {spec.library} does not have")


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
    need(m.shared_expert_intermediate_size == 0, "model.shared_expert_intermediate_size",
         m.shared_expert_intermediate_size, "use 0 on trn1", "is not wired to neuronx-distributed's MoE")
    need(p.activation_checkpointing != "every_n", "parallel.activation_checkpointing", "every_n",
         "use none, full, moe_only or selective on trn1",
         "has no neuronx-distributed equivalent (it checkpoints by module class)")
    need(not r.enable_expert_bias, "moe_opt.enable_expert_bias", True,
         "use the load-balance loss on trn1 (moe_opt.aux_loss_coeff), or hardware=gpu / cpu",
         "is not available on trn1: neuronx-distributed's router has no selection bias "
         "(modules/moe/routing.py:155 RouterTopK)")
    need(r.load_balancing_type == "aux_loss", "moe_opt.load_balancing_type", r.load_balancing_type,
         "use aux_loss on trn1 (set aux_loss_coeff=0 to turn it off)",
         "is not wired to neuronx-distributed's MoE layer (moe/backends/neuron/moe_layer.py)")
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
    the capacity path's all-to-all, moe/backends/neuron/moe_layer.py) needs; lines are v2.28.0's."""
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


def check_fsdp2(parallel, model, trainer, data, dp: int) -> None:
    """What the torch-native backend (moe/backends/fsdp2.py) does not do, refused with what to use."""
    p, m = parallel, model
    need(p.zero_stage >= 2 or dp == 1, "parallel.zero_stage", p.zero_stage,
         "set parallel.zero_stage=3 (each block's gathered weights freed after its forward) or 2 (kept "
         "until its backward: more memory, one all-gather fewer)",
         "is not what FSDP2 does: it shards weights, gradients and optimizer states over the data-parallel "
         "ranks (use hardware=gpu, DeepSpeed, for ZeRO-1)")
    if p.hybrid_shard_degree:
        need(p.hybrid_shard_degree * p.tp % p.ep == 0, "parallel.hybrid_shard_degree", p.hybrid_shard_degree,
             f"use one whose product with parallel.tp={p.tp} is a multiple of parallel.ep={p.ep}",
             "must hold whole expert-parallel groups (each HSDP shard group holds every expert)")
    if p.sequence_parallel and p.tp > 1:
        need(data.seq_len % p.tp == 0, "data.seq_len", data.seq_len,
             f"use a sequence length divisible by parallel.tp={p.tp}, or parallel.sequence_parallel=false",
             f"cannot be split evenly over the {p.tp} TP ranks of sequence parallelism")
    check_untied_embeddings(m, "the fsdp2 backend (FSDP2 would shard the embedding and the LM head apart)")
    if m.attention == "gqa":
        check_whole_kv_heads(m, p.tp)
    if p.pp > 1:
        _check_fsdp2_pipeline(p, trainer, m)
    if p.tp > 1:
        width = dense_width(m)
        need(width % p.tp == 0, "parallel.tp", p.tp, f"use a tp that divides the dense MLP width {width}",
             f"does not divide the dense MLP width {width}")
        need(m.position_encoding == "rope", "model.position_encoding", m.position_encoding,
             "use rope with tensor parallelism on the fsdp2 backend, or parallel.tp=1",
             "is not split over TP ranks (ALiBi's slopes are per head)")


def _check_fsdp2_pipeline(p, t, m) -> None:
    """torch.distributed.pipelining's limits (torch/distributed/pipelining/schedules.py: 1F1B needs as many
    micro-batches as stages, the looped schedules whole rounds of pp) and what this product runs of it."""
    need(p.pp_schedule not in ("ZBVZeroBubble", "DualPipeV"), "parallel.pp_schedule", p.pp_schedule,
         "use InterleavedZeroBubble (zero bubble on looped stages), or Interleaved1F1B",
         "is refused: validation runs through the schedule, and torch 2.13's V-shaped schedules fail in "
         "eval() (pipelining/stage.py:419, \"can't steal_bwd_input if this stage doesn't have backward\")")
    one_of("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES, "pipeline schedule")
    schedule = p.pp_schedule
    per_rank = stages_per_rank(schedule, p.pp_stages_per_rank)
    single = schedule.lower() in SINGLE_STAGE_SCHEDULES
    if single:
        need(per_rank == 1, "parallel.pp_stages_per_rank", per_rank,
             "set parallel.pp_stages_per_rank=1 (or null)",
             f"is not what {schedule} runs: one stage per pp rank")
    else:
        need(per_rank >= 2, "parallel.pp_stages_per_rank", per_rank,
             "set parallel.pp_stages_per_rank=2 or more (or null), or parallel.pp_schedule=1F1B",
             f"is too few for {schedule}, which interleaves several stages on each pp rank")
    stages = p.pp * per_rank
    need(m.num_layers % stages == 0, "parallel.pp", p.pp,
         f"use a pp (times parallel.pp_stages_per_rank={per_rank}) that divides model.num_layers="
         f"{m.num_layers}",
         f"gives {stages} pipeline stages, which do not split {m.num_layers} layers evenly")
    if "ZeroBubble" in schedule:
        need(p.zero_stage == 2, "parallel.zero_stage", p.zero_stage,
             "set parallel.zero_stage=2 (each stage's weights stay gathered from its forward to its "
             "backward, torchtitan's default under pipelining)",
             f"frees the gathered weights after each forward, and {schedule}'s split weight-gradient pass "
             "then finds none of them (pipelining/_backward.py stage_backward_input: the gradients of every "
             "stage but the first would be lost)")
    n = p.pipeline_microbatches or t.accumulate_grad_batches
    field, value = (("parallel.pipeline_microbatches", p.pipeline_microbatches) if p.pipeline_microbatches
                    else ("trainer.accumulate_grad_batches", t.accumulate_grad_batches))
    rows = t.micro_batch_size * t.accumulate_grad_batches
    need(rows % n == 0, field, value, f"use a number of micro-batches that divides the {rows} sequences a "
         "rank takes per step (trainer.micro_batch_size x trainer.accumulate_grad_batches)",
         f"does not split the step's {rows} sequences evenly")
    need(n >= p.pp and (single or n % p.pp == 0), field, value,
         f"use at least {p.pp} micro-batches{'' if single else f', a multiple of parallel.pp={p.pp}'} (more "
         "micro-batches also shrink the pipeline bubble)",
         f"is not a number of micro-batches {schedule} runs over {p.pp} pipeline ranks")


# the rules one backend adds, by hardware.strategy (its spec, moe.config.specs, says what it can do; these
# say what its library refuses, with the fix)
BACKEND_RULES = {"neuron": check_neuron, "fsdp2": check_fsdp2}
