"""hardware=trn1 through neuronx-distributed, on the fakes of tests/fakes (what they are: its README).

Each test names the failure it guards against: what the trn1 path once did wrong when read against
NxD v2.28.0, and behaviour that had silently changed there. The backend's own code runs unchanged;
only neuronx_distributed and torch_xla are the fakes, whose signatures tests/test_neuron_fakes.py
checks against the real release.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe.config  # noqa: F401  (registers the typed schemas with Hydra)
from moe.config.validate import validate
from moe.errors import ConfigError, UserError
from tests.conftest import REPO, compose_cfg, free_port, run_entry, validated_dims

FAKES = REPO / "tests" / "fakes"
FAKE_ENV = {"PYTHONPATH": str(FAKES)}
TRN1 = ("hardware=trn1", "trainer.devices=2")
MIXTRAL_TRN1 = ("experiment=karakuri_8x7b_trn1",)


def _forget_fakes() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in ("neuronx_distributed", "torch_xla") or name.startswith(
            "moe.backends.neuron."
        ):
            del sys.modules[name]


@pytest.fixture
def nxd_fakes(monkeypatch):
    """The fakes on sys.path for this test only; the environment the backend sets restored after."""
    env = dict(os.environ)
    _forget_fakes()
    monkeypatch.syspath_prepend(str(FAKES))
    yield
    _forget_fakes()
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture
def nxd(nxd_fakes):
    """The fakes and one gloo process, whose model-parallel state NxD's config initialises."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    from neuronx_distributed.parallel_layers import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def backend_for(*overrides: str):
    """The trn1 backend (hardware=trn1, 2 devices unless overridden) with NxD's config made."""
    from moe.backends.neuron.backend import NeuronBackend
    from moe.train.run import settled_of

    settled = settled_of(compose_cfg(*TRN1, *overrides))
    backend = NeuronBackend(settled.config, settled.dims)
    backend.nxd_config()  # initialises NxD's parallel state when torch.distributed is up
    return backend


def neuron_module(*overrides: str):
    """NeuronLitMoE attached to a Trainer with NxD's strategy, its model built by NxD's setup (meta
    device, then param_init_fn), as trainer.fit does before the first step."""
    backend = backend_for(*overrides)
    return attached(backend, backend.build_module())


