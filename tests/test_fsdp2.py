"""The torch-native backend (hardware.strategy=fsdp2): DeviceMesh, FSDP2, TP, EP, canonical checkpoints.

Fast: the TP-interleaved row maps, the mesh shape, and, on a real 2-process gloo group, a tiny model
parallelised on the meta device (TP 2, then FSDP2 over 2 ranks) that materialises each rank's shards
with one process's values and gives one process's logits. Slow: 20 training steps per layout against
one process holding the same global batch (tests/_parity.py), and resumes across layouts and backends.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg, on_gloo_ranks
from omegaconf import OmegaConf

from moe.parallel.dims import Meshes, ParallelDims
from moe.parallel.placement import Where, pieces
from moe.parallel.tensor_parallel import canonical_runs, interleave_order
from tests._parity import TOL, TWO_RANKS, assert_same_losses, losses, rows, single_process_baseline, train


def test_interleaved_rows_map_back_to_the_canonical_layout():
    # q 4 rows, k 2, v 2 over tp 2: rank 0 holds q0 q1 k0 v0, rank 1 q2 q3 k1 v1
    assert interleave_order([4, 2, 2], 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    # FSDP's chunk of rank 1's TP rows (interleaved rows 5..7): q3, k1, v1
    assert canonical_runs(5, 3, [4, 2, 2], 2) == [(0, 1, 3), (1, 1, 5), (2, 1, 7)]
    assert canonical_runs(0, 8, [4, 4], 1) == [(0, 8, 0)]  # tp 1: the identity, one run
    w = torch.arange(8.0 * 3).view(8, 3)
    live = w[interleave_order([4, 2, 2], 2)]
    parts = pieces(live, Where(segments=(4, 2, 2), tp=2))  # the whole live tensor, in 6 canonical runs
    assert len(parts) == 6 and sum(part.shape[0] for part, _ in parts) == 8
    for part, (row, col) in parts:
        assert torch.equal(part, w[row:row + part.shape[0], col:])


def test_an_expert_piece_sits_at_its_global_expert_index():
    local = torch.zeros(2, 4, 6)  # experts 4 and 5 of 8
    [(part, offsets)] = pieces(local, Where(first_expert=4, num_experts=8))
    assert part.shape == (2, 4, 6) and offsets == (4, 0, 0)


def _dims(world, tp=1, ep=1, hybrid=None, per_node=None):
    from moe.config.upgrade import with_schema_defaults

    cfg = with_schema_defaults({
        "parallel": {"tp": tp, "pp": 1, "ep": ep, "dp": None, "sequence_parallel": False, "zero_stage": 3,
                     "hybrid_shard_degree": hybrid},
        "trainer": {"devices": world, "num_nodes": 1, "micro_batch_size": 1, "accumulate_grad_batches": 1},
        "hardware": {"devices_per_node": per_node or world, "strategy": "fsdp2"}, "data": {"seq_len": 8},
        "model": {"num_layers": 2, "num_experts": 8}})
    return ParallelDims.from_config(cfg)


def test_mesh_dims_follow_the_layout_rank_order():
    # 64 GPUs, tp 2, ep 8, HSDP shard groups of 16 data-parallel ranks: 2 replicas; the experts' view
    # of a replica's 32 ranks is 4 (efsdp) x 8 (ep)
    want = {"dp_replicate": 2, "dp_shard": 16, "tp": 2, "efsdp": 4, "ep": 8}
    assert _dims(64, tp=2, ep=8, hybrid=16).mesh_shape() == want
    assert _dims(4, ep=2).mesh_shape() == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "efsdp": 2, "ep": 2}


def test_folded_ep_keeps_tp_then_ep_inside_a_node():
    """Mixtral 8x22B's layout (64 GPUs, 8 a node, tp 2, ep 8): an EP group is one node's 8 ranks (4 TP
    pairs), the replicas of an expert are a rank's peers on the other nodes."""
    dims = _dims(64, tp=2, ep=8, hybrid=16, per_node=8)
    groups = {g.name: g for g in dims.rank_groups()}
    assert groups["TP"].ranks[0] == [0, 1]
    assert groups["EP"].ranks[0] == list(range(8)) and groups["EP"].count == 8
    assert groups["expert-DP"].ranks[0] == list(range(0, 64, 8))
    assert {dims.nodes_spanned(g) for g in groups["EP"].ranks} == {1}
    assert {dims.nodes_spanned(g) for g in groups["TP"].ranks} == {1}
    assert (dims.expert_dp, dims.moe_token_split, dims.first_expert(9)) == (8, 2, 1)


