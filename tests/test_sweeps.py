"""sweeps/*.yaml: every point of every sweep composes and validates; a real sweep runs and reports.

Composition uses Hydra's compose API with conf/ plus the `sweep` group that moe.sweeps
registers; points are expanded the way Hydra's basic sweeper expands them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg, trained_rows
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import moe.config  # noqa: F401  (typed schema)
from moe.config.sweeps import SWEEPS_DIR, register_sweeps
from moe.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
# Every sweep file except those needing an optional sweeper plugin: a new file is tested as soon as it exists.
BASIC = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml") if "optuna" not in p.stem)
POINTS = {"capacity_factor": 5, "aux_loss": 12, "sweep_smoke": 3, "capacity_factor_slurm": 5}


def _compose(overrides, hydra_cfg=False):
    return compose_cfg(*overrides, hydra=hydra_cfg)


def sweep_points(name: str) -> list[list[str]]:
    """The override lists Hydra's basic sweeper would launch for `+sweep=name`."""
    params = _compose([f"+sweep={name}"], hydra_cfg=True).hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def test_every_file_in_sweeps_is_registered():
    names = register_sweeps()
    assert sorted(names) == sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))
    assert set(BASIC) <= set(names) and "capacity_factor_optuna" in names


@pytest.mark.parametrize("name", BASIC)
def test_each_sweep_point_composes_and_validates(name):
    register_sweeps()
    points = sweep_points(name)
    assert len(points) == POINTS.get(name, len(points)) >= 1
    for point in points:
        cfg = _compose([f"+sweep={name}", *point])
        for override in point:
            key, value = override.split("=", 1)
            if value == "null" or value.replace(".", "", 1).isdigit():  # a swept number lands typed
                assert OmegaConf.select(cfg, key) == (None if value == "null" else float(value))
        validate(cfg)


def test_capacity_sweep_covers_the_usual_factors_and_dropless():
    register_sweeps()
    factors = [p[0].split("=")[1] for p in sweep_points("capacity_factor")]
    assert factors == ["1.0", "1.25", "1.5", "2.0", "null"]


def test_sweep_smoke_is_the_tiny_model_on_one_cpu_process():
    register_sweeps()
    cfg = _compose(["+sweep=sweep_smoke"], hydra_cfg=True)
    assert (cfg.model.name, cfg.hardware.name, cfg.trainer.devices) == ("tiny", "cpu", 1)
    assert cfg.trainer.log_every_n_steps == 1 and cfg.resume is False
    assert cfg.trainer.eval_every_n_steps == 12 and cfg.trainer.max_steps % 12 == 0  # evaluated at its end
    assert cfg.hydra.sweep.dir == "multirun/sweep-smoke"


def test_slurm_variant_submits_one_task_per_device_with_requeue(tmp_path, monkeypatch):
    """The submitit launcher as Hydra builds it, up to the sbatch script it would submit."""
    import submitit
    from hydra.utils import instantiate

    register_sweeps()
    cfg = _compose(["+sweep=capacity_factor_slurm", "trainer.num_nodes=2", f"hydra.sweep.dir={tmp_path}"],
                   hydra_cfg=True)
    validate(cfg)
    assert cfg.hardware.name == "gpu" and cfg.hydra.launcher.tasks_per_node == cfg.trainer.devices == 8
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    executors = []
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # pretend srun exists
    monkeypatch.setattr(submitit.AutoExecutor, "map_array",
                        lambda self, fn, *args: executors.append(self) or [])  # capture, do not submit
    launcher.launch([["moe_opt.capacity_factor=1.0"]], initial_job_idx=0)
    script = executors[0]._executor._make_submission_file_text("python -u train.py", "0")
    for line in ("#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --nodes=2",
                 "#SBATCH --requeue", "#SBATCH --time=240", "#SBATCH --signal=USR2@120"):
        assert line in script, script
    assert executors[0]._executor.max_num_timeout == 3


def test_optuna_variant_composes():
    if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None:
        pytest.skip("hydra-optuna-sweeper is optional: pip install hydra-optuna-sweeper -c constraints.txt")
    register_sweeps()
    cfg = _compose(["+sweep=capacity_factor_optuna"], hydra_cfg=True)
    assert cfg.hydra.sweeper.direction == "minimize" and "moe_opt.capacity_factor" in cfg.hydra.sweeper.params


# -- real runs ------------------------------------------------------------------------------------

def _train(args, cwd):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


SHORT = ["trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
         "trainer.micro_batch_size=4", "data.seq_len=64"]
TINY = ["trainer.max_steps=1", "optimizer.warmup_steps=0", "trainer.micro_batch_size=2", "data.seq_len=32",
        "trainer.limit_val_batches=1", "trainer.val_check_interval=1", "trainer.progress_bar=false",
        "trainer.checkpoint_every_n_steps=1000", "trainer.log_every_n_steps=1", "resume=false"]


def _step1(run_dir: Path) -> dict:
    return trained_rows(run_dir)[0]


def _tabletrained_rows(md: str) -> list[str]:
    """Run labels of the first markdown table (the one-row-per-run table)."""
    table = md.split("\n\n| run ")[1].split("\n\n")[0].splitlines()[2:]
    return [line.split("|")[1].strip().split("]")[0].lstrip("[") for line in table]