def attached(backend, module):
    import lightning as L

    parts = backend.trainer_parts()
    trainer = L.Trainer(
        accelerator=parts.accelerator,
        strategy=parts.strategy,
        plugins=parts.plugins,
        devices=backend.cfg.trainer.devices,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.strategy.connect(module)
    module.trainer = trainer
    module.setup("fit")
    return module


def nxd_kwargs(cfg, param_init_fn=None) -> dict:
    """neuronx_distributed_config's arguments for `cfg` (moe.backends.neuron.nxd_config)."""
    from moe.backends.neuron.nxd_config import nxd_config_kwargs

    dims = validated_dims(cfg)
    return nxd_config_kwargs(cfg.hardware, cfg.model, cfg.optimizer, cfg.parallel, dims, param_init_fn)


def filled_model(cfg, sequence_parallel: bool):
    """NxD's model for `cfg`, built on the meta device and filled from moe.model.init's values by
    param_init_fn, as NxD's materialisation does (utils/model_utils.py:220-229)."""
    from moe.backends.neuron.layers import build_model, init_from, random_init

    model = build_model(cfg.model, cfg.moe_opt, cfg.seed, sequence_parallel).to_empty(device="cpu")
    fill = init_from(random_init(cfg.model, cfg.seed), cfg.model)
    for module in model.modules():
        fill(module, torch.device("cpu"))
    return model


def our_state(nxd_state: dict) -> dict:
    """NxD's tensors (NxDCausalLM's names, experts in NXD_LAYOUT) under our names, experts in the stored
    layout, as read_checkpoint turns them: comparable with our model's state_dict."""
    from moe.backends.neuron.nxd_checkpoint import NXD_LAYOUT, our_name
    from moe.model.expert_layout import upgraded_state

    return upgraded_state({our_name(k): v for k, v in nxd_state.items()}, NXD_LAYOUT)


def module_routing(cfg) -> list[str]:
    """The overrides giving another backend the routing `cfg` runs."""
    return [f"moe_opt.{k}={'null' if v is None else v}" for k, v in dataclasses.asdict(cfg.moe_opt).items()]


def batch_of(cfg, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


# -- 1. import next to transformers 5 -----------------------------------------------------------------
class _NoHFTracer:
    """A meta-path finder: `import neuronx_distributed` fails as NxD's pipeline/trace.py:43 does
    next to transformers 5 (`from transformers.utils.fx import HFTracer`)."""

    def find_spec(self, name, path=None, target=None):
        if name == "neuronx_distributed":
            raise ModuleNotFoundError("No module named 'transformers.utils.fx'", name="transformers.utils.fx")
        return None


def test_transformers_5_is_named_not_reported_as_missing_package(monkeypatch):
    from moe.backends.neuron.backend import _import_nxd

    monkeypatch.delitem(sys.modules, "neuronx_distributed", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoHFTracer(), *sys.meta_path])
    with pytest.raises(UserError) as err:
        _import_nxd(compose_cfg(*TRN1).hardware)
    assert "transformers 5" in str(err.value) and "HFTracer" in str(err.value)
    assert "not installed" not in str(err.value)
    assert "constraints-trn1.txt" in err.value.fix


def test_missing_neuron_sdk_says_what_to_install(tmp_path):
    proc = run_entry("train.py", *TRN1, f"hydra.run.dir={tmp_path / 'run'}", timeout=300, here=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs neuronx-distributed and torch-neuronx (SDK 2.28)" in proc.stderr
    assert "constraints-trn1.txt" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.csv").exists()


# -- 2. devices: NxD's accelerator takes 1 or TPU_NUM_DEVICES -------------------------------------------
def test_tpu_num_devices_is_set_from_trainer_devices_before_the_trainer_checks_it(nxd_fakes):
    import lightning as L

    backend = backend_for(
        "parallel=tp8_pp8", "model=mixtral_8x7b", "trainer.devices=32", "trainer.num_nodes=16", "dry_run=true"
    )
    assert {
        os.environ[k] for k in ("TPU_NUM_DEVICES", "TPU_CHIPS_PER_HOST_BOUNDS", "NEURON_RT_NUM_CORES")
    } == {"32"}
    parts = backend.trainer_parts()
    trainer = L.Trainer(
        accelerator=parts.accelerator,
        strategy=parts.strategy,
        plugins=parts.plugins,
        devices=32,
        num_nodes=16,
        logger=False,
        enable_checkpointing=False,
    )
    assert trainer.num_devices == 32
    os.environ.pop("TPU_NUM_DEVICES")  # NxD's default, 8: what the run met before
    with pytest.raises(ValueError, match="can only be 'auto', 1, 8"):
        L.Trainer(
            accelerator=parts.accelerator,
            strategy=backend.trainer_parts().strategy,
            devices=32,
            num_nodes=16,
            logger=False,
            enable_checkpointing=False,
        )


# -- 3. expert parallelism on trn1: NxD's training-time EP, and what it cannot do ------------------------
def test_the_mission_command_plans_ep_8_on_16_nodes_with_mixtral(tmp_path):
    """`python train.py hardware=trn1 parallel=tp8_pp8_ep8 dry_run=true`, exactly: the layout picks
    Mixtral 8x7B (conf/parallel/tp8_pp8_ep8.yaml) and plans 512 NeuronCores with ep 8 inside dp 8."""
    proc = run_entry("train.py", "hardware=trn1", "parallel=tp8_pp8_ep8", "dry_run=true",
                     f"hydra.run.dir={tmp_path / 'run'}", timeout=300, here=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "model=mixtral_8x7b hardware=trn1 parallel=tp8_pp8_ep8" in out
    assert "tp 8 x pp 8 x dp 8 = 512; ep 8 inside dp, expert-dp 1" in out and "16 node(s) of 32" in out
    assert "vs 16.0 GiB per trn1 NeuronCore-v2" in out and "-> fits" in out
    assert not (tmp_path / "run").exists()


def test_the_mission_command_without_neuron_names_the_install_and_writes_nothing(tmp_path):
    proc = run_entry("train.py", "hardware=trn1", "parallel=tp8_pp8_ep8", f"hydra.run.dir={tmp_path / 'run'}",
                     timeout=300, here=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "neuronx-distributed" in proc.stderr and "constraints-trn1.txt" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, field, words", [
    ("moe_opt.capacity_factor=null moe_opt.eval_capacity_factor=null", "moe_opt.capacity_factor",
     "expert_mlps_v2.py:713-716"),  # dropless: the blockwise path has no all-to-all
    ("moe_opt.capacity_factor=4.0 moe_opt.eval_capacity_factor=4.0", "moe_opt.capacity_factor",
     "full capacity"),  # >= E / k: every token through every local expert
    ("parallel.zero_stage=0", "parallel.zero_stage", "_ep_rank_"),  # NxD saves EP rank 0's optimizer only
    ("parallel.tp=4 model.num_kv_heads=4 trainer.devices=16", "parallel.tp", "parallel_state.py:605-606"),
])
def test_what_nxd_expert_parallelism_cannot_train_is_refused_with_its_line(override, field, words):
    cfg = compose_cfg("hardware=trn1", "trainer.devices=4", "parallel.tp=2", "parallel.ep=2",
                      "parallel.zero_stage=1", *override.split())
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.field == field and words in str(err.value) and "Fix:" in str(err.value)


def test_expert_parallelism_validates_with_nxd_routing_and_zero1():
    dims = validated_dims(compose_cfg("hardware=trn1", "trainer.devices=4", "parallel.tp=2", "parallel.ep=2",
                                      "parallel.zero_stage=1"))
    assert (dims.ep, dims.dp, dims.expert_dp) == (2, 2, 1)


def test_bf16_sr_is_refused_for_moe_models_and_auto_picks_mixed():
    """bf16_sr runs NxD's float64 slot arithmetic in bf16 (tests/neuron_real/check_slots.py measures
    7879 of 16384 slots misplaced); auto is mixed with MoE layers, bf16_sr for a dense model."""
    from moe.config.derived import neuron_precision

    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*TRN1, "hardware.neuron_precision=bf16_sr"))
    assert err.value.field == "hardware.neuron_precision" and "expert_mlps_v2.py:285-294" in str(err.value)
    cfg = compose_cfg(*TRN1)
    assert neuron_precision(cfg.hardware, cfg.model) == "mixed"
    dense = compose_cfg(*TRN1, "model.moe_layer_frequency=100", "hardware.neuron_precision=bf16_sr")
    validate(dense)
    cfg = compose_cfg(*TRN1, "model.moe_layer_frequency=100")
    assert neuron_precision(cfg.hardware, cfg.model) == "bf16_sr"
    with pytest.raises(ConfigError) as err:  # mixed's float32 counts exactly up to 2**24 slots
        validate(compose_cfg(*TRN1, "model.num_experts=256", "model.max_position_embeddings=65536",
                             "data.seq_len=65536", "trainer.micro_batch_size=2"))
    assert err.value.field == "trainer.micro_batch_size" and "2**24" in str(err.value)


