"""simulate=true: one rank's real step at the configured world size, with fake tensors, on this CPU."""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, compose_cfg, run_entry

from moe.config import ModelConfig
from moe.config.size import param_breakdown
from moe.errors import ConfigError


def simulated(run_dir, *overrides: str) -> tuple[dict, str]:
    """(simulation.json, the printed report) of `train.py simulate=true overrides...`, run in this process."""
    from moe.tools.simulate import simulate
    from moe.train.run import settle

    settled = settle(compose_cfg("simulate=true", *overrides))
    report = simulate(settled.config, settled.dims, run_dir).render()
    return json.loads((run_dir / "simulation.json").read_text()), report


def test_simulated_ep_rank_holds_its_share_and_the_planner_agrees(tmp_path):
    run_dir = tmp_path / "sim"
    result, report = simulated(run_dir, "parallel=ep2", "model.num_experts=4", "simulate_rank=1")
    cfg = ModelConfig(**(_tiny() | {"num_experts": 4}))
    sizes = param_breakdown(cfg)
    assert result["world_size"] == 2 and result["rank"] == 1
    assert result["params_local"] == sizes.non_expert + sizes.experts // 2
    assert result["params_total"] == sizes.total
    assert result["peak_memory_gib"] > 0
    # within 20% on the full-size presets (docs/SCALE.md); at hidden 64 the per-token costs the planner
    # leaves out (RoPE tables, router statistics, index tensors) weigh more
    assert abs(result["planned_peak_memory_gib"] / result["peak_memory_gib"] - 1) <= 0.3
    assert "planner" in report and not (run_dir / "checkpoints").exists()


def _tiny() -> dict:
    values = yaml.safe_load((REPO / "conf/model/tiny.yaml").read_text())
    return {k: v for k, v in values.items() if k in ModelConfig.__dataclass_fields__}


def test_an_fsdp2_rank_stores_its_shards_and_the_planner_agrees(tmp_path):
    """The torch-native backend on 4 devices (EP 2, FSDP2 over the rest): rank 0 stores a quarter of the
    dense weights and half of its EP rank's experts; the planner is within 30% (as for the tiny EP case)."""
    result, _ = simulated(tmp_path, "hardware=cpu_fsdp2", "parallel=fsdp2_ep2", "trainer.devices=4",
                          "hardware.devices_per_node=4")
    sizes = param_breakdown(ModelConfig(**_tiny()))
    assert result["world_size"] == 4
    assert result["params_local"] == pytest.approx(sizes.non_expert / 4 + sizes.experts / 2 / 2, rel=0.01)
    assert abs(result["planner_error"]) <= 0.3, result


def test_a_second_simulation_in_one_process_builds_its_own_world(tmp_path):
    """A multirun of simulations runs in one process, and settle hands an equal config the same
    ParallelDims: the second world builds its own process groups and meshes (it named the first world's,
    which it never registered: "Could not resolve the process group registered under the name 13") and
    gets the same figures."""
    overrides = ("hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "trainer.devices=2",
                 "parallel.sequence_parallel=true")
    first, _ = simulated(tmp_path / "first", *overrides)
    second, _ = simulated(tmp_path / "second", *overrides)
    figures = ("params_local", "peak_memory_gib")
    assert [second[k] for k in figures] == [first[k] for k in figures]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["folded", "folded_sp"])
def test_a_tp2_folded_ep2_rank_stores_its_shards_and_the_planner_agrees(tmp_path, sequence_parallel):
    """EP folded with TP (4 devices: dp 2 x tp 2, EP groups of 2 consecutive ranks), with and without
    sequence parallelism: rank 0 stores half of the attention (TP) over 2 data-parallel ranks, the rest of
    the dense weights over 2, and its 4 experts over the 2 ranks holding them; the token split (and the
    sequence chunks) run on the fake ranks too."""
    result, _ = simulated(tmp_path, "hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "parallel.ep=2",
                          "trainer.devices=4", "hardware.devices_per_node=4",
                          f"parallel.sequence_parallel={str(sequence_parallel).lower()}")
    sizes = param_breakdown(ModelConfig(**_tiny()))
    dense = sizes.attention / 4 + (sizes.non_expert - sizes.attention) / 2
    assert result["world_size"] == 4
    assert result["params_local"] == pytest.approx(dense + sizes.experts / 2 / 2, rel=0.01)
    assert abs(result["planner_error"]) <= 0.3, result


