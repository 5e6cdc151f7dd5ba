"""moe.tools.report and moe.tools.advisor on run dirs laid out exactly as train.py writes them.

The synthetic runs route tokens with a skewed random router (same seed = same routing)
and drop with moe.model.routing's own capacity rule, so the numbers are those a real run of
that router would log; the real sweep is in tests/test_sweeps.py.
"""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
import yaml
from conftest import trained_rows

from moe.errors import UserError
from moe.model.routing import apply_capacity, expert_capacity
from moe.tools.advisor import advise, drop_rate, dropped_SL, routing_log_from_rows, smallest_factor
from moe.tools.report import find_runs, load_run, main, report
from moe.train.metrics import METRIC_COLUMNS

E, K, LAYERS, MBS, SEQ, MIN_CAP = 8, 2, 2, 4, 32, 4
T = MBS * SEQ
PNG = b"\x89PNG\r\n\x1a\n"


def route(rng, skew_E: np.ndarray) -> np.ndarray:
    """idx_TK: k distinct experts per token, drawn by Gumbel top-k from a skewed router."""
    scores_TE = np.log(skew_E) + rng.gumbel(size=(T, E))
    return np.argsort(-scores_TE, axis=1)[:, :K]


def make_run(path, cf, seed=0, steps=20, overrides=(), tokens_per_forward=True, forwards=1, done=True,
             evals=None):
    """A run dir as train.py leaves it: metrics.csv (+ validation rows; with `evals`, {step: {"eval/<task>/
    <metric>": value}}, in-run evaluation rows), summary.json, .hydra/."""
    rng = np.random.default_rng(seed)
    skew_LE = rng.dirichlet(np.full(E, 2.0), size=LAYERS)  # some experts are popular
    cap = expert_capacity(T, E, K, cf, MIN_CAP)
    rows, losses = [], []
    for step in range(1, steps + 1):
        counts_LE = np.stack([sum(np.bincount(route(rng, skew_LE[layer]).ravel(), minlength=E)
                                  for _ in range(forwards)) for layer in range(LAYERS)])
        kept_LE = counts_LE if cap is None else np.minimum(counts_LE, cap * forwards)
        loss = 6.0 * math.exp(-step / 15) + 0.2 * (counts_LE.sum() - kept_LE.sum()) / counts_LE.sum() + 1.0
        losses.append(loss)
        rows.append({"step": step, "loss": loss, "lm_loss": loss - 0.02, "aux_loss": 1.1, "z_loss": 2.0,
                     "drop_fraction": float(1 - kept_LE.sum() / counts_LE.sum()),
                     "max_expert_load": float(kept_LE.max(1).mean()),
                     "mean_expert_load": float(kept_LE.mean()), "router_entropy": 1.9, "lr": 1e-3,
                     "grad_norm": 0.5, "tokens_per_s": 5000.0 / (cf or 2.5), "mfu": 0.01, "val_loss": "",
                     "tokens_per_expert": json.dumps(counts_LE.tolist()),
                     "tokens_per_forward": T if tokens_per_forward else ""})
        if step % 10 == 0:
            rows.append({"step": step, "val_loss": loss + 0.1})
        if step in (evals or {}):
            rows.append({"step": step, **evals[step]})
    path.mkdir(parents=True)
    columns = METRIC_COLUMNS + list(dict.fromkeys(k for values in (evals or {}).values() for k in values))
    with (path / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    config = {"model": {"name": "tiny", "num_experts": E, "top_k": K},
              "moe_opt": {"capacity_factor": cf, "min_capacity": MIN_CAP},
              "trainer": {"micro_batch_size": MBS, "max_steps": steps}, "data": {"seq_len": SEQ},
              "seed": seed}
    (path / ".hydra").mkdir()
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    cf_text = "null" if cf is None else cf
    (path / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump([f"moe_opt.capacity_factor={cf_text}", *overrides, "+sweep=capacity_factor"]))
    if done:
        summary = {"steps": steps, "final_loss": losses[-1], "best_loss": min(losses),
                   "final_val_loss": losses[-1] + 0.1, "tokens_per_s": 5000.0 / (cf or 2.5),
                   "peak_memory_mib": 900.0 + 100 * (cf or 2.5),
                   "drop_fraction": rows[-1].get("drop_fraction"),
                   "config": {"model.top_k": K, "moe_opt.capacity_factor": cf}}
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def make_sweep(root, factors=(0.5, 1.0, 1.5, None), **kw):
    for job, cf in enumerate(factors):
        make_run(root / str(job), cf, **kw)
    return root


def table_rows(md: str) -> list[list[str]]:
    lines = md.split("## ")[0].splitlines()
    body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| run ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in body]


