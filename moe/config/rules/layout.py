"""The parallel layout: degrees, what divides the world, the data-parallel size and what expert
parallelism is carved from, and the rules two backends share (whole KV heads per TP rank, untied
embeddings). moe.parallel.dims.ParallelDims is built only from a layout these accept."""
from __future__ import annotations

from moe.config.derived import has_moe_layers, launch_overrides
from moe.config.rules.refusals import need
from moe.errors import ConfigError


def check_degrees(parallel) -> None:
    p = parallel
    for key in ("tp", "pp", "ep"):
        value = getattr(p, key)
        need(value >= 1, f"parallel.{key}", value, f"set parallel.{key} to 1 or more", "must be at least 1")
    need(p.dp is None or p.dp >= 1, "parallel.dp", p.dp,
         "set parallel.dp to 1 or more, or null to derive it", "must be at least 1")


def check_world_divisible(parallel, hardware, world: int) -> None:
    p = parallel
    tp_pp = p.tp * p.pp
    key = "pp" if p.tp == 1 else "tp"
    need(world % tp_pp == 0, f"parallel.{key}", getattr(p, key),
         f"launch a multiple of tp*pp = {tp_pp} devices "
         f"({launch_overrides(tp_pp, hardware.devices_per_node)}), or lower parallel.tp / parallel.pp",
         f"(tp*pp = {tp_pp}) does not divide the world size {world}")


def check_dp_matches_world(parallel, hardware, world: int) -> None:
    p = parallel
    if p.dp is None:
        return
    devices = p.tp * p.pp * p.dp
    need(devices == world, "parallel.dp", p.dp,
         f"launch tp*pp*dp = {devices} devices ({launch_overrides(devices, hardware.devices_per_node)}), "
         "or set parallel.dp=null to derive it from the world",
         f"gives tp*pp*dp = {devices} but the world is {world} devices")


def check_ep(parallel, model, hardware, trainer, data, dp: int, spec) -> None:
    p, m = parallel, model
    need(m.num_experts % p.ep == 0, "parallel.ep", p.ep,
         f"use an ep that divides model.num_experts={m.num_experts}",
         f"does not divide num_experts={m.num_experts}")
    if spec.ep_folds_tp:  # EP folded with TP (moe.parallel.dims)
        _check_folded_ep(p, model, trainer.micro_batch_size, data.seq_len, dp)
        return
    least = p.tp * p.pp * p.ep
    need(dp % p.ep == 0, "parallel.ep", p.ep,
         "expert parallelism is carved out of data parallelism, so launch a multiple of "
         f"tp*pp*ep = {least} devices ({launch_overrides(least, hardware.devices_per_node)}), "
         f"or use an ep that divides dp={dp}",
         f"does not divide the data-parallel size {dp}")


def _check_folded_ep(p, model, micro_batch_size: int, seq_len: int, dp: int) -> None:
    """The torch-native backend's EP groups are ep consecutive ranks of the dp x tp ones; each MoE layer
    splits its micro-batch's tokens over the TP group."""
    need(p.ep % p.tp == 0 or p.tp % p.ep == 0, "parallel.ep", p.ep,
         f"use an ep that is a multiple of parallel.tp={p.tp} (EP groups of whole TP groups, e.g. "
         f"ep={2 * p.tp if p.tp > 1 else 2}) or a divisor of it",
         f"neither divides nor is a multiple of tp={p.tp}: EP groups are consecutive ranks and must hold "
         "whole TP groups or lie inside one")
    need((dp * p.tp) % p.ep == 0, "parallel.ep", p.ep,
         f"use an ep that divides dp x tp = {dp * p.tp}, or launch a multiple of "
         f"{p.pp * max(p.ep, p.tp)} devices",
         f"does not divide the {dp * p.tp} ranks (dp {dp} x tp {p.tp}) expert parallelism folds")
    tokens = micro_batch_size * seq_len
    if p.tp > 1 and has_moe_layers(model):
        need(tokens % p.tp == 0, "trainer.micro_batch_size", micro_batch_size,
             f"use a micro-batch size and data.seq_len whose product divides by parallel.tp={p.tp}",
             f"gives {tokens} tokens per micro-batch, which the MoE layers cannot split evenly over the "
             f"{p.tp} TP ranks")


def check_hybrid_shard(parallel, hardware, dp: int, spec) -> None:
    p = parallel
    if p.hybrid_shard_degree is None:
        return
    need(spec.hybrid_shard, "parallel.hybrid_shard_degree", p.hybrid_shard_degree,
         f"set parallel.hybrid_shard_degree=null ({spec.library} shards ZeRO state over the whole "
         "data-parallel group), or use the fsdp2 backend, which has HSDP (hardware=gpu_fsdp2, trn2, "
         "cpu_fsdp2)",
         f"is not implemented by {spec.library} (hardware={hardware.name})")
    need(p.hybrid_shard_degree >= 1 and dp % p.hybrid_shard_degree == 0, "parallel.hybrid_shard_degree",
         p.hybrid_shard_degree, f"use a divisor of dp={dp}, or null to shard over the data-parallel group",
         f"does not divide the data-parallel size {dp}")