@pytest.mark.parametrize(
    "override, field",
    [
        ("moe_opt.drop_policy=probs", "moe_opt.drop_policy"),
        ("moe_opt.min_capacity=4", "moe_opt.min_capacity"),
        ("moe_opt.normalize_after_drop=false", "moe_opt.normalize_after_drop"),
        ("moe_opt.eval_capacity_factor=4.0", "moe_opt.eval_capacity_factor"),
        ("moe_opt.jitter_eps=0.01", "moe_opt.jitter_eps"),
        ("parallel.activation_checkpointing=every_n", "parallel.activation_checkpointing"),
        ("model.tie_word_embeddings=true", "model.tie_word_embeddings"),
        ("trainer.devices=1", "trainer.devices"),
        ("moe_opt.enable_expert_bias=true", "moe_opt.enable_expert_bias"),
        ("moe_opt.num_groups=2 moe_opt.group_top_k=1", "moe_opt.num_groups"),
        ("moe_opt.topk_scaling_factor=2.5", "moe_opt.topk_scaling_factor"),
        ("moe_opt.weights_in_activation=true", "moe_opt.weights_in_activation"),
        ("moe_opt.fp8_experts=true", "moe_opt.fp8_experts"),
        ("model=tiny_deepseek_v3 model.shared_expert_intermediate_size=0", "model.attention"),
    ],
)
def test_what_nxd_cannot_train_is_refused_naming_nxds_behaviour(override, field):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("hardware=trn1", *override.split()))
    assert err.value.field == field and "Fix:" in str(err.value)


# the Hugging Face families' pieces NxD's layers carry or our attention computes on each rank's heads
HF_PIECES = ("model.qkv_bias=true", "model.o_bias=true", "model.qk_norm=per_head",
             "model.attention_sinks=true", "model.router_bias=true")


@pytest.mark.parametrize("override, field, nxd_line", [
    ("parallel.tp=2 model.qk_norm=full", "model.qk_norm", "parallel_layers/layers.py:661-670, :763"),
    ("model.expert_proj_bias=true", "model.expert_proj_bias", "moe_parallel_layers.py:312"),
    ("model.expert_activation=clamped_swiglu", "model.expert_activation", "expert_mlps_v2.py:1456-1459"),
    ("model.shared_expert_intermediate_size=64 model.shared_expert_gate=true", "model.shared_expert_gate",
     "modules/moe/model.py:355-359"),
    ("model.shared_expert_intermediate_size=64", "model.shared_expert_intermediate_size",
     "modules/moe/model.py:91"),
])
def test_the_hf_pieces_nxd_cannot_train_are_refused_naming_the_piece_and_nxds_line(override, field, nxd_line):
    """docs/TRAINIUM.md's table: each refused piece's paragraph names its key and the NxD v2.28.0 line that
    lacks it (or computes it otherwise in training)."""
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*TRN1, *override.split()))
    message = str(err.value)
    assert err.value.field == field and field in message and nxd_line in message and "Fix:" in message


@pytest.mark.parametrize("layout", [("parallel.tp=2",), ("parallel.tp=2", "parallel.sequence_parallel=true"),
                                    ("model.qk_norm=full",)])
def test_the_hf_pieces_nxd_expresses_validate_on_trn1(layout):
    """q/k/v and o biases, a per-head QK-norm, sinks and the router's bias train on trn1 at tp 2 with and
    without sequence parallelism (tests/neuron_real tp2_hf_pieces, tp2_sp_hf_pieces); a full-width QK-norm
    at tp 1."""
    validate(compose_cfg(*TRN1, "moe_opt=nxd", *HF_PIECES, *layout))


@pytest.mark.parametrize("qk_norm", ["per_head", "full"])
def test_the_hf_pieces_are_nxds_parameters_under_our_names_and_train_as_litmoe_at_degree_1(nxd, qk_norm):
    """Each piece is built into NxD's model (the biases into its parallel layers and RouterTopK), filled by
    param_init_fn under our names with every backend's values, and with non-zero biases the loss is
    LitMoE's (per_head at tp 2 on NxD's real code: tests/neuron_real; full only at tp 1)."""
    from moe.backends.neuron.nxd_checkpoint import our_name
    from tests.conftest import single_process_module

    overrides = [o if not o.startswith("model.qk_norm=") else f"model.qk_norm={qk_norm}" for o in HF_PIECES]
    module = neuron_module("moe_opt=nxd", *overrides)
    reference = single_process_module(compose_cfg(*module_routing(module.cfg), *overrides))
    theirs = dict(module.model.named_parameters())
    ours = dict(reference.model.named_parameters())
    assert {our_name(k) for k in theirs} == set(ours)
    suffixes = ("qkv_proj.bias", "o_proj.bias", "q_norm.weight", "k_norm.weight", "attn.sinks", "router.bias")
    pieces = {n for n in ours if n.endswith(suffixes)}
    assert all(any(n.endswith(suffix) for n in pieces) for suffix in suffixes)
    g = torch.Generator().manual_seed(3)
    theirs_as_ours = our_state(theirs)
    with torch.no_grad():
        for name, param in theirs.items():
            assert torch.equal(theirs_as_ours[our_name(name)], ours[our_name(name)]), name
            if our_name(name) in pieces:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
                ours[our_name(name)].copy_(param)
    batch = batch_of(module.cfg)
    loss, lm = module.model(batch["input_ids"], batch["labels"])
    ref_loss, ref_lm, _, _ = reference.micro_batch_loss(batch)
    torch.testing.assert_close(lm, ref_lm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)


