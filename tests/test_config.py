"""The config tree composes for every preset, and each cross-field rule fails with its named error."""
from __future__ import annotations

import copy
import functools
import re

import pytest
import yaml
from conftest import REPO, compose_cfg, run_entry, validated_dims
from omegaconf import OmegaConf

import moe.config  # noqa: F401  (registers train_schema)
from moe.config.validate import validate
from moe.errors import ConfigError
from moe.tools.plan import make_plan

CONF = REPO / "conf"
needs_data = pytest.mark.skipif(
    not (CONF / "data" / "sample.yaml").exists(),
    reason="conf/data/sample.yaml (the default data preset, owned by the data group) does not exist yet",
)
pytestmark = needs_data

# trainer overrides that give each parallel preset the world it needs on each hardware
WORLD = {"single": 1, "dp2": 2, "ep2": 2, "dp2_ep8": 16, "tp8_pp8": 512, "tp8_pp8_ep8": 512, "tp8_sp": 8,
         "dp2_zero1": 2, "ep2_zero2": 2, "fsdp2": 1, "fsdp2_dp2": 2, "fsdp2_tp2": 2, "fsdp2_ep2": 2,
         "fsdp2_hsdp": 4}
DEVICES_PER_NODE = {"cpu": 2, "cpu_deepspeed": 2, "gpu": 8, "trn1": 32, "cpu_fsdp2": 2, "gpu_fsdp2": 8,
                    "trn2": 64}


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@functools.cache
def _composed(choices: tuple[str, ...]):
    return compose_cfg(*choices)


def make_cfg(*overrides: str):
    """Compose once per set of group choices (slow), then apply `key.sub=value` overrides to a copy."""
    choices = tuple(o for o in overrides if "." not in o.split("=")[0])
    cfg = copy.deepcopy(_composed(choices))
    for o in overrides:
        key, value = o.split("=", 1)
        if "." in key:
            OmegaConf.update(cfg, key, yaml.safe_load(value), merge=False)
    return cfg


def launch(hardware: str, parallel: str) -> list[str]:
    world, per_node = WORLD[parallel], DEVICES_PER_NODE[hardware]
    return [f"trainer.devices={min(world, per_node)}", f"trainer.num_nodes={max(1, world // per_node)}"]


def test_default_matches_schema_defaults():
    """The default presets spell out the dataclass defaults (tiny model, tuned AdamW, trainer)."""
    cfg = make_cfg()
    for group, schema in [("model", moe.config.ModelConfig), ("optimizer", moe.config.OptimizerConfig),
                          ("trainer", moe.config.TrainerConfig), ("moe_opt", moe.config.MoEOptConfig),
                          ("parallel", moe.config.ParallelConfig), ("hardware", moe.config.HardwareConfig)]:
        defaults = OmegaConf.to_container(OmegaConf.structured(schema))
        assert OmegaConf.to_container(cfg[group]) == defaults, group
    validate(cfg)


@pytest.mark.parametrize("group", [
    "model", "moe_opt", "optimizer", "trainer", "logger", "callbacks", "hardware"])
def test_every_group_preset_composes_and_validates(group):
    for name in presets(group):
        # the seed optimizers warm up for 100-2000 steps: give them a run long enough for that
        cfg = make_cfg(f"{group}={name}", *(["trainer.max_steps=5000"] if group == "optimizer" else []))
        if "name" in cfg[group]:
            assert cfg[group].name == name, f"{group}/{name}.yaml must set name: {name}"
        validate(cfg)


