"""A relaunch resumes exactly or refuses (moe.config.contract, moe.train.launches): the data goes on at the
next row whatever the batch geometry; a changed fixed key or tokenizer is refused with every key named and the
run dir unchanged, however the config is chosen (Hydra's own flags too); a finished run trains nothing and
changes nothing; an allowed change is recorded, and summary.json states a value only where every kept step
trained with it."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import FAST_RUN, REPO, restored_process_state, run_entry, trained_rows
from test_bad_inputs import snapshot

import moe.config  # noqa: F401  (registers the typed schema)
from moe.config.contract import KINDS, contract_table, flat, kind_of, schema_defaults
from moe.config.schema import TrainConfig
from moe.train.launches import LAUNCHES, read_launches

SHORT = ("trainer.max_steps=2", "trainer.limit_val_batches=0", "optimizer.warmup_steps=1", "seed=11")


def train_in_process(run_dir, *overrides):
    from moe.train.preflight import compose_config
    from moe.train.run import train

    with restored_process_state():
        overrides = [f"hydra.run.dir={run_dir}", *FAST_RUN, *overrides]
        cfg, _ = compose_config(overrides, str(REPO / "conf"), "train")
        return train(cfg, run_dir)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run trained to its max_steps, and a copy to relaunch into (each test gets it as it was)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train_in_process(run_dir, *SHORT)
    return run_dir


@pytest.fixture
def run(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy, symlinks=True)
    return copy


def relaunch(run_dir, *overrides, flags=()):
    proc = run_entry("train.py", *flags, f"hydra.run.dir={run_dir}", *FAST_RUN, *SHORT, *overrides, here=True)
    return proc.returncode, proc.stderr


def test_a_changed_batch_geometry_goes_on_at_the_next_row(tmp_path):
    """4 steps of 8 rows, relaunched to 6 as 2 micro-batches of 4: steps 5 and 6 train the uninterrupted
    run's rows (its LM losses to 1e-5; the rows of steps 3 and 4 again, as the position once kept in steps x
    accumulation gave, would differ by far more)."""
    common = ("moe_opt=dropless", "moe_opt.aux_loss_coeff=0", "moe_opt.z_loss_coeff=0",
              "optimizer.decay_steps=6", "optimizer.warmup_steps=1", "trainer.limit_val_batches=0",
              "trainer.checkpoint_every_n_steps=4")
    straight = train_in_process(tmp_path / "straight", *common, "trainer.max_steps=6",
                                "trainer.micro_batch_size=8")
    resumed = tmp_path / "resumed"
    train_in_process(resumed, *common, "trainer.max_steps=4", "trainer.micro_batch_size=8")
    train_in_process(resumed, *common, "trainer.max_steps=6", "trainer.micro_batch_size=4",
                     "trainer.accumulate_grad_batches=2")
    expected = [float(r["lm_loss"]) for r in trained_rows(straight)]
    got = [float(r["lm_loss"]) for r in trained_rows(resumed)]
    assert len(got) == len(expected) == 6
    assert got == pytest.approx(expected, rel=1e-5, abs=0)
    geometry = [launch["changed"] for launch in read_launches(resumed)]
    assert geometry[1]["trainer.micro_batch_size"] == [8, 4]


def test_a_finished_run_relaunched_trains_nothing_and_changes_nothing(run):
    before = snapshot(run)
    code, err = relaunch(run)
    assert code == 0 and "Traceback" not in err, err
    assert f"note: {run} already trained to step 2" in err and "nothing to train, nothing changed" in err
    assert snapshot(run) == before


@pytest.mark.parametrize("how", ["overrides", "--config-dir", "--config-name"])
def test_a_refused_relaunch_names_every_fixed_key_and_changes_nothing(run, tmp_path, how):
    """Hydra's own flags that choose the config get the same pre-flight: no .hydra/ rewritten, no train.log
    appended, no summary.json or tokenizer copy replaced."""
    changed, flags = ["seed=12", "data.seq_len=64", "model.num_layers=2"], []
    if how == "--config-dir":
        (tmp_path / "extra" / "model").mkdir(parents=True)
        preset = (REPO / "conf" / "model" / "tiny.yaml").read_text().replace("num_layers: 4", "num_layers: 2")
        (tmp_path / "extra" / "model" / "two_layers.yaml").write_text(preset)
        changed = ["model=two_layers", "seed=12", "data.seq_len=64"]
        flags = ["--config-dir", str(tmp_path / "extra")]
    elif how == "--config-name":
        primary = (REPO / "conf" / "train.yaml").read_text()
        primary = primary.replace("model: tiny", "model: tiny_dense_every2")
        (REPO / "conf" / "_relaunch_test.yaml").write_text(primary)
        changed, flags = ["seed=12", "data.seq_len=64"], ["--config-name", "_relaunch_test"]
    before = snapshot(run)
    try:
        code, err = relaunch(run, *changed, flags=flags)
    finally:
        (REPO / "conf" / "_relaunch_test.yaml").unlink(missing_ok=True)
    assert code == 2 and "Traceback" not in err, err
    first = err.splitlines()[0]
    assert first.startswith("error: ") and "differs from the run being resumed" in first, err
    for key in ("data.seq_len", "seed"):
        assert key in first
    assert "model.num_layers" in first if how != "--config-name" else "model.moe_layer_frequency" in first
    assert "Fix: relaunch with the run's values, or start another run" in first
    assert snapshot(run) == before


def test_a_changed_tokenizer_is_refused_even_under_the_same_path(tmp_path):
    """The same data.tokenizer directory holding other bytes: the run's steps were trained on other ids."""
    from moe.data.tokenizer import EOS, PAD, train_bpe

    tok_dir = tmp_path / "tok"
    shutil.copytree(REPO / "data" / "sample", tok_dir, ignore=shutil.ignore_patterns("*.txt", "*.jsonl"))
    run_dir = tmp_path / "run"
    train_in_process(run_dir, *SHORT, f"data.tokenizer={tok_dir}")
    other = train_bpe([(REPO / "data" / "sample" / "train.txt").read_text()[:20000]], vocab_size=300,
                      special_tokens=[EOS, PAD], show_progress=False)
    other.save(str(tok_dir / "tokenizer.json"))
    before = snapshot(run_dir)
    code, err = relaunch(run_dir, f"data.tokenizer={tok_dir}", "trainer.max_steps=4")
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: data.tokenizer (its tokenizer.json)=") and "the tokenizer's sha256" in err
    assert snapshot(run_dir) == before  # the run's own tokenizer/ copy included