def test_karakuri_experiment_dry_run_prints_the_aws_layout(tmp_path):
    proc = run_entry(
        "train.py", *MIXTRAL_TRN1, "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", timeout=300, here=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tp 8 x pp 8 x dp 8 = 512; ep 8" in proc.stdout and "16 node(s) of 32" in proc.stdout
    assert "1024 sequences x 4096 tokens" in proc.stdout and "-> fits" in proc.stdout


# -- 4. pipeline tracing with sequence parallelism ------------------------------------------------------
def test_pipeline_keeps_the_sequence_scatter_and_the_loss_as_single_calls(nxd):
    """Traced into, the scatter's body fails at tp > 1 (mappings.py:85 asserts on a traced shape), so
    NxD's recipes auto-wrap the mappings module; the graph must call it, not inline it."""
    from neuronx_distributed.parallel_layers import mappings
    from neuronx_distributed.pipeline.model import NxDPPModel

    from moe.backends.neuron.causal_lm import nxd_lm_loss
    from moe.backends.neuron.layers import build_model

    backend_for()  # NxD's parallel state at tp=1 for the model; the pipeline's arguments at pp=2
    cfg = compose_cfg(*TRN1, "parallel.pp=2", "trainer.accumulate_grad_batches=2")
    pipeline = nxd_kwargs(cfg)["pipeline_config"]
    assert pipeline["autowrap_modules"] == [mappings] and pipeline["autowrap_functions"] == [nxd_lm_loss]

    def called(pp_kwargs) -> set:
        model = build_model(cfg.model, cfg.moe_opt, cfg.seed, sequence_parallel=True)
        traced = NxDPPModel(model, **pp_kwargs).traced
        return {
            getattr(n.target, "__name__", str(n.target))
            for n in traced.graph.nodes
            if n.op == "call_function"
        }

    assert {"scatter_to_sequence_parallel_region", "nxd_lm_loss"} <= called(pipeline)
    assert "scatter_to_sequence_parallel_region" not in called({**pipeline, "autowrap_modules": None})


# -- 5. pipeline: the loss exists on the last stage only ------------------------------------------------
@pytest.mark.slow  # two processes
def test_pipeline_trains_with_loss_on_the_last_stage_only(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_entry(
        "train.py",
        *TRN1,
        "parallel.pp=2",
        "trainer=smoke",
        "trainer.max_steps=4",
        "trainer.accumulate_grad_batches=2",
        "optimizer.warmup_steps=1",
        "trainer.val_check_interval=4",
        "trainer.checkpoint_every_n_steps=4",
        f"hydra.run.dir={run_dir}",
        env=FAKE_ENV,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in _rows(run_dir) if r["loss"]]
    assert [r["step"] for r in rows] == ["1", "4"]
    for row in rows:  # the router terms come from both stages, the LM loss is derived from them
        loss, lm = float(row["loss"]), float(row["lm_loss"])
        assert 0 < lm < loss < 20 and float(row["aux_loss"]) > 0
    assert [float(r["val_loss"]) > 0 for r in _rows(run_dir) if r["val_loss"]] == [True]


def _rows(run_dir: Path) -> list[dict]:
    import csv

    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


# -- 6. metrics are reduced on the device -----------------------------------------------------------------
def test_metrics_go_through_xla_all_reduce_on_the_module_device(nxd, monkeypatch):
    import torch_xla.core.xla_model as xm

    seen = []
    monkeypatch.setattr(
        xm, "all_reduce", lambda kind, t, **kw: seen.append((kind, t.device)) or torch.ones(2)
    )
    backend = backend_for()

    class OnDevice:  # the fake device is the CPU: any other device shows the move
        device = torch.device("meta")

    assert backend.all_reduce(OnDevice(), torch.tensor([2.0, 3.0]), "max").device.type == "cpu"
    assert seen == [(xm.REDUCE_MAX, torch.device("meta"))]


# -- 7. validation with sequence parallelism and MoE ------------------------------------------------------
@pytest.mark.parametrize("moe_opt", ["moe_opt=nxd", "moe_opt.capacity_factor=null"])
def test_moe_layer_eval_runs_with_sequence_parallel_and_dropless(nxd, moe_opt):
    cfg = backend_for(moe_opt, "moe_opt.eval_capacity_factor=${moe_opt.capacity_factor}").cfg
    model = filled_model(cfg, sequence_parallel=True)
    for block in model.model.layers:
        if block.is_moe:
            layer = block.ffn.moe
            assert (
                layer.expert_mlps.sequence_parallel_enabled == layer.router.sequence_parallel_enabled is True
            )
    batch = batch_of(cfg)
    model.eval()
    with torch.no_grad():
        loss, lm = model(batch["input_ids"], batch["labels"])
    assert torch.isfinite(lm)


# -- 8. host memory: the model is built on the meta device, each rank fills its own shard --------------------
def test_mixtral_8x7b_is_built_on_the_meta_device(nxd):
    """NxD builds the model under init_on_device(meta) (trainer.py:162-166) when model_init_config
    asks for it; then no rank holds more than one parameter of the full model at any time."""
    import resource

    from neuronx_distributed.utils.model_utils import init_on_device

    from moe.backends.neuron.layers import build_model

    backend_for()  # NxD's parallel state (tp=1: the whole model, the worst case for one rank)
    cfg = compose_cfg(*MIXTRAL_TRN1)
    init = nxd_kwargs(cfg, param_init_fn=print)["model_init_config"]
    assert init["meta_device_init"] is True and init["param_init_fn"] is print
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with init_on_device(device=torch.device("meta"), force_custom_init_on_device=True):
        model = build_model(cfg.model, cfg.moe_opt, cfg.seed, sequence_parallel=False)
    params = list(model.parameters())
    assert {p.device.type for p in params} == {"meta"}
    assert sum(p.numel() for p in params) == pytest.approx(46.70e9, rel=1e-3)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 2**20
    assert grown_gib < 4  # one expert tensor at most; the model is 174 GiB in fp32


def test_each_parameter_gets_the_values_every_backend_starts_from(nxd):
    """param_init_fn fills NxD's model with moe.model.init's values: the same numbers as LitMoE's."""
    from tests.conftest import single_process_module

    module = neuron_module()
    ours = single_process_module(compose_cfg("trainer.devices=2")).model.state_dict()
    theirs = our_state(module.model.state_dict())
    assert set(theirs) == set(ours)
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name


def test_nxd_experts_get_the_same_values_whatever_layout_we_store(nxd):
    """param_init_fn's source gives experts in our stored layout; NxD's are NXD_LAYOUT. Stored [E, out, in],
    the values must still land in NxD's parameters as they do stored [E, in, out] (no transposed draw)."""
    from moe.backends.neuron.nxd_checkpoint import our_name
    from moe.model.expert_layout import EXPERT_LAYOUT, IN_OUT, OUT_IN, storing

    cfg = backend_for().cfg
    models = {}
    for layout in (IN_OUT, OUT_IN):
        with storing(layout):
            models[layout] = filled_model(cfg, sequence_parallel=False).state_dict()
    assert any(EXPERT_LAYOUT.is_expert_tensor(our_name(k)) for k in models[IN_OUT])
    for name, value in models[IN_OUT].items():
        assert torch.equal(models[OUT_IN][name], value), name


def test_init_from_hf_fills_nxds_model_not_a_twin_that_setup_replaces(nxd, tmp_path):
    """model.init_from_hf on trn1: each rank's param_init_fn reads its shard from DIR's safetensors
    (moe.hf.tensor_source), so the model NxD trains holds DIR's weights; a resumed run does not."""
    from moe.backends.neuron.backend import NeuronBackend
    from moe.hf import from_hf, to_hf
    from moe.model.model import MoETransformer
    from moe.train.run import settled_of

    cfg = compose_cfg(*TRN1)
    to_hf(MoETransformer(cfg.model, compose_cfg("moe_opt=dropless").moe_opt, init_seed=7)).save_pretrained(
        tmp_path
    )
    settled = settled_of(compose_cfg(*TRN1, f"model.init_from_hf={tmp_path}"))
    expected = from_hf(tmp_path).state_dict()
    for resuming, same in ((False, True), (True, False)):
        backend = NeuronBackend(settled.config, settled.dims)
        module = attached(backend, backend.build_module(resuming=resuming))
        got = our_state(module.model.state_dict())
        assert all(torch.equal(got[k], v) for k, v in expected.items()) is same


# -- the objective: the same numbers as the CPU/GPU model ---------------------------------------------
NXD_HEAVY_DROPS = ("moe_opt=nxd", "moe_opt.capacity_factor=0.5", "moe_opt.eval_capacity_factor=0.5")


@pytest.mark.parametrize(
    "moe_opt",
    [
        ("moe_opt=nxd",),
        NXD_HEAVY_DROPS,
        ("moe_opt.capacity_factor=null", "moe_opt.eval_capacity_factor=null"),
    ],
)
def test_loss_matches_litmoe_at_degree_1(nxd, moe_opt):
    """Dropless, NxD's capacity, and a capacity that drops a quarter of the assignments (where NxD's
    renormalisation over the kept experts, moe_opt.normalize_after_drop, decides the numbers)."""
    from moe.backends.neuron.causal_lm import pop_routing
    from tests.conftest import single_process_module

    module = neuron_module(*moe_opt)
    reference = single_process_module(compose_cfg(*module_routing(module.cfg)))
    batch = batch_of(module.cfg)
    loss, lm = module.model(batch["input_ids"], batch["labels"])
    ref_loss, ref_lm, ref_routing, _ = reference.micro_batch_loss(batch)
    torch.testing.assert_close(lm, ref_lm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    routing = pop_routing(module.model.modules())
    assert len(routing) == len(ref_routing)
    if moe_opt == NXD_HEAVY_DROPS:
        assert min(float(r.dropped_fraction) for r in routing) > 0.1
    for got, want in zip(routing, ref_routing, strict=True):
        assert torch.equal(got.tokens_per_expert_E, want.tokens_per_expert_E)
        torch.testing.assert_close(got.dropped_fraction, want.dropped_fraction)
        torch.testing.assert_close(got.aux_loss, want.aux_loss)


def test_validation_of_one_sequence_keeps_the_capacity(nxd):
    """Without sequence parallelism activations are [B, S, H]: NxD's MoE must be told the sequence is dim 1,
    or a validation micro-batch of one sequence has "sequence length" 1, which NxD's eval runs as token
    generation, with no capacity (modules/moe/model.py:196, expert_mlps_v2.py:1469); make test-neuron
    measured it in NxD's real code as a validation loss 5e-5 off one process's."""
    from tests.conftest import single_process_module

    module = neuron_module(*NXD_HEAVY_DROPS)
    reference = single_process_module(compose_cfg(*module_routing(module.cfg)))
    one = {k: v[:1] for k, v in batch_of(module.cfg).items()}
    module.model.eval()
    reference.eval()
    with torch.no_grad():
        lm = module.model(one["input_ids"], one["labels"])[1]
        want = reference.micro_batch_loss(one)[1]
        reference.model.layers[0].ffn.eval_capacity_factor = None  # what token generation would compute
        dropless = reference.micro_batch_loss(one)[1]
    torch.testing.assert_close(lm, want, rtol=1e-5, atol=1e-5)
    assert abs(float(want - dropless)) > 1e-4


# -- what had silently changed on trn1 ----------------------------------------------------------------------
def test_neuron_lit_moe_has_every_member_the_step_drives(nxd):
    from tests.test_train_step import step_module_members

    assert step_module_members() <= set(dir(neuron_module()))


def test_a_skip_the_spike_guard_asked_for_leaves_the_weights_and_the_next_step_updates(nxd):
    """The backend's skip_update leaves the step's optimizer step out (NxD's optimizers have none that updates
    nothing); the precision plugin, which knows no skip, still runs it, and the next step updates."""
    from moe.backends.neuron.strategy import NeuronPrecision

    module = neuron_module()
    optimizer = module.configure_optimizers()[0][0]
    module.trainer.strategy.optimizers = [optimizer]
    batch = batch_of(module.cfg)

    def held() -> list[torch.Tensor]:  # the weights, Adam's moments and step counts
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return [t.detach().clone() for t in [*module.model.parameters(), *state]]

    def step(skip: bool) -> bool:
        before = held()
        optimizer.zero_grad()
        module.model(batch["input_ids"], batch["labels"])[0].backward()
        if skip:
            module.backend.skip_update(module)
        NeuronPrecision().optimizer_step(optimizer, module, closure=lambda: None)
        after = held()
        return len(before) != len(after) or any(not torch.equal(b, a)
                                                for b, a in zip(before, after, strict=True))

    assert [step(skip) for skip in (False, True, False)] == [True, False, True]
    assert "step" not in vars(optimizer)  # the class's step again


@pytest.mark.parametrize("zero", ["parallel.zero_stage=0", "parallel.zero_stage=1"])
def test_grad_clip_is_applied_with_and_without_zero1(nxd, zero):
    """With ZeRO-1 torch-xla's optimizer clips at its own max_norm (default 1.0, NxD's max_grad_norm
    ignored: trainer/trainer.py:243-301); the configured grad_clip reaches it either way."""
    module = neuron_module(zero, "optimizer.grad_clip=0.25")
    optimizer = module.configure_optimizers()[0][0]
    for p in module.model.parameters():
        p.grad = torch.full_like(p, 3.0)
    optimizer.step()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.model.parameters()]))
    assert norm.item() == pytest.approx(0.25, rel=1e-4)
    assert float(optimizer.grad_norm) > 100  # the norm before clipping, as NxD reports it