# (hardware, parallel) -> the field whose rule refuses it, or None when valid
MATRIX_ERRORS = {
    ("cpu", "dp2_ep8"): "parallel.zero_stage",  # plain DDP has no ZeRO
    ("cpu", "tp8_pp8_ep8"): "parallel.tp",  # DDP has no tensor/pipeline parallelism
    ("cpu", "tp8_pp8"): "parallel.tp",
    ("cpu", "tp8_sp"): "parallel.tp",
    ("cpu", "dp2_zero1"): "parallel.zero_stage",
    ("cpu", "ep2_zero2"): "parallel.zero_stage",
    ("trn1", "ep2_zero2"): "parallel.zero_stage",  # NxD shards optimizer states only (ZeRO-1)
    ("trn1", "ep2"): "parallel.zero_stage",  # NxD's expert parallelism resumes with its ZeRO-1 only
    ("trn1", "single"): "trainer.devices",  # NxD's XLA strategy needs 2 or more devices
    # DeepSpeed here gives data and expert parallelism only: a tp/pp it would ignore is refused
    ("cpu_deepspeed", "tp8_pp8_ep8"): "parallel.tp",
    ("cpu_deepspeed", "tp8_pp8"): "parallel.tp",
    ("cpu_deepspeed", "tp8_sp"): "parallel.tp",
    ("gpu", "tp8_pp8_ep8"): "parallel.tp",
    ("gpu", "tp8_pp8"): "parallel.tp",
    ("gpu", "tp8_sp"): "parallel.tp",
}
# the fsdp2 presets elsewhere: ZeRO-3 (FSDP2) is theirs alone, so is HSDP; TP only where it exists
for _hardware in ("cpu", "cpu_deepspeed", "gpu", "trn1"):
    MATRIX_ERRORS.update({(_hardware, p): "parallel.zero_stage" for p in ("fsdp2", "fsdp2_dp2", "fsdp2_ep2")})
    MATRIX_ERRORS[(_hardware, "fsdp2_hsdp")] = "parallel.hybrid_shard_degree"
    MATRIX_ERRORS[(_hardware, "fsdp2_tp2")] = "parallel.zero_stage" if _hardware == "trn1" else "parallel.tp"
# the other presets on the fsdp2 backend: FSDP2 shards weights (ZeRO 0/1 refused once dp > 1; the NxD
# pipeline presets' ZeRO-1 too: fsdp2 pipelines, FSDP2-sharded) (tp8_sp, sequence parallelism over TP 8,
# trains there)
for _hardware in ("cpu_fsdp2", "gpu_fsdp2", "trn2"):
    MATRIX_ERRORS.update({(_hardware, p): "parallel.zero_stage"
                          for p in ("dp2", "ep2", "dp2_zero1", "dp2_ep8", "tp8_pp8", "tp8_pp8_ep8")})


@pytest.mark.parametrize("hardware", ["cpu", "cpu_deepspeed", "gpu", "trn1",
                                      "cpu_fsdp2", "gpu_fsdp2", "trn2"])
def test_hardware_x_parallel(hardware):
    for parallel in presets("parallel"):
        cfg = make_cfg(f"hardware={hardware}", f"parallel={parallel}", "model=mixtral_8x7b",
                       *launch(hardware, parallel))
        expected = MATRIX_ERRORS.get((hardware, parallel))
        if expected is None:
            dims = validated_dims(cfg)
            assert make_plan(cfg, dims).dims is dims
            assert dims.world == WORLD[parallel] == dims.tp * dims.pp * dims.dp
        else:
            with pytest.raises(ConfigError) as err:
                validate(cfg)
            assert err.value.field == expected, (hardware, parallel, str(err.value))


@pytest.mark.parametrize("experiment", ["karakuri_8x7b_trn1", "moe64_top2_gpu_dp2_ep8",
                                        "mixtral_8x7b_gpu_dp2_ep8", "mixtral_8x7b_gpu_fsdp2",
                                        "mixtral_8x22b_gpu_fsdp2", "mixtral_8x7b_trn2",
                                        "deepseek_v3_gpu_fsdp2", "switch_1t_gpu_fsdp2",
                                        "glm4_5_air_gpu_fsdp2"])
def test_experiments_validate_at_their_own_world(experiment):
    cfg = make_cfg(f"experiment={experiment}")
    validate(cfg)  # no dry run: trainer.devices x num_nodes is the experiment's real cluster
    assert cfg.run_name == experiment


def test_the_16_gpu_recipes_former_name_runs_it_under_its_old_run_name():
    """experiment=mixtral_8x7b_gpu_dp2_ep8 named seed 004's 64-expert recipe, which is not Mixtral 8x7B; the
    name still composes that recipe, keeping its run name so runs made under it resume."""
    old, new = make_cfg("experiment=mixtral_8x7b_gpu_dp2_ep8"), make_cfg("experiment=moe64_top2_gpu_dp2_ep8")
    assert old.run_name == "mixtral_8x7b_gpu_dp2_ep8"
    old.run_name = new.run_name
    assert old == new
    assert (new.model.num_experts, new.model.moe_layer_frequency) == (64, 2)
    mixtral = make_cfg("experiment=mixtral_8x7b_gpu_fsdp2").model
    assert (mixtral.num_experts, mixtral.moe_layer_frequency, mixtral.intermediate_size) == (8, 1, 14336)


