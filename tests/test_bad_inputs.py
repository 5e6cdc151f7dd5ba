"""Bad-input matrix: configs, data, checkpoints and the command line.

Every case must end with exit code 2 (a config or input error, which the supervisor never
retries; Hydra's composition errors too), one message naming the field, the value and the fix, no traceback,
and no partial output: no metrics.csv, summary.json or checkpoints/ in the run dir (an
existing run dir is left byte for byte as it was; data_prep.py leaves no output dir).

Most cases run train.py's code path in-process (compose the config as Hydra does, call the
entry point wrapped in `exit_on_user_error`) so the matrix stays fast; the command-line cases
and one end-to-end case per entry point run the real scripts in a subprocess.
"""
import contextlib
import io
import shutil

import pytest
from conftest import REPO, run_entry
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import moe.config  # noqa: F401  (registers the typed schema)
from moe.errors import exit_on_user_error
from moe.train.checkpoint import AtomicCheckpointIO
from moe.train.run import train

OUTPUTS = ("metrics.csv", "summary.json", "checkpoints")


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=["run_name=bad", *overrides])


def run_train(run_dir, *overrides):
    """train.py's main in-process: (exit code, stderr)."""
    cfg = compose_train(*overrides)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            exit_on_user_error(train)(cfg, run_dir)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_user_error(code, err, field, value, fix):
    """Exit 2, a single `error: field=value ... Fix: ...` paragraph, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    message = lines[0]
    assert message.startswith(f"error: {field}={value}"), message
    assert "Fix: " in message and fix in message.split("Fix: ", 1)[1], message


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two tiny data_prep outputs: `sample` (bundled tokenizer, vocab 512), `other` (a 300-token BPE)."""
    from moe.data import prepare

    root = tmp_path_factory.mktemp("prepared")
    text = root / "corpus.txt"
    text.write_text("".join(f"the {i} quick brown fox jumps over the lazy dog {i}.\n" for i in range(300)))
    common = {"input": str(text), "seq_len": 32, "val_fraction": 0.1}
    sample = prepare({**common, "output": str(root / "sample"), "tokenizer": str(REPO / "data" / "sample")},
                     progress=False)
    other = prepare({**common, "output": str(root / "other"), "vocab_size": 300}, progress=False)
    return {"sample": sample, "other": other}


# ------------------------------------------------------------------------------------------ configs
CONFIG_CASES = [
    # overrides, field, value as printed, a phrase of the fix
    (["parallel.ep=3"], "parallel.ep", "3", "use an ep that divides model.num_experts=8"),
    (["parallel.dp=4"], "parallel.dp", "4", "set parallel.dp=null"),  # world size mismatch
    (["trainer.devices=3"], "trainer.devices", "3", "raise trainer.num_nodes"),
    (["optimizer.lr=-0.001"], "optimizer.lr", "-0.001", "use a positive learning rate"),
    (["data.seq_len=1024"], "data.seq_len", "1024", "raise model.max_position_embeddings"),
    (["trainer.max_steps=0"], "trainer.max_steps", "0", "positive number"),
    (["optimizer.warmup_steps=-5"], "optimizer.warmup_steps", "-5", "positive step count"),
    (["parallel.zero_stage=2"], "parallel.zero_stage", "2", "hardware=cpu_deepspeed"),
    (["trainer.global_batch_size=10"], "trainer.global_batch_size", "10", "global_batch_size=null"),
    (["model.top_k=9"], "model.top_k", "9", "1 <= top_k <= model.num_experts=8"),
    (["model.num_kv_heads=3"], "model.num_kv_heads", "3", "divisor of model.num_heads=4"),
    (["moe_opt.capacity_factor=-1"], "moe_opt.capacity_factor", "-1", "null for dropless routing"),
    (["hardware.strategy=tpu"], "hardware.strategy", "'tpu'", "use one of ddp, deepspeed, neuron"),
    (["trainer.spike_action=explode"], "trainer.spike_action", "'explode'", "use one of warn, skip"),
    (["trainer.spike_factor=0.5"], "trainer.spike_factor", "0.5", "0 to turn detection off"),
]


