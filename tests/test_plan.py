"""Dry-run planner: parameter counts, layout (world, nodes, rank groups) and the memory verdict."""
from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from moe.config import TrainConfig
from moe.config.size import param_breakdown
from moe.parallel.dims import ParallelDims
from moe.tools import plan as planner

MODELS = {  # the presets' architecture values (conf/model/*.yaml), so these tests need no Hydra
    "mixtral_8x7b": dict(name="mixtral_8x7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, max_position_embeddings=4096),
    "mixtral_8x22b": dict(name="mixtral_8x22b", vocab_size=32768, hidden_size=6144, intermediate_size=16384,
                          num_layers=56, num_heads=48, num_kv_heads=8, max_position_embeddings=65536),
}
HARDWARE = {
    "gpu": dict(name="gpu", accelerator="gpu", strategy="deepspeed", backend="nccl", device_name="H100-80GB",
                devices_per_node=8, device_memory_gib=80.0, peak_tflops=989.0, precision="bf16-mixed"),
    "trn1": dict(name="trn1", accelerator="neuron", strategy="neuron", backend="xla",
                 device_name="trn1 NeuronCore-v2", devices_per_node=32, device_memory_gib=16.0,
                 peak_tflops=95.0, precision="bf16", neuron_precision="auto"),
}
TP8_PP8_EP8 = dict(name="tp8_pp8_ep8", tp=8, pp=8, ep=8, sequence_parallel=True, zero_stage=1,
                   activation_checkpointing="moe_only")


def cfg_of(model=None, hardware=None, parallel=None, **top):
    """A typed TrainConfig with some groups replaced (what Hydra would compose)."""
    cfg = OmegaConf.structured(TrainConfig)
    for group, values in (("model", model), ("hardware", hardware), ("parallel", parallel)):
        if values:
            cfg[group] = OmegaConf.merge(cfg[group], values)
    for key, value in top.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def make_plan(cfg):
    return planner.make_plan(cfg, ParallelDims.from_config(cfg))


def count_params(model_cfg) -> tuple[int, int]:
    sizes = param_breakdown(model_cfg)
    return sizes.total, sizes.active


def test_mixtral_8x7b_param_count():
    total, active = count_params(cfg_of(model=MODELS["mixtral_8x7b"]).model)
    assert total == 46_702_792_704  # 46.7B (Mistral AI)
    assert active == 12_879_925_248  # 12.9B: 2 of 8 experts per layer
    assert abs(total / 46.7e9 - 1) < 0.01 and abs(active / 12.9e9 - 1) < 0.01


def test_mixtral_8x22b_param_count():
    total, active = count_params(cfg_of(model=MODELS["mixtral_8x22b"]).model)
    assert abs(total / 141e9 - 1) < 0.01 and abs(active / 39e9 - 1) < 0.01


@pytest.mark.parametrize("overrides", [
    {}, {"top_k": 1}, {"moe_layer_frequency": 2, "dense_intermediate_size": 96},
    {"tie_word_embeddings": True}, {"head_dim": 16},
    {"shared_expert_intermediate_size": 64, "num_layers": 3, "moe_layer_frequency": 3},
])
def test_count_matches_the_built_model(overrides):
    """The arithmetic equals numel() of moe/model/model.py's MoETransformer, for tiny variants."""
    from moe.model import MoETransformer

    cfg = cfg_of(model=overrides)
    model = MoETransformer(cfg.model, cfg.moe_opt)
    total, active = count_params(cfg.model)
    assert total == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if getattr(p, "is_expert", False))
    per_layer_used = cfg.model.top_k / cfg.model.num_experts
    assert active == total - routed + routed * per_layer_used


def test_moe_layer_frequency_makes_every_second_layer_moe():
    b = param_breakdown(cfg_of(model={**MODELS["mixtral_8x7b"], "moe_layer_frequency": 2}).model)
    assert b.num_moe_layers == 16 and b.dense_mlp == 16 * 3 * 4096 * 14336


def test_tp8_pp8_ep8_on_trn1_needs_16_nodes():
    plan = make_plan(cfg_of(MODELS["mixtral_8x7b"], HARDWARE["trn1"], TP8_PP8_EP8, dry_run=True))
    lay = plan.dims
    assert (lay.world, lay.nodes, lay.dp, lay.expert_dp) == (512, 16, 8, 1)
    groups = {g.name: g for g in lay.rank_groups()}
    assert groups["TP"].ranks[0] == list(range(8)) and groups["TP"].count == 64
    assert groups["PP"].ranks[0] == [0, 64, 128, 192, 256, 320, 384, 448]
    assert groups["DP"].ranks[0] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert groups["EP"].ranks[0] == groups["DP"].ranks[0]  # dp == ep: the EP group is the whole DP group
    text = plan.render()
    assert "512 x trn1 NeuronCore-v2 = 16 node(s) of 32" in text
    assert "To launch: trainer.devices=32 trainer.num_nodes=16" in text