# -- advisor ----------------------------------------------------------------------------------------

def test_advised_factor_applied_to_the_logged_counts_stays_under_target_and_is_the_smallest(tmp_path):
    run = make_run(tmp_path / "run", cf=None, seed=3, steps=30)
    log = routing_log_from_rows(trained_rows(run), top_k=K, min_capacity=MIN_CAP)
    assert log.exact and log.counts_SLE.shape == (30, LAYERS, E) and (log.tokens_S == T).all()
    for target in (0.0, 0.01, 0.05):
        advice = advise(log, target=target)
        assert drop_rate(log, advice.capacity_factor) <= target
        assert drop_rate(log, round(advice.capacity_factor - 0.01, 6)) > target  # 0.01 less is not enough
        assert advice.drop_rate == drop_rate(log, advice.capacity_factor)
    advice = advise(log, target=0.01)
    assert advice.capacity_factor > 1.0  # the skewed router needs headroom over a balanced share
    assert drop_rate(log, advice.dropless_factor) == 0.0
    assert max(advice.per_layer) >= advice.capacity_factor >= min(advice.per_layer)
    rates = list(advice.what_if.values())
    assert rates == sorted(rates, reverse=True)  # drops never rise with the factor


def test_advisor_drops_match_the_layer_capacity_rule_on_real_assignments():
    """The advisor's recomputed drops equal what moe.model.routing.apply_capacity drops for the same picks."""
    rng = np.random.default_rng(0)
    idx_TK = route(rng, rng.dirichlet(np.full(E, 1.0)))
    counts = np.bincount(idx_TK.ravel(), minlength=E)
    rows = [{"step": 1, "tokens_per_expert": json.dumps([counts.tolist()]), "tokens_per_forward": T}]
    log = routing_log_from_rows(rows, top_k=K, min_capacity=MIN_CAP)
    weights_TK = torch.rand(T, K)
    for cf in (0.3, 0.75, 1.0, 1.1, 1.25, 1.5, 2.0):
        cap = expert_capacity(T, E, K, cf, MIN_CAP)
        keep = apply_capacity(torch.from_numpy(idx_TK), weights_TK, E, cap)
        assert dropped_SL(log, cf).sum() == (~keep).sum().item()


def test_counts_summed_over_several_forwards_are_flagged_and_never_overstate_drops(tmp_path):
    run = make_run(tmp_path / "run", cf=None, seed=5, forwards=4, tokens_per_forward=True)
    log = routing_log_from_rows(trained_rows(run), top_k=K, min_capacity=MIN_CAP)
    assert not log.exact
    assert np.allclose(log.counts_SLE.sum(-1), K * T)  # split back to one forward's worth


def test_without_tokens_per_forward_t_comes_from_the_config(tmp_path):
    make_run(tmp_path / "run", cf=1.0, tokens_per_forward=False)
    run = load_run(tmp_path / "run")
    assert run.routing.exact and (run.routing.tokens_S == MBS * SEQ).all()


def test_advisor_rejects_a_target_outside_0_1(tmp_path):
    rows = trained_rows(make_run(tmp_path / "r", cf=None))
    log = routing_log_from_rows(rows, top_k=K, min_capacity=MIN_CAP)
    with pytest.raises(UserError, match="target"):
        advise(log, target=1.5)
    with pytest.raises(UserError, match="from_step"):
        advise(log, from_step=10_000)
    assert smallest_factor(log, 1.0 - 1e-9) == 0.01


# -- reports ----------------------------------------------------------------------------------------