@pytest.mark.parametrize("overrides, field, value, fix", CONFIG_CASES, ids=[c[0][0] for c in CONFIG_CASES])
def test_bad_config(tmp_path, overrides, field, value, fix):
    run_dir = tmp_path / "run"
    code, err = run_train(run_dir, *overrides)
    assert_user_error(code, err, field, value, fix)
    assert not run_dir.exists()  # nothing written: the check runs before anything is built


# ------------------------------------------------------------------------------------------ data
def test_missing_prepared_data_path(tmp_path):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={tmp_path / 'nowhere'}")
    assert_user_error(code, err, "data.path", repr(str(tmp_path / "nowhere")), "python data_prep.py")
    assert not (tmp_path / "run").exists()


def test_prepared_data_without_a_path(tmp_path):
    code, err = run_train(tmp_path / "run", "data=prepared")
    assert_user_error(code, err, "data.path", "None", "pass data.path=DIR")
    assert not (tmp_path / "run").exists()


def test_missing_raw_data_file(tmp_path):
    code, err = run_train(tmp_path / "run", f"data.path={tmp_path / 'missing.txt'}")
    assert_user_error(code, err, "data.path", repr(str(tmp_path / "missing.txt")), "check the path")
    assert not (tmp_path / "run").exists()


def test_online_data_without_a_tokenizer(tmp_path):
    code, err = run_train(tmp_path / "run", "data.tokenizer=null")
    assert_user_error(code, err, "data.tokenizer", "None", "pass data.tokenizer=DIR")
    assert not (tmp_path / "run").exists()


def test_prepared_data_from_another_tokenizer(tmp_path, prepared):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={prepared['sample']}",
                          f"data.tokenizer={prepared['other'] / 'tokenizer'}")
    assert_user_error(code, err, "data.tokenizer", repr(str(prepared["other"] / "tokenizer")),
                      "re-run data_prep.py with this tokenizer")
    assert "different vocabulary" in err
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


def test_prepared_vocab_larger_than_the_model(tmp_path, prepared):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={prepared['sample']}",
                          "model.vocab_size=256")
    assert_user_error(code, err, "model.vocab_size", "256", "set model.vocab_size=512")
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


def test_prepared_seq_len_above_max_positions(tmp_path, prepared):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={prepared['sample']}",
                          "model.max_position_embeddings=16")
    assert code == 2 and "Traceback" not in err
    assert "32" in err and "max_position_embeddings" in err and "Fix: " in err  # meta.json's seq_len is 32
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


def test_prepared_dir_whose_tokenizer_changed_after_prep(tmp_path, prepared):
    data = tmp_path / "data"
    shutil.copytree(prepared["sample"], data)
    tok = data / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text() + "\n")
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={data}")
    assert_user_error(code, err, "data.path", repr(str(data)), "re-run data_prep.py")
    assert "sha256 differs from meta.json" in err
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