def test_dp2_ep8_on_gpu_is_two_nodes():
    parallel = dict(name="dp2_ep8", ep=8, dp=16, zero_stage=1, activation_checkpointing="full")
    plan = make_plan(cfg_of(MODELS["mixtral_8x7b"], HARDWARE["gpu"], parallel, dry_run=True))
    assert (plan.dims.world, plan.dims.nodes, plan.dims.expert_dp) == (16, 2, 2)
    assert plan.dims.group("expert-DP").ranks[0] == [0, 8]


def test_mixtral_on_one_gpu_does_not_fit():
    plan = make_plan(cfg_of(MODELS["mixtral_8x7b"], HARDWARE["gpu"], dry_run=True))
    mem = plan.memory
    # 16 bytes per parameter (bf16 weights and grads, fp32 master + 2 moments), unsharded
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(46_702_792_704 * 16 / 2**30)
    assert mem.verdict == "does not fit" and mem.headroom < 0
    assert "does not fit" in plan.render()


def test_moe_1b_fits_one_h100():
    moe_1b = dict(name="moe_1b", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=16,
                  num_heads=16, num_kv_heads=4, max_position_embeddings=4096)
    cfg = cfg_of(moe_1b, HARDWARE["gpu"], dry_run=True)
    OmegaConf.update(cfg, "data.seq_len", 2048)
    OmegaConf.update(cfg, "trainer.micro_batch_size", 4)
    plan = make_plan(cfg)
    assert 1e9 < plan.params_total < 2e9 and plan.memory.verdict == "fits"


def test_zero1_shards_optimizer_states_over_dp_and_experts_over_expert_dp():
    model = MODELS["mixtral_8x7b"]
    base = dict(ep=8, dp=16, activation_checkpointing="full")
    plain = make_plan(cfg_of(model, HARDWARE["gpu"], {**base, "zero_stage": 0}, dry_run=True)).memory
    zero1 = make_plan(cfg_of(model, HARDWARE["gpu"], {**base, "zero_stage": 1}, dry_run=True)).memory
    b = param_breakdown(cfg_of(model=model).model)
    expected = 12 * (b.non_expert / 16 + b.experts / 8 / 2) / 2**30  # dense over dp 16, experts over 16/8
    assert zero1.optimizer == pytest.approx(expected)
    assert plain.optimizer == pytest.approx(12 * (b.non_expert + b.experts / 8) / 2**30)
    assert zero1.params == plain.params and zero1.grads == plain.grads
    hybrid = make_plan(cfg_of(model, HARDWARE["gpu"], {**base, "zero_stage": 1, "hybrid_shard_degree": 4},
                              dry_run=True)).memory
    assert hybrid.optimizer == pytest.approx(12 * (b.non_expert / 4 + b.experts / 8 / 2) / 2**30)


def test_activation_policies_order_and_sequence_parallel():
    model = {**MODELS["mixtral_8x7b"], "moe_layer_frequency": 2}  # moe_only then differs from full

    def act(policy, **parallel):
        cfg = cfg_of(model, HARDWARE["trn1"], {"tp": 8, "activation_checkpointing": policy, **parallel},
                     dry_run=True)
        OmegaConf.update(cfg, "trainer.micro_batch_size", 1)
        return make_plan(cfg).memory.activations

    none, selective, moe_only, full = act("none"), act("selective"), act("moe_only"), act("full")
    assert full < moe_only < none and full < selective < none
    assert act("every_n", activation_checkpointing_every_n=1) == pytest.approx(full)
    assert act("every_n", activation_checkpointing_every_n=2) < none
    assert act("none", sequence_parallel=True) < none  # norms and layer inputs split over tp too


def test_pipeline_keeps_microbatches_in_flight_on_the_first_stage():
    model, parallel = MODELS["mixtral_8x7b"], {**TP8_PP8_EP8, "activation_checkpointing": "none"}
    one = cfg_of(model, HARDWARE["trn1"], parallel, dry_run=True)
    many = cfg_of(model, HARDWARE["trn1"], parallel, dry_run=True)
    OmegaConf.update(many, "trainer.accumulate_grad_batches", 16)
    first_one, first_many = make_plan(one).memory.activations, make_plan(many).memory.activations
    assert first_many > 4 * first_one  # min(pp=8, 16) micro-batches held vs 1 (plus the logits)


def karakuri(parallel: dict):
    """KARAKURI's recipe (conf/experiment/karakuri_8x7b_trn1.yaml) with another parallel group."""
    cfg = cfg_of(MODELS["mixtral_8x7b"], HARDWARE["trn1"], parallel, dry_run=True)
    recipe = {"data.seq_len": 4096, "trainer.micro_batch_size": 1, "trainer.accumulate_grad_batches": 128,
              "trainer.devices": 32, "trainer.num_nodes": 16, "model.position_encoding": "alibi",
              "moe_opt.capacity_factor": 2.0}
    for key, value in recipe.items():
        OmegaConf.update(cfg, key, value)
    return make_plan(cfg)