def test_sweep_report_has_one_row_per_run_and_writes_non_empty_pngs(tmp_path, capsys):
    root = make_sweep(tmp_path / "multirun", overrides=("trainer.max_steps=20",))
    make_run(root / "4", cf=2.0, overrides=("trainer.max_steps=20",), done=False)  # died before its summary
    main([str(root)])
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(root / "report.md")
    md = (root / "report.md").read_text()
    rows = table_rows(md)
    assert [r[0] for r in rows] == [f"[{j}]({j}/report.md)" for j in range(5)]
    assert [r[1] for r in rows] == ["0.5", "1.0", "1.5", "dropless", "2.0"]  # only the differing override
    assert "capacity_factor" in md and "max_steps=20" in md.split("|")[0]  # common overrides above the table
    assert "(no summary)" in rows[4][2]
    for name in ("sweep_capacity.png", "sweep_loss.png", *(f"{j}/loss.png" for j in range(5)),
                 *(f"{j}/expert_load.png" for j in range(5))):
        png = root / name
        assert str(png) in printed
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5_000
    for j in range(5):
        assert (root / str(j) / "report.md").exists()


def test_sweep_report_has_a_column_and_a_plot_against_the_swept_key_per_in_run_evaluation(tmp_path):
    """Each run's last in-run evaluation (trainer.eval_every_n_steps) is a column of the sweep table, its
    metrics plotted against the capacity factor; a run without evaluations shows a dash."""
    root = tmp_path / "sweep"
    for job, cf in enumerate((1.0, 1.5, None)):
        evals = {10: {"eval/moe_tiny_mc/acc": 0.2, "eval/moe_tiny_cloze/perplexity": 900.0},
                 20: {"eval/moe_tiny_mc/acc": 0.3 + 0.1 * job, "eval/moe_tiny_cloze/perplexity": 50.0 - job}}
        make_run(root / str(job), cf, evals=evals)
    make_run(root / "3", 2.0)
    written = report(root)
    md = (root / "report.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| run |"))
    assert "| val loss | moe_tiny_mc/acc | moe_tiny_cloze/perplexity | drop % |" in head
    rows = table_rows(md)
    assert [(r[1], r[6], r[7]) for r in rows] == [("1.0", "0.3000", "50.0000"), ("1.5", "0.4000", "49.0000"),
                                                  ("dropless", "0.5000", "48.0000"), ("2.0", "—", "—")]
    png = root / "sweep_eval.png"
    assert png in written and png.read_bytes()[:8] == PNG and png.stat().st_size > 5_000
    assert "(sweep_eval.png)" in md and "against moe_opt.capacity_factor" in md.split("(sweep_eval.png)")[0]
    assert (root / "0" / "eval.png") in written and not (root / "3" / "eval.png").exists()
    assert "| 20 | 0.3000 | 50.0000 |" in (root / "0" / "report.md").read_text()


def test_sweep_drop_rate_does_not_rise_with_capacity_factor_on_the_same_seed(tmp_path):
    root = make_sweep(tmp_path / "sweep", factors=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0, None))
    report(root)
    drops = [float(r[6]) for r in table_rows((root / "report.md").read_text())]
    assert drops == sorted(drops, reverse=True) and drops[0] > 1.0 and drops[-1] == 0.0


def test_run_report_gives_the_advised_factor_and_it_keeps_drops_under_target(tmp_path, capsys):
    run_dir = make_run(tmp_path / "runs" / "dropless", cf=None, seed=1, steps=40)
    assert find_runs(run_dir) == [run_dir]
    main([str(run_dir), "--target", "0.02"])
    written = [str(run_dir / n) for n in ("report.md", "loss.png", "expert_load.png")]
    assert capsys.readouterr().out.split() == written
    md = (run_dir / "report.md").read_text()
    advised = float(md.split("capacity_factor=")[-1].split("`")[0])
    log = load_run(run_dir).routing
    assert drop_rate(log, advised) <= 0.02 < drop_rate(log, round(advised - 0.01, 6))
    assert f"**{advised:g}**" in md and "| drop % (recomputed) |" in md
    row = table_rows(md)[0]
    assert row[0] == "dropless" and row[1] == "40" and float(row[7].replace(",", "")) == 2000.0


def test_report_errors_name_the_dir_and_the_fix(tmp_path, capsys):
    with pytest.raises(UserError, match="is not a directory"):
        report(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "empty")])
    assert exit_info.value.code == 2
    assert "holds no run" in capsys.readouterr().err