def test_what_cannot_be_simulated_is_refused_with_exit_2(tmp_path):
    proc = run_entry("train.py", "experiment=karakuri_8x7b_trn1", "simulate=true",
                     f"hydra.run.dir={tmp_path / 'sim'}", here=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: simulate=True" in proc.stderr and not (tmp_path / "sim").exists()
    with pytest.raises(ConfigError) as err:
        simulated(tmp_path, "simulate_rank=5")
    assert err.value.field == "simulate_rank"


def test_deepspeeds_fp32_master_partition_is_counted(tmp_path):
    """ZeRO-1 under bf16: each rank's fp32 master partition (made outside the tracker) is in the peak."""
    result, _ = simulated(tmp_path, "hardware=cpu_deepspeed", "trainer.devices=2", "parallel.zero_stage=1",
                          "trainer.precision=bf16-mixed")
    sizes = param_breakdown(ModelConfig(**_tiny()))
    master_gib = (-(-sizes.non_expert // 2) + -(-sizes.experts // 2)) * 4 / 2**30  # dp2: both halved
    assert result["breakdown_gib"]["Other"] >= master_gib
    assert abs(result["planned_peak_memory_gib"] / result["peak_memory_gib"] - 1) <= 0.3


def test_each_pipeline_stage_simulates_its_own_layers_and_micro_batches_in_flight(tmp_path):
    """pp 2 on 2 devices (1F1B, 4 micro-batches): each rank builds only its stage (half the layers; the
    embeddings on the first, the LM head on the last) and keeps the activations of the micro-batches its
    schedule has in flight, 2 on the first stage against 1 on the last. With the experts offloaded, what
    FSDP2 keeps in host memory leaves the device total for a "Host" entry."""
    pp = ("hardware=cpu_fsdp2", "parallel.pp=2", "trainer.devices=2", "trainer.micro_batch_size=1",
          "trainer.accumulate_grad_batches=4")
    sizes = param_breakdown(ModelConfig(**_tiny()))
    first, _ = simulated(tmp_path / "first", *pp, "simulate_rank=0")
    last, _ = simulated(tmp_path / "last", *pp, "simulate_rank=1")
    layers_half = (sizes.total - sizes.embedding - sizes.lm_head - sizes.final_norm) / 2
    assert first["params_local"] == pytest.approx(layers_half + sizes.embedding, rel=0.01)
    assert last["params_local"] == pytest.approx(layers_half + sizes.lm_head + sizes.final_norm, rel=0.01)
    # 2 micro-batches' blocks against 1's and the LM head's chunk of fp32 logits
    assert first["breakdown_gib"]["Activation"] > 1.3 * last["breakdown_gib"]["Activation"]
    gpipe, _ = simulated(tmp_path / "gpipe", *pp, "simulate_rank=0", "parallel.pp_schedule=GPipe")
    assert gpipe["breakdown_gib"]["Activation"] > 1.3 * first["breakdown_gib"]["Activation"]  # all 4
    offloaded, _ = simulated(tmp_path / "offload", *pp, "simulate_rank=0", "parallel.offload_experts=true")
    host = offloaded["breakdown_gib"]["Host"]
    expert_bytes = sizes.experts / 2 * 16 / 2**30  # fp32 shard, fp32 gradient, two fp32 moments
    assert host == pytest.approx(expert_bytes, rel=0.01)
    # off the device, less the block's shard copied in for its all-gather
    before = first["peak_memory_gib"]
    assert before - host < offloaded["peak_memory_gib"] < before - host / 2
