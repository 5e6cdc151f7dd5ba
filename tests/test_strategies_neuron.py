"""Neuron plugin wiring, checked with import stand-ins (tests/standins/, named as such).

The stand-ins record what `moe.strategies.neuron.build_neuron` hands to neuronx-distributed:
the nxd_config arguments, the strategy / checkpoint IO / precision plugin arguments and the
environment NxD saw when it was imported. The real missing-package error is checked against
this machine, which has no neuronx-distributed.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import moe.config  # noqa: F401  (registers the typed schemas with Hydra)
from moe.backends.neuron.strategy import NEURON_PRECISION, neuron_env, nxd_config_kwargs
from moe.errors import ConfigError, UserError
from tests.conftest import run_entry

REPO = Path(__file__).resolve().parents[1]
STANDINS = Path(__file__).parent / "standins"
NEURON_KEYS = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "NEURON_RT_STOCHASTIC_ROUNDING_EN", "NEURON_CC_FLAGS",
               "NEURON_FUSE_SOFTMAX", "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS", "NEURON_RT_EXEC_TIMEOUT")
SEED_FLAGS = "--model-type=transformer --distribution-strategy=llm-training"


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def degrees(nxd: dict) -> tuple[int, int, int]:
    return nxd["tensor_parallel_size"], nxd["pipeline_parallel_size"], nxd["expert_parallel_size"]


def _forget_neuron_modules():
    """Drop the stand-ins and the model module built on them, so nothing leaks into other tests."""
    import moe.backends.neuron

    for name in list(sys.modules):
        if name.split(".")[0] in ("neuronx_distributed", "torch_xla") or name == "moe.backends.neuron.module":
            del sys.modules[name]
    moe.backends.neuron.__dict__.pop("module", None)


@pytest.fixture
def standin_nxd(monkeypatch):
    """Put the stand-ins on sys.path for this test only; returns a function that builds the bundle."""
    for key in NEURON_KEYS:
        monkeypatch.delenv(key, raising=False)
    _forget_neuron_modules()
    monkeypatch.syspath_prepend(str(STANDINS))

    def build(cfg):
        from moe.backends.neuron.strategy import build_neuron

        bundle = build_neuron(cfg)
        nxd = importlib.import_module("neuronx_distributed")
        assert nxd.STANDIN  # never the real package
        return bundle, nxd.RECORD, nxd.ENV_AT_IMPORT

    yield build
    _forget_neuron_modules()


def test_tp8_pp8_ep8_nxd_config_env_and_precision(standin_nxd):
    cfg = compose_cfg("hardware=trn1", "parallel=tp8_pp8_ep8", "model=mixtral_8x7b", "trainer.devices=32",
                      "trainer.num_nodes=16", "trainer.accumulate_grad_batches=16")
    bundle, record, env_at_import = standin_nxd(cfg)
    from moe.backends.neuron import module as neuron_model

    nxd = record["neuronx_distributed_config"]
    assert degrees(nxd) == (8, 8, 8)
    assert nxd["sequence_parallel"] is True
    assert nxd["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0}
    assert nxd["activation_checkpoint_config"] == [neuron_model.NxDMoE]  # moe_only, as seed 000's check_fn
    assert nxd["mixed_precision_config"] == {  # bf16 + stochastic rounding: no fp32 master weights
        "use_master_weights": False, "use_fp32_grad_acc": False, "use_master_weights_in_ckpt": False}
    pipe = nxd["pipeline_config"]
    assert pipe["transformer_layer_cls"] is neuron_model.NxDBlock
    assert pipe["num_microbatches"] == 16 and pipe["input_names"] == ["input_ids", "labels"]
    assert pipe["use_zero1_optimizer"] is True and pipe["leaf_module_cls"] == ["RMSNorm"]

    strategy = record["NeuronXLAStrategy"]
    assert strategy["nxd_config"]["tensor_parallel_size"] == 8 and strategy["save_load_xser"] is True
    assert (strategy["tensor_parallel_size"], strategy["pipeline_parallel_size"],
            strategy["expert_parallel_size"]) == (8, 8, 8)
    assert record["NeuronCheckpointIO"] == {"save_load_xser": True}
    assert record["NeuronXLAPrecisionPlugin"] == {"mixed_precision_enabled": False}
    parts = bundle[0]
    assert parts.precision is None and parts.accelerator == "auto"  # the plugin and strategy decide
    assert parts.overrides == {"accumulate_grad_batches": 1, "gradient_clip_val": None}

    # the environment was in place before NxD (and torch_xla) were imported
    assert env_at_import["XLA_USE_BF16"] == "1" and env_at_import["XLA_DOWNCAST_BF16"] == "0"
    assert env_at_import["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert env_at_import["NEURON_CC_FLAGS"] == f"{SEED_FLAGS} --enable-mixed-precision-accumulation"
    assert env_at_import["NEURON_FUSE_SOFTMAX"] == "1"
    assert env_at_import["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "3"
    assert env_at_import["NEURON_RT_EXEC_TIMEOUT"] == "600"
    assert {k: bundle[2][k] for k in NEURON_KEYS} == {k: env_at_import[k] for k in NEURON_KEYS}


def test_tp8_sp_nxd_config(standin_nxd):
    cfg = compose_cfg("hardware=trn1", "parallel=tp8_sp", "trainer.devices=32", "trainer.num_nodes=4")
    _, record, _ = standin_nxd(cfg)
    from moe.backends.neuron import module as neuron_model

    nxd = record["neuronx_distributed_config"]
    assert degrees(nxd) == (8, 1, 1)
    assert nxd["sequence_parallel"] is True and nxd["pipeline_config"] is None
    assert nxd["optimizer_config"]["zero_one_enabled"] is True
    assert nxd["activation_checkpoint_config"] == [neuron_model.NxDSwiGLU, neuron_model.NxDMoE]  # selective


def test_seed000_experiment(standin_nxd):
    cfg = compose_cfg("experiment=karakuri_8x7b_trn1")
    bundle, record, env_at_import = standin_nxd(cfg)
    from moe.backends.neuron import module as neuron_module

    nxd = record["neuronx_distributed_config"]
    assert degrees(nxd) == (8, 8, 8)
    assert nxd["sequence_parallel"] is True
    assert nxd["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0}
    assert nxd["pipeline_config"]["num_microbatches"] == 128  # global batch 1024 = 1 x 128 x dp 8
    assert env_at_import["XLA_USE_BF16"] == "1" and env_at_import["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert env_at_import["NEURON_CC_FLAGS"].startswith(SEED_FLAGS)
    module = neuron_module.NeuronLitMoE(cfg, bundle[1])  # the NeuronLTModule subclass, same nxd_config
    assert record["NeuronLTModule"]["nxd_config"] is record["NeuronXLAStrategy"]["nxd_config"]
    assert record["NeuronLTModule"]["manual_opt"] is True
    assert record["NeuronLTModule"]["grad_accum_steps"] == 128 and module.pp == 8
    assert sum(p.numel() for p in module.model.parameters()) > 46e9  # Mixtral 8x7B on the meta device


@pytest.mark.parametrize("preset, use_bf16, downcast, sr, flag, master", [
    ("bf16_sr", "1", "0", "1", "--enable-mixed-precision-accumulation", False),
    ("mixed", "0", "1", "0", "--enable-mixed-precision-accumulation", True),
    ("fp32", "0", "0", "0", "--auto-cast none", False),
])
def test_precision_presets(monkeypatch, preset, use_bf16, downcast, sr, flag, master):
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    cfg = compose_cfg("hardware=trn1", "parallel=tp8_sp", f"hardware.neuron_precision={preset}")
    env = neuron_env(cfg)
    assert (env["XLA_USE_BF16"], env["XLA_DOWNCAST_BF16"], env["NEURON_RT_STOCHASTIC_ROUNDING_EN"]) == (
        use_bf16, downcast, sr)
    assert env["NEURON_CC_FLAGS"] == f"{SEED_FLAGS} {flag}"
    assert nxd_config_kwargs(cfg)["mixed_precision_config"]["use_master_weights"] is master
    assert set(NEURON_PRECISION) == {"bf16_sr", "mixed", "fp32"}


def test_cc_flags_merge_without_duplicates(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer --verbose=35")
    cfg = compose_cfg("hardware=trn1", "+hardware.env.NEURON_CC_FLAGS='--cache_dir=/tmp/cc'")
    assert neuron_env(cfg)["NEURON_CC_FLAGS"] == (
        f"{SEED_FLAGS} --enable-mixed-precision-accumulation --cache_dir=/tmp/cc --verbose=35")


def test_refused_settings_name_the_field():
    with pytest.raises(ConfigError, match="parallel.activation_checkpointing='every_n'"):
        nxd_config_kwargs(compose_cfg("hardware=trn1", "parallel.activation_checkpointing=every_n"))
    with pytest.raises(ConfigError, match="hardware.neuron_precision='bf16'"):
        neuron_env(compose_cfg("hardware=trn1", "hardware.neuron_precision=bf16"))


def test_missing_package_is_a_user_error_in_process(monkeypatch):
    _forget_neuron_modules()
    monkeypatch.setitem(sys.modules, "neuronx_distributed", None)  # import fails as on this machine
    from moe.backends.neuron.strategy import build_neuron

    with pytest.raises(UserError, match="neuronx-distributed") as err:
        build_neuron(compose_cfg("hardware=trn1"))
    assert "pip install torch-neuronx neuronx-distributed" in err.value.fix


def test_train_py_trn1_exits_at_once_with_install_hint_and_dry_run_works(tmp_path):
    assert importlib.util.find_spec("neuronx_distributed") is None  # this machine has no Neuron SDK
    proc = run_entry("train.py", "hardware=trn1", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs neuronx-distributed and torch-neuronx" in proc.stderr
    assert "pip install torch-neuronx neuronx-distributed" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.csv").exists()
    dry = run_entry("train.py", "hardware=trn1", "parallel=tp8_pp8_ep8", "model=mixtral_8x7b", "dry_run=true",
                    f"hydra.run.dir={tmp_path / 'dry'}", timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