def test_sigmoid_scores_reach_nxds_router_and_our_routing_statistics(nxd):
    """moe_opt.score_function=sigmoid is NxD's RouterTopK act_fn (routing.py:19, :116-126); the balance
    statistics read the sigmoid scores normalised over the experts, as on the torch backends."""
    module = neuron_module("moe_opt.score_function=sigmoid")
    layers = [m for m in module.model.modules() if type(m).__name__ == "NxDMoELayer"]
    assert layers and {m.moe.router.act_fn for m in layers} == {"sigmoid"}
    layer = layers[0]
    layer.train()
    x = torch.randn(2, 8, layer.moe.router.hidden_size)
    _, stats = layer(x)
    logits = layer.moe.router.linear_router(x.reshape(-1, x.shape[-1]))
    scores = torch.sigmoid(logits.double())
    probs = scores / scores.sum(-1, keepdim=True)
    entropy = -(probs * probs.log()).sum(-1).mean()
    assert float(stats.entropy) == pytest.approx(float(entropy), rel=1e-4)


def test_dropless_is_nxds_capacity_factor_0_not_none(nxd):
    """NxD's capacity_factor None runs every token through every expert (expert_mlps_v2.py:1451-1465);
    its dropless path is 0.0, which ours (null) must become."""
    module = neuron_module("moe_opt.capacity_factor=null", "moe_opt.eval_capacity_factor=null")
    layers = [m.moe.expert_mlps for m in module.model.modules() if type(m).__name__ == "NxDMoELayer"]
    assert layers and {m.capacity_factor for m in layers} == {0.0}