def _assert_advisor_reproduces_logged_drops(run_dir: Path) -> None:
    """Recomputing drops from a run's own counts at its own factor gives the drops the layer measured."""
    from moe.tools.advisor import dropped_SL
    from moe.tools.report import load_run

    run = load_run(run_dir)
    measured = run.column("drop_fraction")
    recomputed = dropped_SL(run.routing, run.config["moe_opt.capacity_factor"]).sum(-1) / \
        run.routing.counts_SLE.sum((1, 2))
    assert run.routing.exact and recomputed == pytest.approx(measured, abs=1e-6)


def test_real_sweep_reports_one_row_per_run_and_drops_fall_as_capacity_rises(tmp_path):
    """3 real jobs on the same seed and data: the first MoE layer routes step 1 identically, drops fall
    as cf rises, and the advisor's arithmetic reproduces the drops each job's layers measured."""
    sweep = tmp_path / "sweep"
    _train(["-m", "moe_opt.capacity_factor=0.5,1.0,null", *TINY, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    from moe.tools.advisor import advise, drop_rate
    from moe.tools.report import load_run, report

    written = report(sweep)
    assert _tabletrained_rows(written[0].read_text()) == ["0", "1", "2"]
    for png in (p for p in written if p.suffix == ".png"):
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5_000
    first = [_step1(sweep / str(j)) for j in range(3)]
    layer0 = {json.dumps(json.loads(r["tokens_per_expert"])[0]) for r in first}
    assert len(layer0) == 1  # same init, same batch; later layers see the earlier layers' drops
    drops = [float(r["drop_fraction"]) for r in first]
    assert drops[0] >= drops[1] >= drops[2] == 0.0 and drops[0] > 0.0
    for job in range(3):
        _assert_advisor_reproduces_logged_drops(sweep / str(job))
    log = load_run(sweep / "2").routing  # the dropless job
    advice = advise(log, target=0.01)
    smaller = round(advice.capacity_factor - 0.01, 6)
    assert drop_rate(log, advice.capacity_factor) <= 0.01 < drop_rate(log, smaller)


@pytest.mark.slow
def test_make_sweep_smoke_path_end_to_end(tmp_path):
    """What `make sweep-smoke` runs: +sweep=sweep_smoke, then `python -m moe.report` on it."""
    sweep = tmp_path / "sweep-smoke"
    _train(["-m", "+sweep=sweep_smoke", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    proc = subprocess.run([sys.executable, "-m", "moe.report", str(sweep)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    printed = [Path(p) for p in proc.stdout.split()]
    # report.md, sweep_capacity/eval/loss.png; each run: report.md, eval.png, loss.png, expert_load.png
    assert printed[0] == sweep / "report.md" and len(printed) == 4 + 3 * 4
    assert all(p.exists() and p.stat().st_size > 0 for p in printed)
    from moe.tools.advisor import advise, drop_rate
    from moe.tools.report import load_run, run_row

    assert _tabletrained_rows(printed[0].read_text()) == ["0", "1", "2"]
    runs = [load_run(sweep / str(j)) for j in range(3)]
    assert [r.config["moe_opt.capacity_factor"] for r in runs] == [1.0, 1.5, None]
    assert [len(r.train) for r in runs] == [24, 24, 24]
    assert all([step for step, _ in r.evals] == [12, 24] for r in runs)  # in-run evaluation's rows
    head = next(line for line in printed[0].read_text().splitlines() if line.startswith("| run |"))
    assert "| moe_tiny_mc/acc | moe_tiny_mc/acc_norm |" in head and (sweep / "sweep_eval.png") in printed
    mean_drops = [run_row(r, None)["drop_pct"] for r in runs]
    assert mean_drops[0] >= mean_drops[1] >= mean_drops[2] == 0.0
    for job in range(3):
        _assert_advisor_reproduces_logged_drops(sweep / str(job))
    advice = advise(runs[2].routing, target=0.01)
    assert drop_rate(runs[2].routing, advice.capacity_factor) <= 0.01  # on the run it was computed from
    assert f"**{advice.capacity_factor:g}**" in (sweep / "2" / "report.md").read_text()


def test_a_sweep_job_that_fails_at_run_time_leaves_the_others_to_finish_and_the_report_names_it(tmp_path):
    """Job 1 diverges (lr 1e9: non-finite losses stop it, exit-2 kind); jobs 0 and 2 still train. The sweep
    exits 1 naming job 1, and the report's row for it says why it stopped."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    args = ["-m", "optimizer.lr=1e-3,1e9,1e-3", *TINY, "trainer.max_steps=3", "trainer.max_nonfinite_steps=1",
            f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"error: 1 sweep job(s) failed: job 1 ({sweep / '1'})" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (sweep / "0" / "summary.json").exists() and (sweep / "2" / "summary.json").exists()
    assert not (sweep / "1" / "summary.json").exists()
    from moe.tools.report import report

    table = report(sweep)[0].read_text()
    row = next(line for line in table.splitlines() if line.startswith("| [1]"))
    assert "failed: trainer.max_nonfinite_steps=1 reached" in row