def test_the_8x22b_preset_runs_no_expert_matmul_twice():
    """experiment=mixtral_8x22b_gpu_fsdp2: each MoE layer splits its tokens over the TP pair (every
    expert row computed on one rank), and every TP and EP group is inside one node."""
    from moe.train.run import settle

    dims = settle(compose_cfg("experiment=mixtral_8x22b_gpu_fsdp2", "dry_run=true")).dims
    assert (dims.world, dims.tp, dims.ep, dims.moe_token_split) == (64, 2, 8, 2)
    for name in ("TP", "EP"):
        assert {dims.nodes_spanned(ranks) for ranks in dims.group(name).ranks} == {1}, name


def _tiny_cfg():
    from moe.config.schema import ModelConfig, MoEOptConfig

    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "num_experts": 4, "top_k": 2, "moe_layer_frequency": 2})
    return model, OmegaConf.merge(OmegaConf.structured(MoEOptConfig), {"capacity_factor": None})


def _on_two_ranks(body) -> dict:
    """`body()` (a module-level function) on each of 2 gloo ranks -> {rank: what it returned}."""
    return on_gloo_ranks(2, _call, body)


def _call(rank: int, body):
    return body()


def _tp2_on_meta(model_cfg, moe_opt):
    """(the model built on the meta device and split by TP over both ranks, the 2-rank TP mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe.model.model import MoETransformer
    from moe.parallel.tensor_parallel import apply_tp

    with torch.device("meta"):
        model = MoETransformer(model_cfg, moe_opt, init_seed=7)
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    apply_tp(model, world["tp"])
    return model, world


def _tp_fsdp_logits():
    from torch.distributed.device_mesh import init_device_mesh

    from moe.parallel.fsdp import apply_fsdp
    from moe.parallel.placement import materialize_distributed

    model_cfg, moe_opt = _tiny_cfg()
    model, world = _tp2_on_meta(model_cfg, moe_opt)
    # FSDP2 over a 1-rank data-parallel mesh (the TP layout is what is checked)
    one = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp2"))["dp"]
    meshes = Meshes(world=world, sparse=None, dense=one, experts=one, ep=None, tp=world["tp"], dp=one,
                    tokens=world, pp=None)
    apply_fsdp(model, meshes, expert_divide_factor=1, reshard_after_forward=True)
    materialize_distributed(model, "cpu", None, model_cfg, tp=2)
    ids = torch.arange(12).view(2, 6) % 64
    qkv = model.layers[0].attn.qkv_proj.weight.full_tensor().detach()
    return model(ids).logits_BSV.detach(), qkv


def test_tp2_on_the_meta_device_materialises_one_process_values_and_logits():
    from moe.model.model import MoETransformer

    out = _on_two_ranks(_tp_fsdp_logits)
    model_cfg, moe_opt = _tiny_cfg()
    reference = MoETransformer(model_cfg, moe_opt, init_seed=7)
    want = reference(torch.arange(12).view(2, 6) % 64).logits_BSV.detach()
    interleaved = reference.layers[0].attn.qkv_proj.weight[interleave_order([16, 8, 8], 2)]
    for rank in (0, 1):
        logits, qkv = out[rank]
        assert torch.equal(qkv, interleaved)  # every rank's heads, q k v of each, in the TP-interleaved order
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def _mla_cfg():
    from moe.config.schema import ModelConfig, MoEOptConfig

    model = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_layers=2, num_heads=4,
                        num_experts=4, top_k=2, first_k_dense_replace=1, attention="mla", q_lora_rank=8,
                        kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
    return model, MoEOptConfig(capacity_factor=None)


def _mla_grads(model) -> dict[str, torch.Tensor]:
    """Gradients of one forward/backward of a fixed batch, full tensors (TP shards gathered)."""
    ids = torch.arange(24).view(2, 12) % 64
    (model(ids).logits_BSV.float().pow(2).mean()).backward()
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters() if ".attn." in name}


def _mla_tp_grads():
    from moe.parallel.placement import materialize_distributed

    model_cfg, moe_opt = _mla_cfg()
    model, _ = _tp2_on_meta(model_cfg, moe_opt)
    materialize_distributed(model, "cpu", None, model_cfg, tp=2)  # dense [gate | up] rows interleaved
    return _mla_grads(model)


def _qwen_cfg():
    """GQA with Qwen3-MoE's per-head QK-norm and Qwen2-MoE's q/k/v biases."""
    from moe.config.schema import ModelConfig, MoEOptConfig

    model = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_layers=2, num_heads=4,
                        num_kv_heads=2, num_experts=4, top_k=2, first_k_dense_replace=1, qk_norm="per_head",
                        qkv_bias=True)
    return model, MoEOptConfig(capacity_factor=None)


def _qwen_reference():
    """One process's model, its biases and norm weights drawn away from 0 and 1 (the init's)."""
    from moe.model.model import MoETransformer

    model = MoETransformer(*_qwen_cfg(), init_seed=7)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "_norm.weight")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model


def _qwen_tp_grads():
    from moe.parallel.placement import materialize_distributed

    model_cfg, moe_opt = _qwen_cfg()
    model, _ = _tp2_on_meta(model_cfg, moe_opt)
    values = _qwen_reference().state_dict()
    materialize_distributed(model, "cpu", lambda name, shape, first: values[name], model_cfg, tp=2)
    return _mla_grads(model)


def _tp2_attention_grads():
    return {"mla": _mla_tp_grads(), "qwen": _qwen_tp_grads()}


def test_mla_and_qk_norm_attention_under_tp2_give_one_process_gradients():
    """Attention split by heads over 2 TP ranks, every attention weight's gradient equals one process's.
    Latent attention: the replicated down-projections included (the shared RoPE key's gradient summed over
    the ranks). GQA with a per-head QK-norm and q/k/v biases: the bias with its rows (TP-interleaved as the
    weight's), the norm weights whole on each rank with their gradients summed over the ranks. One pair of
    processes for both."""
    from moe.model.model import MoETransformer

    out = _on_two_ranks(_tp2_attention_grads)
    mla = _mla_grads(MoETransformer(*_mla_cfg(), init_seed=7))
    assert "layers.0.attn.kv_a_proj.weight" in mla and "layers.1.attn.q_b_proj.weight" in mla
    qwen = _mla_grads(_qwen_reference())
    assert "layers.0.attn.qkv_proj.bias" in qwen and "layers.1.attn.q_norm.weight" in qwen
    for rank in (0, 1):
        assert set(out[rank]["mla"]) == set(mla) and set(out[rank]["qwen"]) == set(qwen)
        for name, grad in mla.items():
            # without the sum over TP ranks, kv_a_proj's RoPE rows are off by 7e-7
            torch.testing.assert_close(out[rank]["mla"][name], grad, atol=1e-8, rtol=1e-6, msg=name)
        for name, grad in qwen.items():
            if ".qkv_proj." in name:  # the live tensor's rows are TP-interleaved
                grad = grad[interleave_order([16, 8, 8], 2)]
            torch.testing.assert_close(out[rank]["qwen"][name], grad, atol=1e-7, rtol=1e-5, msg=name)


def _mtp_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient of one training loss (LM + router terms + weighted MTP loss) of a fixed batch, full
    tensors (TP shards gathered)."""
    ids = torch.arange(26).view(2, 13) % 64
    model(ids[:, :-1], labels_BS=ids[:, 1:]).loss.backward()
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def _mtp_tp_grads():
    from dataclasses import replace

    from moe.parallel.placement import materialize_distributed

    model_cfg, moe_opt = _mla_cfg()
    model_cfg = replace(model_cfg, mtp_layers=1)
    model, _ = _tp2_on_meta(model_cfg, moe_opt)
    materialize_distributed(model, "cpu", None, model_cfg, tp=2)
    return _mtp_grads(model)


def test_a_multi_token_prediction_depth_under_tp2_gives_one_process_gradients():
    """model.mtp_layers=1 on the latent-attention model under TP 2: the depth's block is split as a layer is
    (its attention by heads), its eh_proj and norms whole on each rank; every parameter's gradient of the
    training loss equals one process's."""
    from dataclasses import replace

    from moe.model.model import MoETransformer

    out = _on_two_ranks(_mtp_tp_grads)
    model_cfg, moe_opt = _mla_cfg()
    want = _mtp_grads(MoETransformer(replace(model_cfg, mtp_layers=1), moe_opt, init_seed=7))
    assert "mtp.0.eh_proj.weight" in want and "mtp.0.block.attn.q_b_proj.weight" in want
    for rank in (0, 1):
        assert set(out[rank]) == set(want)
        for name, grad in want.items():
            if name.endswith("ffn.gate_up_proj.weight"):  # a dense layer's [gate | up] rows: TP-interleaved
                grad = grad[interleave_order([8, 8], 2)]
            torch.testing.assert_close(out[rank][name], grad, atol=1e-7, rtol=1e-5, msg=name)


# -- slow: 20 training steps per layout, and resumes -------------------------------------------------
FSDP2 = ("hardware=cpu_fsdp2", "moe_opt.aux_loss_group=dp")
FOUR = ("trainer.devices=4", "hardware.devices_per_node=4")
LAYOUTS = {
    "tp2": ("parallel=fsdp2_tp2", "trainer.devices=2", "trainer.micro_batch_size=4"),
    "ep2": ("parallel=fsdp2_ep2", *TWO_RANKS),
    # dp 2 x tp 2 with EP 2 folded over TP and sequence parallelism: every piece of the 4-rank layout at once
    "dp2_tp2_ep2_sp": ("parallel=fsdp2_tp2", "parallel.ep=2", "parallel.sequence_parallel=true", *FOUR,
                       "trainer.micro_batch_size=2"),
    "dp2_ep2": ("parallel=fsdp2_ep2", *FOUR, "trainer.micro_batch_size=1"),
    "hsdp_ep2": ("parallel=fsdp2_hsdp", "parallel.ep=2", *FOUR, "trainer.micro_batch_size=1"),
}


MLA = ("model=tiny_deepseek_v3", "moe_opt.score_function=sigmoid", "moe_opt.num_groups=4",
       "moe_opt.group_top_k=2", "moe_opt.topk_scaling_factor=2.5", "moe_opt.enable_expert_bias=true")


@pytest.fixture(scope="module")
def mla_single(tmp_path_factory) -> Path:
    """The one-process MLA run both layouts below compare with."""
    single = tmp_path_factory.mktemp("mla") / "single"
    train(single, *MLA, "trainer.devices=1", "trainer.micro_batch_size=4")
    return single


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp2_tp2_ep2_sp"])
def test_mla_with_first_k_dense_layers_matches_one_process_under_fsdp2(tmp_path, mla_single, layout):
    """model=tiny_deepseek_v3 (latent attention, a dense first layer, sigmoid group-limited routing with the
    expert bias): FSDP2 with TP 2 gives every step's loss of one process holding the same global batch."""
    train(tmp_path / layout, *MLA, *FSDP2, *LAYOUTS[layout])
    assert_same_losses(tmp_path / layout, mla_single)


# Qwen-MoE's pieces at once: per-head QK-norm, q/k/v biases, a sigmoid-gated shared expert, a dense layer
QWEN = ("model.qk_norm=per_head", "model.qkv_bias=true", "model.shared_expert_intermediate_size=64",
        "model.shared_expert_gate=true", "model.dense_layers=[0]", "moe_opt.normalize_top_k=false")
# gpt-oss's: sinks, a 16-token window on the sliding layers only, the o bias (q/k/v's are Qwen's), router and
# expert biases, the clamped SwiGLU
GPT_OSS = ("model.attention_sinks=true", "model.sliding_window=16",
           "model.attention_layer_types=[sliding_attention,full_attention,sliding_attention,full_attention]",
           "model.o_bias=true", "model.router_bias=true", "model.expert_proj_bias=true",
           "model.expert_activation=clamped_swiglu")


QWEN_STEPS = 10  # of the harness's 20: a wrong gradient shows in the loss from the second step


@pytest.mark.slow
def test_qwen_and_gpt_oss_pieces_match_one_process_under_fsdp2_dp2_ep2(tmp_path):
    """Every Qwen-MoE and gpt-oss piece in one model under FSDP2 over 4 ranks (dp 2 x ep 2): the biases, the
    per-head norm and the sinks sharded over the data-parallel ranks, the shared expert's gate reduced as the
    shared expert is, the experts' biases with their experts: every step's loss equals one process's. (Under
    TP the same pieces' gradients: the fast
    test_mla_and_qk_norm_attention_under_tp2_give_one_process_gradients and test_hf_gpt_oss.py's tp2 / ep2
    test.)"""
    single = tmp_path / "single"
    steps = f"trainer.max_steps={QWEN_STEPS}"
    train(single, *QWEN, *GPT_OSS, steps, "trainer.devices=1", "trainer.micro_batch_size=4")
    train(tmp_path / "dp2_ep2", *QWEN, *GPT_OSS, steps, *FSDP2, *LAYOUTS["dp2_ep2"])
    assert_same_losses(tmp_path / "dp2_ep2", single, steps=QWEN_STEPS)


# multi-token prediction: one depth, its block an MoE layer (model=tiny: every layer MoE)
MTP = ("model.mtp_layers=1", "model.mtp_loss_weight=0.3")


@pytest.mark.slow
def test_multi_token_prediction_matches_one_process_under_fsdp2_dp2_ep2(tmp_path):
    """model.mtp_layers=1 under FSDP2 over 4 ranks (dp 2 x ep 2) with full activation checkpointing: the
    depth one FSDP2 unit with its block, its experts sharded by EP and over their replicas, its block
    recomputed in the backward; every step's loss (LM + router terms + 0.3 x MTP) and MTP loss equal one
    process's without checkpointing."""
    single = tmp_path / "single"
    steps = f"trainer.max_steps={QWEN_STEPS}"
    train(single, *MTP, steps, "trainer.devices=1", "trainer.micro_batch_size=4")
    train(tmp_path / "dp2_ep2", *MTP, steps, *FSDP2, *LAYOUTS["dp2_ep2"],
          "parallel.activation_checkpointing=full")
    assert_same_losses(tmp_path / "dp2_ep2", single, steps=QWEN_STEPS)
    mtp = [[float(r["mtp_loss"]) for r in rows(run)] for run in (tmp_path / "dp2_ep2", single)]
    assert max(abs(a - b) for a, b in zip(*mtp, strict=True)) <= TOL


HSDP = ("parallel=fsdp2_hsdp", *FOUR, "trainer.micro_batch_size=1")  # tests/test_resume_layouts.py trains it


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_fsdp2_layout_matches_one_process(tmp_path, tmp_path_factory, layout):
    """tp (its MoE tokens split over TP), dp x ep (each expert sharded over its 2 replicas), dp x tp with EP
    folded over TP and sequence parallelism, HSDP x ep: every step's loss equals one process holding the
    same global batch (HSDP alone: tests/test_resume_layouts.py; plain FSDP2 over dp is in each of these,
    the dense weights sharded over every data-parallel rank)."""
    single = single_process_baseline(tmp_path_factory)
    run = tmp_path / layout
    train(run, *FSDP2, *LAYOUTS[layout])
    assert_same_losses(run, single)


def _trained(run: Path, *overrides: str) -> Path:
    train(run, *overrides)
    return run


def _resume_at_10(tmp_path, run: Path, then: tuple):
    """Resume the step-10 checkpoint of `run` (20 steps) under `then`: (uninterrupted, resumed, process)."""
    resumed_run = tmp_path / "resumed"
    (resumed_run / "checkpoints").mkdir(parents=True)
    for saved in (run / "checkpoints").glob("step-000010.ckpt*"):  # a directory, or a file and its sidecar
        copy = shutil.copytree if saved.is_dir() else shutil.copy2
        copy(saved, resumed_run / "checkpoints" / saved.name)
    proc = train(resumed_run, *then, resume=True)
    assert "step-000010" in proc.stdout
    return losses(run), losses(resumed_run), proc


@pytest.fixture(scope="module")
def folded_run(tmp_path_factory) -> Path:
    """20 steps of FSDP2 x TP 2 x EP 2 (folded, sequence parallel) on 4 ranks (checkpoints at 10 and 20),
    for the resumes below."""
    return _trained(tmp_path_factory.mktemp("folded") / "first", *FSDP2, *LAYOUTS["dp2_tp2_ep2_sp"])


@pytest.mark.slow
@pytest.mark.parametrize("then", [
    (*FSDP2, *LAYOUTS["ep2"]),  # another FSDP2 layout: TP 2 -> EP 2
    ("hardware=cpu", "parallel=ep2", "moe_opt.aux_loss_group=dp", *TWO_RANKS),  # DDP with EP
], ids=["fsdp2_ep2", "ddp_ep2"])
def test_an_fsdp2_dp2_tp2_checkpoint_resumes_under_another_layout_and_backend(tmp_path, folded_run, then):
    """Weights and Adam moments are canonical in the checkpoint (FSDP2 x TP shards of 4 ranks mapped back to
    [q | k | v] rows, experts of the folded EP groups at their global index): steps 11-20 under EP 2 alone
    equal the uninterrupted run's."""
    uninterrupted, resumed, _ = _resume_at_10(tmp_path, folded_run, then)
    assert len(resumed) == 10
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted[10:], strict=True)) <= TOL