@pytest.mark.parametrize(
    "policy, classes",
    [
        ("selective", {"CoreAttention", "NxDMoELayer"}),
        ("moe_only", {"NxDMoELayer"}),
        ("full", {"StageBlock"}),
    ],
)
def test_activation_checkpointing_wraps_nxds_classes(nxd, policy, classes):
    """selective is NxD's Mixtral selection, core attention + MoE (run_mixtral_pretrain_ptl.py:182)."""
    module = neuron_module(f"parallel.activation_checkpointing={policy}")
    wrapped = {
        type(m._checkpoint_wrapped_module).__name__
        for m in module.model.modules()
        if hasattr(m, "_checkpoint_wrapped_module")
    }
    assert wrapped == classes


@pytest.mark.parametrize(
    "preset, xla_env, master",
    [
        ("bf16_sr", ("1", "0", "1"), False),  # the Llama 2 trn1 recipe (dense models)
        ("mixed", ("0", "1", "0"), True),
        ("fp32", ("0", "0", "0"), False),
    ],
)
def test_precision_presets_set_xla_env_and_master_weights(nxd_fakes, preset, xla_env, master):
    from moe.backends.neuron.env import neuron_env

    dense = ["model.moe_layer_frequency=100"] if preset == "bf16_sr" else []  # bf16_sr is refused with MoE
    cfg = compose_cfg(*TRN1, f"hardware.neuron_precision={preset}", "parallel.zero_stage=1", *dense)
    env = neuron_env(cfg.hardware, cfg.model, cfg.trainer)
    assert (env["XLA_USE_BF16"], env["XLA_DOWNCAST_BF16"], env["NEURON_RT_STOCHASTIC_ROUNDING_EN"]) == xla_env
    mixed = nxd_kwargs(cfg)["mixed_precision_config"]
    assert mixed["use_master_weights"] is master and mixed["use_fp32_grad_acc"] is master
    assert mixed["use_master_weights_in_ckpt"] is master  # a resumed run keeps its fp32 master weights


