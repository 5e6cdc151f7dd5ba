"""The loss-spike and NaN guard on injected spikes: warn, skip, rollback (also across a crash), non-finite.

Runs `moe.train.run.train` in-process on a tiny model; the spike is injected by scaling the loss of
chosen optimizer steps (a real spike: the loss and every gradient of that step are 50x).
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, compose_cfg, trained_rows

from moe.config.rules.training import check_guard
from moe.errors import ConfigError
from moe.module.lit_moe import LitMoE
from moe.train.guard import LEDGER
from moe.train.run import train

TINY = ["model.hidden_size=32", "model.intermediate_size=32", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.num_experts=4", "trainer.micro_batch_size=2",
        "optimizer.warmup_steps=1", "trainer.val_check_interval=100", "trainer.limit_val_batches=1",
        "trainer.progress_bar=false", "trainer.log_every_n_steps=1", "trainer.spike_window=3",
        "trainer.spike_factor=3.0", "seed=3"]


def config(*overrides):
    return compose_cfg(*TINY, "run_name=guard", *overrides)


class Injector:
    """Patches LitMoE.micro_batch_loss: loss x factor on chosen steps; records parameters at each step's
    forward.

    `crash_on_replay=N`: raise once when step N comes round again after a later step (after a rollback).
    """

    def __init__(self, monkeypatch, steps: dict[int, float], crash_on_replay: int | None = None):
        self.steps, self.crash_on_replay, self.params = steps, crash_on_replay, {}
        original = LitMoE.micro_batch_loss
        injector = self

        def micro_batch_loss(module, batch):
            loss, lm_loss, routing, mtp_loss = original(module, batch)
            step = module.trainer.global_step + 1
            if step == injector.crash_on_replay and max(injector.params, default=0) > step:
                injector.crash_on_replay = None
                raise RuntimeError("injected crash")
            injector.params[step] = torch.cat([p.detach().flatten() for p in module.model.parameters()])
            return loss * injector.steps.get(step, 1.0), lm_loss, routing, mtp_loss

        monkeypatch.setattr(LitMoE, "micro_batch_loss", micro_batch_loss)

    def updated(self, step: int) -> bool:
        """Did the update of `step` change the parameters (seen at the next step's forward)?"""
        return not torch.equal(self.params[step], self.params[step + 1])


rows = trained_rows


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_warn_counts_and_logs_the_spike_but_trains_on_it(tmp_path, monkeypatch, capsys):
    inject = Injector(monkeypatch, {7: 50.0})
    train(config("trainer.max_steps=8", "trainer.spike_action=warn"), tmp_path)
    assert "spike guard: step 7: loss" in capsys.readouterr().err
    assert inject.updated(7)
    table = rows(tmp_path)
    assert [int(r["spikes"]) for r in table] == [0] * 6 + [1, 1]
    assert all(r["skipped_steps"] == "0" for r in table)
    assert float(table[6]["loss"]) > 3 * float(table[5]["loss"])  # the injected spike is in metrics.csv
    assert summary(tmp_path)["spikes"] == 1 and summary(tmp_path)["skipped_steps"] == 0


def test_skip_drops_the_update_of_the_spiking_step_only(tmp_path, monkeypatch, capsys):
    inject = Injector(monkeypatch, {7: 50.0})
    train(config("trainer.max_steps=8", "trainer.spike_action=skip"), tmp_path)
    err = capsys.readouterr().err
    assert "step 7: loss" in err and "> 3 x running mean" in err and "update skipped" in err
    assert not inject.updated(7)
    assert inject.updated(6)
    table = rows(tmp_path)
    assert [int(r["skipped_steps"]) for r in table] == [0] * 6 + [1, 1]
    assert [int(r["spikes"]) for r in table] == [0] * 6 + [1, 1]
    s = summary(tmp_path)
    assert (s["spikes"], s["skipped_steps"], s["nonfinite_steps"], s["rollbacks"]) == (1, 1, 0, 0)


def test_a_nan_loss_skips_the_step_and_training_goes_on(tmp_path, monkeypatch, capsys):
    inject = Injector(monkeypatch, {4: float("nan")})
    train(config("trainer.max_steps=6", "trainer.spike_factor=0"), tmp_path)
    assert "step 4: non-finite loss or gradient" in capsys.readouterr().err
    assert not inject.updated(4) and inject.updated(3) and inject.updated(5)
    table = rows(tmp_path)
    assert math.isnan(float(table[3]["loss"]))
    assert [int(r["skipped_steps"]) for r in table] == [0, 0, 0, 1, 1, 1]
    s = summary(tmp_path)
    assert (s["nonfinite_steps"], s["skipped_steps"], s["spikes"]) == (1, 1, 0)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 6  # the final step is saved although 6 is no checkpoint interval
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())