def test_an_allowed_change_is_recorded_and_the_summary_states_only_what_every_step_trained_with(run):
    code, err = relaunch(run, "trainer.max_steps=4", "optimizer.lr=1e-3")
    assert code == 0, err
    launches = read_launches(run)
    assert [launch["from_step"] for launch in launches] == [0, 2]
    assert launches[1]["changed"] == {"optimizer.lr": [0.003, 0.001], "trainer.max_steps": [2, 4]}
    assert flat(launches[1]["config"])["optimizer.lr"] == 0.001
    summary = json.loads((run / "summary.json").read_text())
    assert "optimizer.lr" not in summary["config"] and summary["config"]["model.name"] == "tiny"
    assert summary["config_by_steps"]["optimizer.lr"] == [{"steps": [1, 2], "value": 0.003},
                                                          {"steps": [3, 4], "value": 0.001}]


def test_a_relaunch_after_a_crash_replaces_the_records_of_the_steps_it_did_not_keep(run):
    """A launch that went past its checkpoint and crashed: the relaunch resumes from that checkpoint, so
    the records say its config trained the steps after it, not the crashed launch's."""
    from moe.config.settled import settled_config
    from moe.train.launches import record_launch

    config = read_launches(run)[0]["config"]
    data = settled_config(config).data
    record_launch(run, config, data, 2, {"optimizer.lr": [0.003, 0.5]}, {"optimizer.lr": 0.5}, world=1)
    record_launch(run, config, data, 2, {}, {"optimizer.lr": 0.003}, world=1)
    assert [(launch["from_step"], launch["changed"]) for launch in read_launches(run)] == [(0, {}), (2, {})]
    (run / LAUNCHES).write_text("{not json")
    code, err = relaunch(run, "trainer.max_steps=3")
    assert code == 2
    assert f"error: hydra.run.dir='{run}' cannot be read: {run / LAUNCHES} is not valid JSON" in err


def test_every_key_has_a_kind_and_the_doc_shows_the_contract():
    kinds = {key: kind_of(key) for key in schema_defaults(TrainConfig)}
    assert {kinds["model.hidden_size"], kinds["data.path"], kinds["seed"]} == {"fixed"}
    assert kinds["optimizer.lr"] == kinds["moe_opt.capacity_factor"] == "steered"
    assert kinds["trainer.max_steps"] == kinds["parallel.ep"] == kinds["model.compile"] == "free"
    assert set(KINDS) >= {key.split(".")[0] for key in kinds}
    doc = (REPO / "docs" / "FAULT_TOLERANCE.md").read_text()
    assert contract_table(schema_defaults(TrainConfig)) in doc, \
        "docs/FAULT_TOLERANCE.md is stale: paste python tests/test_relaunch.py"


def table_rows() -> list[tuple[str, str, int, str]]:
    """This module's refusals as rows of docs/FAULT_TOLERANCE.md's "Around a run" table (tests/
    test_around_the_run.py makes it): case, command, exit status, the first line asserted."""
    refused = ("error: {key}={now} differs from the run being resumed ({run}, which trained to step {step} "
               "with ...); so do ... Fix: relaunch with the run's values, or start another run ...")
    return [
        ("a relaunch that changes fixed keys names every one and changes nothing",
         "train.py hydra.run.dir=RUN seed=12 data.seq_len=64 model.num_layers=2", 2, refused),
        ("the same through --config-dir", "train.py --config-dir DIR hydra.run.dir=RUN model=two_layers ...",
         2, refused),
        ("the same through --config-name", "train.py --config-name NAME hydra.run.dir=RUN ...", 2, refused),
        ("a changed tokenizer under the same path is refused",
         "train.py hydra.run.dir=RUN data.tokenizer=DIR", 2,
         "error: data.tokenizer (its tokenizer.json)='{now}' differs ... the tokenizer's sha256 ..."),
        ("a finished run relaunched trains nothing and changes nothing", "train.py hydra.run.dir=RUN", 0,
         "note: {run} already trained to step 2 ... nothing to train, nothing changed ..."),
        ("a damaged launches.json is named", "train.py hydra.run.dir=RUN trainer.max_steps=3", 2,
         "error: hydra.run.dir='{run}' cannot be read: {run}/launches.json is not valid JSON ..."),
    ]


if __name__ == "__main__":
    print(contract_table(schema_defaults(TrainConfig)), end="")