@pytest.mark.slow
def test_a_portable_checkpoint_of_one_process_resumes_under_fsdp2_tp2(tmp_path):
    """One process writes one file holding everything (torch's id-keyed Adam state); FSDP2 x TP fills its
    shards from it (moe.parallel.placement.load_full_checkpoint): steps 11-20 equal the uninterrupted
    run's."""
    one = ("trainer.devices=1", "trainer.micro_batch_size=4", "moe_opt.aux_loss_group=dp")
    uninterrupted, resumed, _ = _resume_at_10(tmp_path, _trained(tmp_path / "first", *one),
                                              (*FSDP2, *LAYOUTS["tp2"]))
    assert len(resumed) == 10
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted[10:], strict=True)) <= TOL


@pytest.mark.slow
def test_a_deepspeed_checkpoint_resumes_under_fsdp2_and_back(tmp_path):
    """DeepSpeed keeps its optimizer partitions in its own files, so across the two backends the weights
    carry over (the first resumed step's loss is the uninterrupted run's) and Adam restarts, with a
    warning; the run goes on training."""
    deepspeed = ("hardware=cpu_deepspeed", "parallel=ep2", "moe_opt.aux_loss_group=dp", *TWO_RANKS)
    ds = _trained(tmp_path / "ds" / "first", *deepspeed)
    uninterrupted, resumed, proc = _resume_at_10(tmp_path / "ds", ds, (*FSDP2, *LAYOUTS["dp2_tp2_ep2_sp"]))
    assert "Adam moments start from zero" in proc.stdout + proc.stderr
    assert abs(resumed[0] - uninterrupted[10]) <= TOL and resumed[-1] < resumed[0]
    fsdp2 = _trained(tmp_path / "fsdp2" / "first", *FSDP2, *LAYOUTS["ep2"])
    uninterrupted, resumed, _ = _resume_at_10(tmp_path / "fsdp2", fsdp2, deepspeed)
    assert abs(resumed[0] - uninterrupted[10]) <= TOL and resumed[-1] < resumed[0]