def check_global_batch(trainer, dp: int) -> None:
    t = trainer
    if t.global_batch_size is None:
        return
    got = t.micro_batch_size * t.accumulate_grad_batches * dp
    per_micro = t.micro_batch_size * dp
    if t.global_batch_size % per_micro == 0:
        hint = f"set trainer.accumulate_grad_batches={t.global_batch_size // per_micro}"
    else:
        hint = f"use a multiple of micro_batch_size*dp = {per_micro}"
    need(got == t.global_batch_size, "trainer.global_batch_size", t.global_batch_size,
         f"{hint}, or set trainer.global_batch_size=null to derive it",
         "!= micro_batch_size*accumulate_grad_batches*dp = "
         f"{t.micro_batch_size}*{t.accumulate_grad_batches}*{dp} = {got}")


def check_sequence_parallel(parallel) -> None:
    p = parallel
    need(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", p.sequence_parallel,
         "set parallel.sequence_parallel=false, or use tensor parallelism (parallel.tp > 1)",
         "splits activations over the TP group, which needs tp > 1")


def check_zero_stage(parallel, hardware, spec) -> None:
    p, hw = parallel, hardware
    need(p.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", p.zero_stage, "use 0, 1, 2 or 3",
         "is not a ZeRO stage")
    if p.zero_stage <= spec.max_zero_stage:
        return
    if spec.max_zero_stage == 0:
        fix = "use hardware=cpu_deepspeed (or gpu) for ZeRO sharding, or parallel.zero_stage=0"
    else:
        why = spec.zero_limit.format(library=spec.library)
        fix = f"use parallel.zero_stage={spec.max_zero_stage} ({why})"
    raise ConfigError("parallel.zero_stage", p.zero_stage, fix,
                      problem=f"is not available with {spec.library} (hardware={hw.name})")


def check_model_split(parallel, model) -> None:
    p, m = parallel, model
    need(m.num_heads % p.tp == 0, "parallel.tp", p.tp,
         f"use a tp that divides model.num_heads={m.num_heads}", f"does not divide num_heads={m.num_heads}")
    need(m.num_layers % p.pp == 0, "parallel.pp", p.pp,
         f"use a pp that divides model.num_layers={m.num_layers}",
         f"does not divide num_layers={m.num_layers}")


def check_mtp_layout(parallel, model) -> None:
    """model.mtp_layers runs its depths after the main model's last block, on the whole sequence: not under
    pipeline parallelism, whose stages pass only hidden states (moe/model/stage.py: the last stage has neither
    the token ids the depths embed nor their blocks), nor under sequence parallelism, where token i + k may
    lie in the next rank's chunk (Megatron-Core rolls across ranks for it: multi_token_prediction.py
    roll_tensor with a cp_group)."""
    p, m = parallel, model
    if not m.mtp_layers:
        return
    need(p.pp == 1, "model.mtp_layers", m.mtp_layers,
         "use parallel.pp=1 (FSDP2 and expert parallelism shard the model instead), or model.mtp_layers=0",
         f"does not run with pipeline parallelism (parallel.pp={p.pp}): the multi-token-prediction depths "
         "need the token ids and the main model's last hidden states together, and pipeline stages pass "
         "only hidden states")
    need(not p.sequence_parallel, "model.mtp_layers", m.mtp_layers,
         "set parallel.sequence_parallel=false (tensor parallelism without it runs them), or "
         "model.mtp_layers=0",
         "does not run with sequence parallelism: each depth shifts the tokens along the sequence, and a "
         "rank's chunk of it lacks the tokens that follow it")


def check_whole_kv_heads(m, tp: int) -> None:
    """Tensor parallelism splits grouped-query attention by KV head (trn1's GQAQKVColumnParallelLinear and
    the fsdp2 backend's column-parallel k/v): each rank holds whole KV heads, none is replicated."""
    need(m.num_kv_heads % tp == 0, "parallel.tp", tp,
         f"use a tp that divides model.num_kv_heads={m.num_kv_heads}",
         f"does not divide num_kv_heads={m.num_kv_heads}: each rank holds whole KV heads (no KV replication)")


def check_untied_embeddings(m, where: str) -> None:
    """Tied input and output embeddings are one tensor; `where` (a backend, and why) keeps them apart."""
    need(not m.tie_word_embeddings, "model.tie_word_embeddings", True, "set model.tie_word_embeddings=false",
         f"is not supported on {where}")