# ------------------------------------------------------------------------------------------ checkpoints
def existing_run(tmp_path, hidden_size=128):
    """A run dir as a crashed run leaves it: metrics.csv and one checkpoint of a model config."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.csv").write_text("step,loss\n1,6.0\n")
    cfg = compose_train(f"model.hidden_size={hidden_size}")
    hparams = {"cfg": OmegaConf.to_container(cfg, resolve=True)}
    AtomicCheckpointIO().save_checkpoint({"global_step": 5, "state_dict": {}, "hyper_parameters": hparams},
                                         run_dir / "checkpoints" / "last.ckpt")
    return run_dir


def test_truncated_checkpoint_with_no_good_one_to_fall_back_to(tmp_path):
    run_dir = existing_run(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:200])
    before = snapshot(run_dir)
    code, err = run_train(run_dir)
    assert_user_error(code, err, "resume", "True", "set resume=false, or use another run_name")
    assert "found no loadable checkpoint" in err and "last.ckpt is 200 bytes" in err and "(truncated)" in err
    assert snapshot(run_dir) == before


def test_garbage_checkpoint_file(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-000010.ckpt").write_text("not a checkpoint")
    before = snapshot(run_dir)
    code, err = run_train(run_dir)
    assert_user_error(code, err, "resume", "True", "resume=false")
    assert "step-000010.ckpt cannot be read" in err
    assert snapshot(run_dir) == before


def test_resume_with_a_changed_model_shape(tmp_path):
    run_dir = existing_run(tmp_path, hidden_size=64)
    before = snapshot(run_dir)
    code, err = run_train(run_dir)  # hidden_size back to the preset's 128
    assert_user_error(code, err, "model.hidden_size", "128", "resume=false")
    assert "model.hidden_size=64" in err and "another run_name" in err
    assert snapshot(run_dir) == before


# ------------------------------------------------------------------------------------------ command line
def run_cli(tmp_path, script, *overrides):
    run_dir = tmp_path / "run"
    proc = run_entry(script, f"hydra.run.dir={run_dir}", *overrides, timeout=300)
    return proc, run_dir


@pytest.mark.parametrize("override, needles", [
    ("model=tinyy", ["Could not find 'model/tinyy'", "Available options", "tiny_switch"]),  # unknown preset
    ("trainer.max_step=5", ["trainer.max_step", "Key 'max_step' not in 'TrainerConfig'"]),  # unknown key
    ("+trainer.max_step=5", ["trainer.max_step=5 is not a key of the config schema", "max_steps"]),  # with +
    ("+moe_opt.capacity=2", ["moe_opt.capacity=2 is not a key", "capacity_factor"]),
    ("trainer.max_steps=abc", ["trainer.max_steps", "'abc'", "could not be converted to Integer"]),  # type
    ("resume=maybe", ["resume", "'maybe'", "is not a valid bool"]),  # wrong type for a flag
    ("moe_opt.aux_loss_coeff=nan", ["moe_opt.aux_loss_coeff=nan is not a finite number"]),  # skipped all
    ("moe_opt.capacity_factor=inf", ["moe_opt.capacity_factor=inf is not a finite number"]),  # crashed
    ("optimizer.lr=-inf", ["optimizer.lr=-inf is not a finite number"]),
    ("parallel.ep=3", ["parallel.ep=3 does not divide num_experts=8"]),  # a rule of validate
])
def test_bad_command_line_exits_2_before_the_run_dir_exists(tmp_path, override, needles):
    proc, run_dir = run_cli(tmp_path, "train.py", override)
    assert proc.returncode == 2, proc.stderr  # never retried by the supervisor
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error: ")]) == 1, proc.stderr
    assert "Fix: " in proc.stderr and "To append to your config use +" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert not run_dir.exists()  # no .hydra/, no train.log: nothing half-written


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    proc, run_dir = run_cli(tmp_path, "train.py", "dry_run=true")
    assert proc.returncode == 0 and "memory per device" in proc.stdout, proc.stderr
    assert not run_dir.exists()


def test_train_py_user_error_end_to_end(tmp_path):
    proc, run_dir = run_cli(tmp_path, "train.py", "parallel.ep=3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: parallel.ep=3 does not divide num_experts=8. Fix: " in proc.stderr
    assert not run_dir.exists()


def test_data_prep_bad_input_leaves_no_output(tmp_path):
    out = tmp_path / "prepared"
    proc = run_entry("data_prep.py", f"input={tmp_path / 'missing.txt'}", f"output={out}",
                     f"tokenizer={REPO / 'data' / 'sample'}", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: input='{tmp_path / 'missing.txt'}'" in proc.stderr and "Fix: " in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".prepared.tmp-*"))