def test_nxd_checkpoints_the_moe_layer_alone_so_moe_only_keeps_the_attention():
    """NxD's moe_only wraps NxDMoELayer (moe/backends/neuron/nxd_config.py), not the block: each MoE block's
    attention activations stay, its [S, S] scores included (XLA does not fuse attention), for all 8
    micro-batches 1F1B holds on the first stage. Counted as the whole block, the plan showed 3.8 GiB."""
    ep8 = karakuri(TP8_PP8_EP8)
    assert ep8.memory.activations == pytest.approx(11.01, abs=0.01)
    assert ep8.memory.total == pytest.approx(12.75, abs=0.01) and ep8.memory.verdict == "fits"
    selective = karakuri({**TP8_PP8_EP8, "activation_checkpointing": "selective"}).memory.activations
    full = karakuri({**TP8_PP8_EP8, "activation_checkpointing": "full"}).memory.activations
    assert full < selective < ep8.memory.activations  # selective also recomputes the scores (CoreAttention)


def test_trn1_plan_warns_above_90_percent_with_the_fix():
    """KARAKURI's tensor 8 x pipeline 8 without EP holds all 8 experts (split over TP) per NeuronCore: with
    mixed precision's fp32 master weights it needs more than a NeuronCore has; EP 8 is the fix."""
    tp8_pp8 = karakuri({**TP8_PP8_EP8, "name": "tp8_pp8", "ep": 1})
    assert tp8_pp8.memory.total == pytest.approx(16.19, abs=0.01) and tp8_pp8.memory.verdict == "does not fit"
    warning = next(n for n in tp8_pp8.notes if n.startswith("warning: "))
    assert "above 90% of the 16 GiB of a trn1 NeuronCore-v2" in warning and "more parallel.ep" in warning
    assert "warning: " in tp8_pp8.render() and "note: warning" not in tp8_pp8.render()


def test_nxd_zero1_steps_on_its_own_copy_of_the_weights():
    """torch-xla's ZeroRedundancyOptimizer keeps each rank's shard of the weights in the optimizer dtype
    (fp32, or the master weights of mixed precision): measured in NxD's CPU mode, tests/neuron_real."""
    def bytes_of(precision, zero_stage):
        cfg = cfg_of(MODELS["mixtral_8x7b"], {**HARDWARE["trn1"], "neuron_precision": precision},
                     {**TP8_PP8_EP8, "zero_stage": zero_stage}, dry_run=True)
        b = planner.spec_of(cfg.hardware).state_bytes(cfg.model, cfg.parallel, cfg.hardware, cfg.trainer)
        return b.param, b.grad, b.optimizer

    assert bytes_of("fp32", 1) == (4, 4, 12) and bytes_of("fp32", 0) == (4, 4, 8)
    assert bytes_of("auto", 1) == bytes_of("mixed", 1) == (2, 4, 12)  # auto: mixed for an MoE model
    assert bytes_of("bf16_sr", 1) == (2, 2, 6) and bytes_of("mixed", 0) == (2, 2, 4)


def test_routing_skew_and_fixed_costs_enter_the_plan():
    """Dropless EP 8 over 8 experts: the rank holding the hottest expert (routing_skew x its share) gets that
    many times the routed rows; a capacity caps them (no change); hardware.fixed_memory_gib adds as is."""
    from moe.tools.plan import activation_bytes, hot_rank_load

    hardware = {**HARDWARE["gpu"], "fixed_memory_gib": 3.0}
    dropless = cfg_of(MODELS["mixtral_8x7b"], hardware, {"name": "ep8", "ep": 8, "zero_stage": 1},
                      dry_run=True, **{"trainer.devices": 8, "moe_opt.capacity_factor": None})
    dims = ParallelDims.from_config(dropless)
    # one expert per rank, at twice its share
    assert hot_rank_load(dropless.moe_opt, dims, dropless.routing_skew) == 2.0
    balanced = copy.deepcopy(dropless)
    balanced.routing_skew = 1.0

    def first_stage(cfg) -> float:
        return activation_bytes(cfg.model, cfg.moe_opt, cfg.parallel, cfg.hardware, cfg.trainer, dims,
                                cfg.routing_skew, cfg.trainer.micro_batch_size)[0]

    skewed_acts, even_acts = first_stage(dropless), first_stage(balanced)
    assert skewed_acts > 1.5 * even_acts  # the routed rows dominate a layer's activations
    capped = copy.deepcopy(dropless)
    capped.moe_opt.capacity_factor = 1.25
    assert hot_rank_load(capped.moe_opt, dims, capped.routing_skew) == 1.0
    plan, even = make_plan(dropless), make_plan(balanced)
    difference = plan.memory.activations - even.memory.activations
    assert difference == pytest.approx((skewed_acts - even_acts) / 2**30)
    assert plan.memory.fixed == 3.0 and "fixed" in plan.render()
    no_fixed = copy.deepcopy(dropless)
    no_fixed.hardware.fixed_memory_gib = 0.0
    assert plan.memory.total == pytest.approx(make_plan(no_fixed).memory.total + 3.0)
