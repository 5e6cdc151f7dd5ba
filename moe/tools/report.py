"""Run and sweep reports: `python -m moe.report DIR [--target 0.01] [--from-step 0]`.

DIR is a run dir (`runs/<name>`, holding metrics.csv / summary.json) or a sweep dir
(`multirun/<time>`, one run per job sub-directory). Writes `report.md` and PNG plots into
DIR (for a sweep, also a report into each run dir) and prints the paths it wrote.
The table has one row per run; the capacity advisor (moe.tools.advisor) adds, per run, the
smallest capacity factor that would have kept drops under the target.
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from moe.config.schema import MoEOptConfig
from moe.errors import UserError, exit_on_user_error, on_interrupt
from moe.eval import EVAL_PREFIX
from moe.inputs import load_json, load_yaml
from moe.outputs import atomic_path
from moe.tools.advisor import WHAT_IF_FACTORS, Advice, RoutingLog, advise, routing_log_from_rows

RUN_FILES = ("metrics.csv", "summary.json")
CF_KEY = "moe_opt.capacity_factor"
SKIP_DIRS = {".hydra", ".submitit", "checkpoints", "tensorboard", "wandb", "lightning_logs"}
REPORT_HEADINGS = ("# Run report: ", "# Sweep report: ")  # report.md first lines (check_own_report)


@dataclass
class Run:
    """Everything a report needs from one run dir."""

    path: Path
    label: str
    overrides: dict[str, str]  # from .hydra/overrides.yaml, `+`/`++` stripped, hydra.* left out
    config: dict[str, Any]  # flattened dotted keys: .hydra/config.yaml, else summary.json's config
    summary: dict
    train: list[dict]  # metrics.csv training rows (strings)
    val: list[tuple[int, float]]  # (step, validation loss)
    routing: RoutingLog | None
    # a mixture's (data.sources) validation rows: (step, {source name: its validation loss})
    val_by_source: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    # in-run evaluations (trainer.eval_every_n_steps): (step, {"<task>/<metric>": value})
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def column(self, key: str) -> np.ndarray:
        return np.asarray([_num(r.get(key)) for r in self.train], dtype=np.float64)


# -- loading --------------------------------------------------------------------------------------

def _num(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return flat


def damaged_fix(path: Path) -> str:
    return f"restore {path.name} from a copy, or delete it: the report then uses what else the run dir holds"


def _read_overrides(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    overrides = {}
    for item in load_yaml(path, "DIR", str(path.parent.parent), damaged_fix(path)) or []:
        key, _, value = str(item).lstrip("+~").partition("=")
        if not key.startswith("hydra."):
            overrides[key] = value
    return overrides


def load_run(path: Path, label: str | None = None) -> Run:
    """Read one run dir; missing files give empty fields (a failed or running job still gets a row)."""
    path = Path(path)
    summary = load_json(path / "summary.json", "DIR", str(path), damaged_fix(path / "summary.json")) \
        if (path / "summary.json").exists() else {}
    if not isinstance(summary, dict):
        raise UserError("DIR", str(path), damaged_fix(path / "summary.json"),
                        problem=f"cannot be read: {path / 'summary.json'} holds a JSON "
                                f"{type(summary).__name__}, not the object train.py writes")
    config = _flatten(summary.get("config") or {})
    hydra_cfg = path / ".hydra" / "config.yaml"
    if hydra_cfg.exists():
        config.update(_flatten(load_yaml(hydra_cfg, "DIR", str(path), damaged_fix(hydra_cfg)) or {}))
    rows = []
    if (path / "metrics.csv").exists():
        # bytes a crash left at its end (NULs, noise) make rows of no numbers, which the report skips
        text = (path / "metrics.csv").read_text(errors="replace")
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    train = [r for r in rows if not math.isnan(_num(r.get("loss")))]
    val = [(int(_num(r["step"])), _num(r["val_loss"])) for r in rows
           if not math.isnan(_num(r.get("val_loss")))]
    routing = None
    top_k = config.get("model.top_k")
    if top_k:
        mbs, seq = config.get("trainer.micro_batch_size"), config.get("data.seq_len")
        min_capacity = int(config.get("moe_opt.min_capacity", MoEOptConfig.min_capacity))
        per_forward = mbs * seq if isinstance(mbs, int) and isinstance(seq, int) else None
        routing = routing_log_from_rows(train, int(top_k), min_capacity, tokens_per_forward=per_forward)
    per_source = [k for k in (rows[0] if rows else {}) if k.startswith("val_loss/")]
    val_by_source = [(int(_num(r["step"])), {k[len("val_loss/"):]: _num(r.get(k)) for k in per_source})
                     for r in rows if per_source and not math.isnan(_num(r.get("val_loss")))]
    return Run(path, label or path.name, _read_overrides(path / ".hydra" / "overrides.yaml"), config, summary,
               train, val, routing, val_by_source, evaluations(rows))


def evaluations(rows: list[dict]) -> list[tuple[int, dict[str, float]]]:
    """metrics.csv's in-run evaluation rows: (step, {"<task>/<metric>": value}), in order."""
    keys = [k for k in (rows[0] if rows else {}) if k and k.startswith(EVAL_PREFIX)]
    found = []
    for row in rows:
        values = {k[len(EVAL_PREFIX):]: _num(row.get(k)) for k in keys}
        values = {k: v for k, v in values.items() if not math.isnan(v)}
        if values:
            found.append((int(_num(row["step"])), values))
    return found