def test_karakuri_experiment_values():
    cfg = make_cfg("experiment=karakuri_8x7b_trn1")
    assert (cfg.model.name, cfg.model.position_encoding, cfg.hardware.name, cfg.parallel.name) == (
        "mixtral_8x7b", "alibi", "trn1", "tp8_pp8_ep8")
    assert (cfg.parallel.ep, cfg.moe_opt.name, cfg.moe_opt.capacity_factor) == (8, "nxd", 2.0)
    assert (cfg.hardware.neuron_precision, cfg.parallel.zero_stage) == ("auto", 1)  # auto: mixed for MoE
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.data.seq_len) == (6e-5, 6e-6, 4096)
    assert cfg.trainer.devices * cfg.trainer.num_nodes == 512
    assert cfg.trainer.global_batch_size == 1024


def test_dry_run_plans_the_layout_without_devices():
    """A dry run of a 512-core layout validates on one node's devices (trn1's default, 32)."""
    overrides = ["hardware=trn1", "parallel=tp8_pp8", "model=mixtral_8x7b"]
    with pytest.raises(ConfigError) as err:
        validate(make_cfg(*overrides))
    assert err.value.field == "parallel.tp" and "trainer.devices=32 trainer.num_nodes=2" in str(err.value)
    validate(make_cfg(*overrides, "dry_run=true"))


def test_unknown_key_and_wrong_type_fail_at_compose():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="model.hiden_size"):
        compose_cfg("model.hiden_size=64")
    with pytest.raises(ConfigCompositionException, match="model.num_layers"):
        compose_cfg("model.num_layers=four")