def test_moe_compiler_flags_follow_nxds_mixtral_recipe(nxd_fakes, monkeypatch):
    """MoE drops --distribution-strategy=llm-training and adds --enable-saturate-infinity
    (run_mixtral_pretrain_ptl.sh:31-33); a dense model keeps the flags; the shell's are kept, once."""
    from moe.backends.neuron.env import cc_flags

    monkeypatch.setenv("NEURON_CC_FLAGS", "--verbose=35 --model-type=transformer")
    cfg = compose_cfg(*TRN1)
    moe_flags = cc_flags(cfg.hardware, cfg.model).split()
    assert (
        "--distribution-strategy=llm-training" not in moe_flags and "--enable-saturate-infinity" in moe_flags
    )
    assert moe_flags.count("--model-type=transformer") == 1 and "--verbose=35" in moe_flags
    dense = compose_cfg(*TRN1, "model.moe_layer_frequency=100")  # no layer is MoE
    assert "--distribution-strategy=llm-training" in cc_flags(dense.hardware, dense.model).split()


# -- a run on the fakes: two processes, NxD's checkpoints, resume --------------------------------------------
TRAIN_6 = (
    *TRN1,
    "trainer=smoke",
    "trainer.max_steps=6",
    "optimizer.warmup_steps=2",
    "trainer.val_check_interval=3",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.log_every_n_steps=1",
)