def test_repeated_non_finite_steps_stop_the_run_with_one_paragraph(tmp_path, monkeypatch, capsys):
    from moe.errors import exit_on_user_error

    Injector(monkeypatch, {step: float("nan") for step in range(3, 20)})
    with pytest.raises(SystemExit) as stopped:
        cfg = config("trainer.max_steps=12", "trainer.spike_factor=0", "trainer.max_nonfinite_steps=4",
                     "trainer.checkpoint_every_n_steps=2")
        exit_on_user_error(train)(cfg, tmp_path)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert ("error: trainer.max_nonfinite_steps=4 reached: steps 3 to 6 all had a non-finite loss or gradient"
            in err) and "resumes from the newest checkpoint (step 4)" in err  # skipped steps: same weights
    assert err.count("non-finite loss or gradient (loss=nan); update skipped") == 3  # steps 3-5, then stop
    assert not (tmp_path / "summary.json").exists()  # not a finished run
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.ckpt"))
    assert saved == ["step-000002.ckpt", "step-000004.ckpt"]  # nothing after the stop


def test_rollback_restores_the_last_checkpoint_and_skips_the_batches_since(tmp_path, monkeypatch, capsys):
    inject = Injector(monkeypatch, {7: 50.0})
    train(config("trainer.max_steps=9", "trainer.spike_action=rollback", "trainer.checkpoint_every_n_steps=4",
                 "trainer.keep_last_checkpoints=5"), tmp_path)
    out = capsys.readouterr()
    assert "loss spike at step 7: rolling back to step 4, skipping steps 5..7" in out.err
    assert "resuming from" in out.out
    ledger = json.loads((tmp_path / LEDGER).read_text())["rollbacks"]
    assert [(e["spike_step"], e["from_step"]) for e in ledger] == [(7, 4)]
    # steps 5..7 consumed their batches without updating: the model entering step 8 is the step-4 model
    ckpt4 = torch.load(tmp_path / "checkpoints" / "step-000004.ckpt", weights_only=False)["state_dict"]
    assert torch.equal(inject.params[8], torch.cat([t.flatten() for t in ckpt4.values()]))
    assert inject.updated(8)
    table = rows(tmp_path)
    assert [int(r["step"]) for r in table] == list(range(1, 10))  # each step once in metrics.csv
    assert [int(r["skipped_steps"]) for r in table] == [0, 0, 0, 0, 1, 2, 3, 3, 3]
    s = summary(tmp_path)
    assert (s["rollbacks"], s["spikes"], s["skipped_steps"]) == (1, 1, 3)


@pytest.mark.slow
def test_a_crash_after_a_rollback_still_skips_the_rolled_back_batches(tmp_path, monkeypatch):
    """The ledger in the run dir, not process memory, says what to skip: a relaunch honours it."""
    overrides = ("trainer.max_steps=9", "trainer.spike_action=rollback", "trainer.checkpoint_every_n_steps=4")
    Injector(monkeypatch, {7: 50.0}, crash_on_replay=6)  # spike at 7, roll back to 4, crash replaying 6
    with pytest.raises(RuntimeError, match="injected crash"):
        train(config(*overrides), tmp_path)
    assert json.loads((tmp_path / LEDGER).read_text())["rollbacks"][0]["spike_step"] == 7

    inject = Injector(monkeypatch, {})  # relaunch: no spike this time, only the ledger
    train(config(*overrides), tmp_path)
    assert not any(inject.updated(s) for s in (5, 6, 7)) and inject.updated(8)
    s = summary(tmp_path)
    assert (s["rollbacks"], s["spikes"], s["skipped_steps"]) == (1, 1, 3)


@pytest.mark.parametrize("key, value, needle", [
    ("spike_action", "explode", "use one of warn, skip, rollback"),
    ("spike_factor", 0.5, "or 0 to turn detection off"),
    ("spike_window", 0, "use 1 or more steps"),
    ("spike_max_rollbacks", -1, "use 0 or more"),
    ("max_nonfinite_steps", -1, "use 0 (never stop) or more"),
])
def test_guard_settings_are_checked(key, value, needle):
    cfg = config()
    cfg.trainer[key] = value
    with pytest.raises(ConfigError) as info:
        check_guard(cfg.trainer)
    assert info.value.field == f"trainer.{key}" and info.value.value == value and needle in info.value.fix


@pytest.mark.slow
def test_rollback_under_two_process_ddp(tmp_path):
    """Both ranks reach the same decision and fit again from the checkpoint in their own process."""
    run_dir = tmp_path / "run"
    overrides = [o for o in TINY if not o.startswith("seed=")]
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "_spike_train.py"), f"hydra.run.dir={run_dir}", "parallel=dp2",
         "trainer.devices=2", *overrides, "trainer.max_steps=9", "trainer.spike_action=rollback",
         "trainer.checkpoint_every_n_steps=4"],
        cwd=REPO, env={**os.environ, "MOE_TEST_SPIKE_STEP": "7", "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss spike at step 7: rolling back to step 4, skipping steps 5..7" in proc.stderr
    table = rows(run_dir)
    assert [int(r["step"]) for r in table] == list(range(1, 10))
    assert [int(r["skipped_steps"]) for r in table] == [0, 0, 0, 0, 1, 2, 3, 3, 3]
    s = summary(run_dir)
    assert (s["steps"], s["rollbacks"], s["spikes"], s["skipped_steps"]) == (9, 1, 1, 3)
