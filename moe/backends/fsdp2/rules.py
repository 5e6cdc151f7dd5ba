"""What the torch-native backend (FSDP2 + DTensor, torch.distributed.pipelining) does not do, beyond what its
spec says (moe.backends.fsdp2.spec), refused with what to use instead. Imported by the validator: no torch
here."""
from __future__ import annotations

from moe.config.derived import PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, dense_width, stages_per_rank
from moe.config.rules.layout import check_untied_embeddings, check_whole_kv_heads
from moe.config.rules.refusals import need, one_of


def check_fsdp2(parallel, model, trainer, data, dp: int) -> None:
    """What the torch-native backend (moe/backends/fsdp2/backend.py) does not do, refused with what to use."""
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
        need(m.qk_norm != "full", "model.qk_norm", m.qk_norm,
             "use parallel.tp=1 for a full-width QK-norm (OLMoE's), or qk_norm=per_head",
             "normalises over the whole q and k projections, which tensor parallelism splits by head "
             "(each rank would normalise over its own heads only)")


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