@pytest.fixture(scope="module")
def trn1_run(tmp_path_factory) -> Path:
    """Six steps on two processes (checkpoints at 3 and 6), once for the tests below."""
    run_dir = tmp_path_factory.mktemp("trn1") / "run"
    proc = run_entry("train.py", *TRAIN_6, f"hydra.run.dir={run_dir}", env=FAKE_ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


@pytest.mark.slow
def test_two_process_run_writes_nxd_checkpoints_and_resumes_to_the_same_numbers(trn1_run, tmp_path):
    """The module trains through Lightning's Trainer with NxD's strategy (device count, reduce, no DDP
    wrapper), saves with nxd.save_checkpoint, and a run restarted from step 3 ends where the straight
    run ends: weights, optimizer state, schedule and data position all come back."""
    import shutil

    from moe.backends.neuron.nxd_checkpoint import is_complete, model_shard

    tags = sorted(p.name for p in (trn1_run / "checkpoints").iterdir())
    assert tags == ["step-000003.ckpt", "step-000006.ckpt"]
    for tag in tags:
        ckpt = trn1_run / "checkpoints" / tag
        assert is_complete(ckpt) and model_shard(ckpt, 0, 0).is_file()
        assert torch.load(ckpt / "user_content.pt", weights_only=False)["global_step"] == int(tag[5:11])

    resumed = tmp_path / "resumed"
    shutil.copytree(
        trn1_run / "checkpoints" / "step-000003.ckpt", resumed / "checkpoints" / "step-000003.ckpt"
    )
    proc = run_entry("train.py", *TRAIN_6, f"hydra.run.dir={resumed}", env=FAKE_ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    straight = {r["step"]: r for r in _rows(trn1_run) if r["loss"]}
    again = {r["step"]: r for r in _rows(resumed) if r["loss"]}
    assert min(again, key=int) == "4"
    for step in ("4", "5", "6"):
        assert (
            again[step]["loss"] == straight[step]["loss"]
            and again[step]["grad_norm"] == straight[step]["grad_norm"]
        )


@pytest.mark.slow  # the two-process run above
def test_trn1_checkpoints_generate_convert_and_export(trn1_run, tmp_path):
    """infer.py reads the run's newest NxD checkpoint; convert_nxd writes the same weights as one
    portable .ckpt; export_hf from it gives a Mixtral directory holding those weights."""
    from moe.backends.neuron.nxd_checkpoint import read_checkpoint
    from moe.checkpoint.picker import verify_checkpoint
    from moe.hf import from_hf
    from moe.infer.load import model_from_checkpoint, resolve_checkpoint  # infer's: the formats registered

    newest = trn1_run / "checkpoints" / "step-000006.ckpt"
    assert resolve_checkpoint(str(trn1_run), "runs") == newest
    proc = run_entry(
        "infer.py", f"ckpt={trn1_run}", "prompt=Once upon a time", "max_new_tokens=4", timeout=300
    )
    assert proc.returncode == 0 and "tokens/s" in proc.stdout, proc.stderr[-2000:]

    portable = tmp_path / "trn1.ckpt"
    proc = subprocess_module("moe.tools.convert_nxd", str(trn1_run), str(portable))
    assert proc.returncode == 0 and "(step 6)" in proc.stdout, proc.stderr[-2000:]
    assert verify_checkpoint(portable, deep=True) == 6  # written by the portable format, with its sidecar
    model, _ = model_from_checkpoint(portable)
    shards = read_checkpoint(newest)["state_dict"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, shards["model." + name]), name

    out = tmp_path / "hf"
    proc = run_entry("infer.py", f"ckpt={portable}", f"export_hf={out}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = from_hf(out).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(exported[name], value), name

    bad = subprocess_module("moe.tools.convert_nxd", str(tmp_path), str(tmp_path / "x.ckpt"))
    assert bad.returncode == 2 and "holds no complete checkpoint directory" in bad.stderr
    assert not (tmp_path / "x.ckpt").exists()


def subprocess_module(module: str, *args: str):
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


# -- shards: how each parameter sits on a tensor-parallel rank (pure arithmetic, no NxD) -----------
def create_local_weight(
    full: torch.Tensor, partition_dim: int, per_partition_size: int, stride: int, rank: int, world_size: int
) -> torch.Tensor:
    """neuronx-distributed v2.28.0 parallel_layers/layers.py:88-107, with the rank and size passed in."""
    pieces = torch.split(full, per_partition_size // stride, dim=partition_dim)
    return torch.cat(pieces[rank::world_size], dim=partition_dim)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_shards_are_nxds_local_weights_and_join_back(tp):
    from moe.backends.neuron.nxd_checkpoint import NXD_LAYOUT, full_tensor, local_shard, split_of
    from moe.model.expert_layout import EXPERT_LAYOUT, stored
    from moe.model.model import MoETransformer

    cfg = compose_cfg("model=tiny_dense_every2", "model.num_heads=8", "model.num_kv_heads=8", *HF_PIECES)
    state = MoETransformer(cfg.model, cfg.moe_opt, init_seed=0).state_dict()
    checked_with_nxd = set()
    for name, ours in state.items():
        # splits are of NxD's tensors: the experts in its layout, as the trn1 initialisation turns ours
        full = stored().convert(ours, NXD_LAYOUT) if EXPERT_LAYOUT.is_expert_tensor(name) else ours
        split = split_of(name, cfg.model)
        shards = [local_shard(full, split, rank, tp) for rank in range(tp)]
        assert torch.equal(full_tensor(shards, split), full), name
        if split.dim is not None and len(set(split.groups)) <= 1:  # equal groups: NxD's stride
            stride = len(split.groups) or 1
            per_partition = full.shape[split.dim] // tp
            for rank, shard in enumerate(shards):
                assert torch.equal(
                    shard, create_local_weight(full, split.dim, per_partition, stride, rank, tp)
                ), name
            checked_with_nxd.add(name)
    for suffix in (
        "embed_tokens.weight",
        "lm_head.weight",
        "o_proj.weight",
        "ffn.gate_up_proj.weight",
        "ffn.down_proj.weight",
        "experts.gate_up",
        "experts.down",
        "qkv_proj.weight",
        "qkv_proj.bias",
        "attn.sinks",
    ):
        assert any(n.endswith(suffix) for n in checked_with_nxd), suffix


def test_gqa_qkv_shard_holds_each_ranks_own_heads():
    """q and kv differ in size under GQA: rank r holds [its q heads | its k heads | its v heads]."""
    from moe.backends.neuron.nxd_checkpoint import local_shard, split_of

    cfg = compose_cfg()  # tiny: 4 query heads, 2 KV heads of 32
    q, kv = 4 * 32, 2 * 32
    rows = torch.arange(q + 2 * kv).unsqueeze(1).float()
    shard = local_shard(rows, split_of("layers.0.attn.qkv_proj.weight", cfg.model), rank=1, tp=2).flatten()
    assert shard.tolist() == [*range(64, 128), *range(q + 32, q + 64), *range(q + kv + 32, q + 2 * kv)]


def test_nxd_moe_layer_implements_the_feed_forward_contract(nxd_fakes):
    """trn1 swaps the whole MoE layer (NxD fuses dispatch, experts and combine): it meets the layer's
    contract, as moe.model.moe.MoELayer does."""
    from test_moe_layer import same_contract

    from moe.backends.neuron.nxd_moe_layer import NxDMoELayer
    from moe.model.moe import MoEFeedForward

    same_contract(NxDMoELayer, MoEFeedForward)