@pytest.mark.parametrize("key", ["moe_opt.aux_loss_coeff", "moe_opt.capacity_factor", "optimizer.lr",
                                 "trainer.spike_factor", "model.rope_theta", "data.val_fraction"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_numbers_are_refused(key, value):
    with pytest.raises(ConfigError) as err:
        validate(make_cfg(f"{key}={value}"))
    assert err.value.field == key and str(err.value.value) == value
    assert "not a finite number" in str(err.value)


@pytest.mark.parametrize("overrides,field", [
    (("model.qk_norm=rms",), "model.qk_norm"),
    (("model.dense_layers=[0, 9]",), "model.dense_layers"),
    (("model.dense_layers=[1, 1]",), "model.dense_layers"),
    (("model.shared_expert_gate=true",), "model.shared_expert_gate"),  # no shared expert to gate
    (("model=tiny_deepseek_v3", "model.qkv_bias=true"), "model.qkv_bias"),  # GQA only
    (("hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "trainer.devices=2", "model.qk_norm=full"),
     "model.qk_norm"),
    (("hardware=trn1", "dry_run=true", "model.expert_proj_bias=true"), "model.expert_proj_bias"),
])
def test_the_hf_family_keys_refuse_what_cannot_be_built(overrides, field):
    """model.qk_norm, dense_layers, shared_expert_gate, qkv_bias: a value that cannot be built, a full-width
    QK-norm split by tensor parallelism, or trn1 (where NxD lacks the piece): refused naming the key."""
    with pytest.raises(ConfigError) as err:
        validate(make_cfg(*overrides))
    assert err.value.field == field


def test_the_hf_family_keys_are_valid_where_they_are_built():
    validate(make_cfg("model.qk_norm=per_head", "model.qkv_bias=true", "model.dense_layers=[0]",
                      "model.shared_expert_intermediate_size=64", "model.shared_expert_gate=true"))
    validate(make_cfg("hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "trainer.devices=2",
                      "model.qk_norm=per_head", "model.qkv_bias=true"))


def test_dropless_and_switch_routing_are_valid():
    validate(make_cfg("moe_opt=dropless"))
    validate(make_cfg("model=tiny_switch", "moe_opt=switch"))


# ------------------------------------------------------------------- the real entry point


@pytest.mark.skipif(not (REPO / "train.py").exists(), reason="train.py (the training entry point) is missing")
class TestEntryPoint:
    def test_cfg_job_prints_composed_config(self):
        proc = run_entry("train.py", "--cfg", "job", "experiment=karakuri_8x7b_trn1", check=True, here=True)
        cfg = OmegaConf.create(proc.stdout)
        assert (cfg.model.name, cfg.hardware.name, cfg.parallel.tp, cfg.trainer.num_nodes) == (
            "mixtral_8x7b", "trn1", 8, 16)
        proc = run_entry("train.py", "--cfg", "job", "model=tiny_switch", "moe_opt=switch", check=True,
                         here=True)
        cfg = OmegaConf.create(proc.stdout)
        assert (cfg.model.top_k, cfg.moe_opt.drop_policy, cfg.moe_opt.jitter_eps) == (1, "position", 0.01)

    def test_dry_run_prints_layout_and_exits_0(self):
        proc = run_entry("train.py", "hardware=trn1", "parallel=tp8_pp8", "model=mixtral_8x7b",
                         "dry_run=true", check=True, here=True)
        out = proc.stdout
        assert "64 x trn1 NeuronCore-v2 = 2 node(s) of 32" in out  # the smallest world for tp 8 x pp 8
        assert "46.70B total, 12.88B active" in out
        assert "tp 8 x pp 8 x dp 1 = 64" in out
        assert "trainer.devices=32 trainer.num_nodes=2" in out

    def test_invalid_config_exits_2_with_the_fix(self):
        proc = run_entry("train.py", "parallel=dp2", here=True)
        assert proc.returncode == 2
        assert "parallel.dp=2" in proc.stderr and "trainer.devices=2" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_config_is_settled_once_per_process(monkeypatch, tmp_path):
    """train.py's preflight settles the config it composes; the task's train() gets the same config from
    Hydra again and reuses that: the environment checks, init_from_hf and validation run once."""
    import moe.train.run as run
    from moe.train.preflight import compose_config, preflight

    settled = []
    validate = run.validate
    monkeypatch.setattr(run, "validate", lambda cfg: settled.append(cfg) or validate(cfg))
    monkeypatch.setattr(run, "_SETTLED", {})
    overrides = [f"hydra.run.dir={tmp_path / 'run'}", "parallel=ep2", "trainer.devices=2"]
    first = preflight(overrides, str(CONF))
    again, _ = compose_config(overrides, str(CONF), "train")  # what Hydra hands the task
    assert run.settle(again) is first and len(settled) == 1 and first.notes == ()
    assert first.config.parallel.ep == 2 and not (tmp_path / "run").exists()


def test_every_rule_names_what_validate_can_give_it():
    """validate passes each rule what its parameters name: a section or top-level key of the config, `cfg`
    (the whole, for the rules that walk every key), or a value derived from the config; a parameter named
    otherwise would fail only when its rule first runs."""
    import dataclasses
    import inspect

    from moe.config.rules.backends import BACKEND_RULES
    from moe.config.schema import TrainConfig
    from moe.config.validate import RULES

    givable = {f.name for f in dataclasses.fields(TrainConfig)} | {"cfg", "planning", "world", "dp", "spec"}
    rules = [r for r in RULES if r is not BACKEND_RULES] + list(BACKEND_RULES.values())
    unknown = {f"{rule.__name__}({name})" for rule in rules for name in inspect.signature(rule).parameters
               if name not in givable}
    assert not unknown, unknown


def test_settle_derives_into_a_copy_and_leaves_the_composed_config_as_it_is(monkeypatch, tmp_path):
    """What model.init_from_hf's directory (its architecture) and data=prepared (its seq_len) fix comes back
    as values merged into a copy: the settled config holds them, frozen; the config as composed is
    unchanged, so Hydra's and the preflight's copies stay what the user wrote."""
    import dataclasses

    import moe.train.run as run
    from moe.data import prepare
    from moe.hf import to_hf
    from moe.model import MoETransformer

    monkeypatch.setattr(run, "_SETTLED", {})
    hf_dir = tmp_path / "mix"
    dir_cfg = compose_cfg("model.num_layers=2", "model.hidden_size=64", "moe_opt=dropless")
    to_hf(MoETransformer(dir_cfg.model, dir_cfg.moe_opt, init_seed=1)).save_pretrained(hf_dir)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"the {i} quick brown fox jumps over the lazy dog {i}.\n" for i in range(300)))
    data_dir = prepare({"input": str(text), "seq_len": 32, "val_fraction": 0.1,
                        "output": str(tmp_path / "prep"), "tokenizer": str(REPO / "data" / "sample")},
                       progress=False)
    cases = {
        "init_from_hf": ([f"model.init_from_hf={hf_dir}", "moe_opt=dropless"],
                         lambda c: (c.model.num_layers, c.model.hidden_size), (2, 64)),
        "prepared": (["data=prepared", f"data.path={data_dir}"], lambda c: c.data.seq_len, 32),
    }
    for name, (overrides, derived, settled_value) in cases.items():
        composed = compose_cfg(*overrides)
        before, composed_value = OmegaConf.to_yaml(composed), derived(composed)
        settled = run.settle(composed)
        assert derived(settled.config) == settled_value != composed_value, name
        assert OmegaConf.to_yaml(composed) == before, name
        with pytest.raises(dataclasses.FrozenInstanceError):
            settled.config.data.seq_len = 8


def test_the_default_run_name_is_the_experiments_on_every_task_and_launch(monkeypatch):
    """The name is a function of the experiment the command composes, never of the time: every rank, node
    and relaunch agrees on it; a SLURM batch job's name and id come first (a new submission is a new run,
    a requeue finds its own), an interactive shell names runs as outside SLURM."""
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)

    def name(*overrides):
        return compose_cfg(*overrides).run_name

    default = name()
    assert re.fullmatch(r"tiny-[0-9a-f]{8}", default) and name() == default
    # how and how long it runs: the same experiment, the same run
    for free in ("trainer.max_steps=7", "trainer.devices=2", "parallel=dp2", "hardware=cpu_fsdp2",
                 "trainer.micro_batch_size=4", "logger=tensorboard", "model.compile=true"):
        assert name(free) == default, free
    # what it trains: another experiment, another run
    others = {name(o) for o in ("optimizer.lr=1e-3", "seed=7", "moe_opt.capacity_factor=2.0",
                                "model=tiny_switch", "data.seq_len=64")}
    assert len(others) == 5 and default not in others
    assert name("optimizer.lr=1e-3") == name("optimizer.lr=0.001")  # values, not spellings
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "moe gpu")
    digest = default.split("-")[-1]
    assert name() == f"moe_gpu-4242-{digest}"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert name() == f"moe_gpu-4240_2-{digest}"
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")
    assert name() == default