def _natural(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_runs(root: Path) -> list[Path]:
    """Run dirs under root: root itself if it is one, else every sub-directory holding run files."""
    root = Path(root)
    if any((root / name).exists() for name in RUN_FILES):
        return [root]
    found = []
    for marker in ("metrics.csv", "summary.json", ".hydra/overrides.yaml"):
        for hit in root.rglob(marker):
            run = hit.parent.parent if marker.startswith(".hydra") else hit.parent
            if not SKIP_DIRS & set(run.relative_to(root).parts) and run != root:
                found.append(run)
    return sorted(set(found), key=_natural)


# -- one row per run ------------------------------------------------------------------------------

def differing_keys(runs: list[Run]) -> list[str]:
    """Override keys whose values are not the same in every run (config keys if none were recorded)."""
    source = [r.overrides for r in runs] if any(r.overrides for r in runs) else [
        {k: str(v) for k, v in r.config.items() if k != "run_name"} for r in runs]
    keys = sorted({k for s in source for k in s})
    return [k for k in keys if len({s.get(k, "—") for s in source}) > 1]


def _show(key: str, value: Any) -> str:
    if value in (None, "null", "None") and key == CF_KEY:
        return "dropless"
    return "—" if value is None else str(value)


def _first(*values):
    for value in values:
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            return value
    return None


def _mean(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else None


def run_row(run: Run, advice: Advice | None) -> dict[str, Any]:
    """The numbers in a run's table row (None where the run did not log them)."""
    loss = run.column("loss")
    max_load, mean_load = run.column("max_expert_load"), run.column("mean_expert_load")
    ratio = np.divide(max_load, mean_load, out=np.full_like(max_load, np.nan), where=mean_load > 0)
    steps_logged = run.column("step")
    return {
        "steps": _first(run.summary.get("steps"), int(steps_logged[-1]) if steps_logged.size else None),
        "final_loss": _first(run.summary.get("final_loss"), float(loss[-1]) if loss.size else None),
        "best_loss": _first(run.summary.get("best_loss"), float(np.nanmin(loss)) if loss.size else None),
        "val_loss": _first(run.summary.get("final_val_loss"), run.val[-1][1] if run.val else None),
        "drop_pct": None if (d := _mean(run.column("drop_fraction"))) is None else 100 * d,
        "load_ratio": _mean(ratio),
        "tokens_per_s": _first(run.summary.get("tokens_per_s"), _mean(run.column("tokens_per_s")[1:])),
        "peak_memory_mib": run.summary.get("peak_memory_mib"),
        "advised_cf": advice.capacity_factor if advice else None,
        "advice_exact": advice.exact if advice else True,
        "evals": run.evals[-1][1] if run.evals else {},  # the last in-run evaluation's
        "done": bool(run.summary),
        "stopped": None if run.summary else stop_reason(run.path),
    }


def stop_reason(run_dir: Path) -> str:
    """Why a run has no summary.json, from its train.log: the error paragraph's first words, a signal's
    stop, or "no summary" (still running, or killed before it could say)."""
    log = Path(run_dir) / "train.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for line in reversed(lines):
        text = line.split("] - ", 1)[-1].strip()  # Hydra's log prefix
        if text.startswith("error: "):
            return "failed: " + text[len("error: "):][:100]
        if text.startswith("stopped by "):
            return text[:60]
        if "Traceback" in text or text.startswith("the run stopped on an unexpected error"):
            return "failed: an unexpected error (train.log)"
    return "no summary"


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(runs: list[Run], rows: list[dict], keys: list[str], target: float, link: bool = True) -> str:
    """Markdown table, one row per run: differing overrides then the numbers; link: to each run's report."""
    names = [k.split(".")[-1] if sum(x.split(".")[-1] == k.split(".")[-1] for x in keys) == 1 else k
             for k in keys]
    evals = eval_names(rows)
    head = (["run", *names, "steps", "final loss", "best loss", "val loss", *evals, "drop %", "max/mean load",
             "tokens/s", "peak MiB", f"cf for ≤{100 * target:g}% drops"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, row in zip(runs, rows, strict=True):
        advised = _fmt(row["advised_cf"], "g")
        cells = [f"[{run.label}]({run.label}/report.md)" if link else run.label,
                 *(_show(k, run.overrides.get(k, run.config.get(k))) for k in keys),
                 _fmt(row["steps"], "d") + ("" if row["done"] else f" ({row['stopped']})"),
                 _fmt(row["final_loss"], ".4f"), _fmt(row["best_loss"], ".4f"), _fmt(row["val_loss"], ".4f"),
                 *(_fmt(row["evals"].get(name), ".4f") for name in evals),
                 _fmt(row["drop_pct"], ".2f"), _fmt(row["load_ratio"], ".2f"),
                 _fmt(row["tokens_per_s"], ",.0f"), _fmt(row["peak_memory_mib"], ",.0f"),
                 advised if row["advice_exact"] else f"≈{advised}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def eval_names(rows: list[dict]) -> list[str]:
    """Every `<task>/<metric>` some run evaluated, in the order they first appear."""
    return list(dict.fromkeys(name for row in rows for name in row["evals"]))


LEGEND = """\
Columns: *final/best loss* are training losses (LM + router terms) of the logged steps; *val loss*
the last validation loss (run at `moe_opt.eval_capacity_factor`); *task/metric* (runs with
`trainer.eval_every_n_steps`) the last in-run evaluation's lm_eval metric; *drop %* the mean share of
token->expert assignments dropped over logged steps; *max/mean load* the busiest expert's tokens
over the mean (after drops, mean over layers and steps; 1.00 = balanced); *tokens/s* training
throughput after the first step; *peak MiB* peak device (CPU: host RSS) memory; the last column is
the capacity advisor's factor from that run's routing counts (≈: counts summed several forwards)."""


# -- per run --------------------------------------------------------------------------------------

def _advise(run: Run, target: float, from_step: int) -> Advice | None:
    if run.routing is None or not (run.routing.steps_S >= from_step).any():
        return None
    return advise(run.routing, target=target, from_step=from_step)


def advice_markdown(advice: Advice, run: Run) -> str:
    cf_now = _show(CF_KEY, run.config.get(CF_KEY))
    approx = "" if advice.exact else (
        " Approximate: the logged counts summed several forwards and were split evenly, which"
        " underestimates drops; log one forward per step (`tokens_per_forward`) for an exact figure.")
    lines = [
        "## Capacity advisor", "",
        f"Smallest capacity factor that keeps dropped assignments ≤ {100 * advice.target:g}% on this run's "
        f"routing ({advice.steps} logged steps): **{advice.capacity_factor:g}** "
        f"(recomputed drops {100 * advice.drop_rate:.2f}%). "
        f"No drops at all needs {advice.dropless_factor:g}. "
        f"This run used capacity_factor={cf_now}.{approx}", "",
        f"Use it: `python train.py moe_opt.capacity_factor={advice.capacity_factor:g}`. The counts are the "
        "router's choices before drops, so a dropless run gives the cleanest estimate; routing moves as "
        "training goes on, so re-check with a later run's report.", "",
        "| capacity factor | " + " | ".join(f"{f:g}" for f in advice.what_if) + " |",
        "|---|" + "---|" * len(advice.what_if),
        "| drop % (recomputed) | " + " | ".join(f"{100 * d:.2f}" for d in advice.what_if.values()) + " |", "",
        "| MoE layer | " + " | ".join(str(i) for i in range(len(advice.per_layer))) + " |",
        "|---|" + "---|" * len(advice.per_layer),
        f"| factor for ≤{100 * advice.target:g}% | " + " | ".join(f"{f:g}" for f in advice.per_layer) + " |",
    ]
    return "\n".join(lines)


def report_run(run: Run, target: float = 0.01, from_step: int = 0) -> list[Path]:
    """report.md + loss.png + expert_load.png in the run dir; returns the paths written."""
    from moe.tools import plots as report_plots

    advice = _advise(run, target, from_step)
    written = []
    md = [f"{REPORT_HEADINGS[0]}{run.path}", ""]
    if run.overrides:
        md += ["Overrides: `" + " ".join(f"{k}={v}" for k, v in run.overrides.items()) + "`", ""]
    md += [table([run], [run_row(run, advice)], [], target, link=False), "", LEGEND, ""]
    if run.val_by_source:
        names = list(run.val_by_source[0][1])
        md += ["## Validation loss by source", "", "| step | " + " | ".join(names) + " |",
               "|---|" + "---|" * len(names)]
        md += [f"| {step} | " + " | ".join(_fmt(None if math.isnan(v) else v, ".4f") for v in losses.values())
               + " |" for step, losses in run.val_by_source]
        md += [""]
    if run.evals:
        names = list(dict.fromkeys(name for _, values in run.evals for name in values))
        md += ["## Evaluations", "", "In-run lm_eval tasks (`trainer.eval_every_n_steps`) after these steps.",
               "",
               "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        md += [f"| {step} | " + " | ".join(_fmt(values.get(name), ".4f") for name in names) + " |"
               for step, values in run.evals]
        written.append(report_plots.plot_evals(run.evals, names, run.path / "eval.png"))
        md += ["", "![each evaluation over the steps](eval.png)", ""]
    if run.train:
        steps = run.column("step")
        lm = run.column("lm_loss")
        val_steps = np.asarray([s for s, _ in run.val])
        val_loss = np.asarray([v for _, v in run.val])
        written.append(report_plots.plot_run(steps, run.column("loss"), None if np.isnan(lm).all() else lm,
                                             val_steps, val_loss, 100 * run.column("drop_fraction"),
                                             run.path / "loss.png"))
        md += ["![loss and drops](loss.png)", ""]
    if run.routing is not None:
        written.append(report_plots.plot_expert_load(run.routing.steps_S, run.routing.counts_SLE,
                                                     run.path / "expert_load.png"))
        md += ["![expert load per layer](expert_load.png)", ""]
    if advice:
        md += [advice_markdown(advice, run), ""]
    with atomic_path(run.path / "report.md") as tmp:
        tmp.write_text("\n".join(md))
    return [run.path / "report.md", *written]


# -- a sweep --------------------------------------------------------------------------------------

def _typed(run: Run, key: str):
    if key in run.config:
        return run.config[key]
    value = yaml.safe_load(run.overrides[key]) if key in run.overrides else None
    return value


def sweep_points(runs: list[Run], rows: list[dict], keys: list[str]) -> tuple[str, list[dict]]:
    """The x key (capacity factor when it varies) and one plot point per run."""
    x_key = CF_KEY if CF_KEY in keys else keys[0]
    others = [k for k in keys if k != x_key]
    points = []
    for run, row in zip(runs, rows, strict=True):
        x = _typed(run, x_key)
        points.append({**row, "x": x if isinstance(x, (int, float)) or x is None else str(x),
                       "group": " ".join(f"{k.split('.')[-1]}={run.overrides.get(k, run.config.get(k))}"
                                         for k in others)})
    return x_key, points


def report_sweep(root: Path, runs: list[Run], target: float = 0.01, from_step: int = 0) -> list[Path]:
    """report.md + sweep_capacity.png (trade-off) + sweep_loss.png in the sweep dir, and each run's report."""
    from moe.tools import plots as report_plots

    advices = [_advise(r, target, from_step) for r in runs]
    rows = [run_row(r, a) for r, a in zip(runs, advices, strict=True)]
    keys = differing_keys(runs)
    common = {k: v for k, v in runs[0].overrides.items()
              if k not in keys and all(r.overrides.get(k) == v for r in runs)}
    written = []
    md = [f"{REPORT_HEADINGS[1]}{root}", "", f"{len(runs)} runs."]
    if common:
        md += ["Common overrides: `" + " ".join(f"{k}={v}" for k, v in common.items()) + "`"]
    md += ["", table(runs, rows, keys, target), "", LEGEND, ""]
    if keys:
        x_key, points = sweep_points(runs, rows, keys)
        written.append(report_plots.plot_sweep(points, x_key, root / "sweep_capacity.png"))
        md += [f"![drop %, loss and throughput against {x_key}](sweep_capacity.png)", ""]
        if names := eval_names(rows):
            written.append(report_plots.plot_sweep_evals(points, names, x_key, root / "sweep_eval.png"))
            md += [f"![each in-run evaluation (the last of each run) against {x_key}](sweep_eval.png)", ""]
    curves = {r.label + " " + " ".join(_show(k, r.overrides.get(k, r.config.get(k))) for k in keys):
              (r.column("step"), r.column("loss")) for r in runs if r.train}
    if curves:
        written.append(report_plots.plot_loss_curves(curves, root / "sweep_loss.png"))
        md += ["![training loss of every run](sweep_loss.png)", ""]
    advised = [(r, a) for r, a in zip(runs, advices, strict=True) if a]
    if advised:
        md += ["## Capacity advisor", "",
               f"Smallest capacity factor that would have kept drops ≤ {100 * target:g}%, recomputed from "
               "each run's logged routing counts (before drops). Read it off the dropless run when the sweep "
               "has one; each run's report has the per-layer figures.", "",
               "| run | capacity factor used | advised | no drops at all | "
               + " | ".join(f"drop % at {f:g}" for f in WHAT_IF_FACTORS) + " |",
               "|---|---|---|---|" + "---|" * len(WHAT_IF_FACTORS)]
        for run, a in advised:
            what_if = [f"{100 * a.what_if[f]:.2f}" for f in WHAT_IF_FACTORS]
            used = _show(CF_KEY, run.config.get(CF_KEY))
            md.append(f"| {run.label} | {used} | **{a.capacity_factor:g}** | {a.dropless_factor:g} | "
                      + " | ".join(what_if) + " |")
        md.append("")
    with atomic_path(root / "report.md") as tmp:
        tmp.write_text("\n".join(md))
    for run in runs:
        written += report_run(run, target, from_step)
    return [root / "report.md", *written]


def check_own_report(path: Path) -> None:
    """A report.md about to be replaced is one this command wrote (its heading says so), never a user's own
    file of that name: refused, before anything is written (moe.outputs' rule for a single file)."""
    if not path.exists():
        return
    with path.open(errors="replace") as f:
        first = f.readline()
    if not first.startswith(REPORT_HEADINGS):
        raise UserError("DIR", str(path.parent), f"move {path} aside (or rename it), then report again",
                        problem=f"holds a report.md this command did not write (it starts "
                                f"{first.strip()[:40]!r}); nothing was replaced")


def report(directory: str | Path, target: float = 0.01, from_step: int = 0) -> list[Path]:
    """Report on a run dir or a sweep dir; returns every file written (report.md first)."""
    root = Path(directory)
    if not root.is_dir():
        raise UserError("DIR", str(directory), "pass a run dir (runs/<name>) or a sweep dir "
                        "(multirun/<time>)", problem="is not a directory")
    paths = find_runs(root)
    if not paths:
        raise UserError("DIR", str(directory), "point at runs/<name> or multirun/<time> once a run has "
                        "logged a step", problem="holds no run (no metrics.csv or summary.json under it)")
    for path in {root, *paths}:
        check_own_report(path / "report.md")
    with on_interrupt("the report is unfinished: each report.md and plot already written is whole, none was "
                      "left half-written; run the same command again"):
        if paths == [root]:
            return report_run(load_run(root, root.name), target, from_step)
        runs = [load_run(p, str(p.relative_to(root))) for p in paths]
        return report_sweep(root, runs, target, from_step)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a run dir (runs/<name>) or a sweep dir (multirun/<time>)")
    parser.add_argument("--target", type=float, default=0.01,
                        help="drop-rate target for the capacity advisor (0.01 = 1%%)")
    parser.add_argument("--from-step", type=int, default=0,
                        help="advisor: ignore routing logged before this step")
    args = parser.parse_args(argv)
    for path in report(args.dir, target=args.target, from_step=args.from_step):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