@pytest.mark.parametrize("script, doc", [("train_gpu.sbatch", "CLUSTERS.md"),
                                         ("train_trn1.sbatch", "TRAINIUM.md")])
def test_the_docs_show_the_sbatch_scripts_make_test_slurm_runs(script, doc):
    assert (REPO / "slurm" / script).read_text() in (REPO / "docs" / doc).read_text()


def test_the_settled_config_is_frozen_and_changes_only_as_a_new_object():
    """settled_config: the schema's dataclasses, read-only; `replaced` makes a changed frozen copy; a
    checkpoint's plain dict reads back equal, a key a newer version dropped left out, a choice outside its
    type refused."""
    import dataclasses

    from moe.config.schema import TrainerConfig
    from moe.config.settled import as_container, replaced, settled_config

    cfg = settled_config(compose_cfg("trainer.max_steps=7"))
    assert isinstance(cfg.trainer, TrainerConfig) and cfg.trainer.max_steps == 7
    with pytest.raises(dataclasses.FrozenInstanceError, match="max_steps.*settled.replaced"):
        cfg.trainer.max_steps = 8
    longer = replaced(cfg.trainer, max_steps=9)
    assert (longer.max_steps, cfg.trainer.max_steps) == (9, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        longer.max_steps = 10
    saved = as_container(cfg)
    saved["trainer"]["a_dropped_key"] = 1
    assert settled_config(saved) == cfg
    saved["moe_opt"]["score_function"] = "tanh"  # a choice is a Literal type: a value outside it is refused
    with pytest.raises(ConfigError) as err:
        settled_config(saved)
    assert (err.value.field, err.value.value, err.value.fix) == ("moe_opt.score_function", "tanh",
                                                                  "use one of softmax, sigmoid")
