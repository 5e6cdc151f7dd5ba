"""PNG plots for `moe.report`: sweep trade-off, loss curves, per-layer expert load, in-run evaluations.

Headless (Agg backend); every function writes one PNG and returns its path.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

from moe.outputs import atomic_path  # noqa: E402

DROPLESS = "dropless"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def _positions(values: list) -> tuple[list[float], list[float], list[str]]:
    """x positions for sweep values; None (dropless) goes one step past the largest number."""
    numbers = sorted({float(v) for v in values if v is not None})
    if all(isinstance(v, (int, float)) or v is None for v in values) and numbers:
        gap = (numbers[-1] - numbers[0]) / max(1, len(numbers) - 1) if len(numbers) > 1 else 0.5
        right = numbers[-1] + max(gap, 0.25)
        xs = [right if v is None else float(v) for v in values]
        ticks = numbers + ([right] if None in values else [])
        labels = [f"{t:g}" for t in numbers] + ([DROPLESS] if None in values else [])
        return xs, ticks, labels
    labels = sorted({str(v) for v in values})
    return [float(labels.index(str(v))) for v in values], list(range(len(labels))), labels


def plot_sweep(points: list[dict], x_label: str, path: Path) -> Path:
    """Drop %, loss and throughput against the swept value; one line per group of other overrides.

    points: dicts with x (number, or None for dropless), group (str), drop_pct, final_loss,
    val_loss, tokens_per_s, peak_memory_mib (any may be None).
    """
    xs, ticks, labels = _positions([p["x"] for p in points])
    groups = sorted({p["group"] for p in points})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [("drop %", [("drop_pct", "o-")]),
              ("loss", [("final_loss", "o-"), ("val_loss", "s--")]),
              ("tokens/s (peak MiB dotted)", [("tokens_per_s", "o-")])]
    for ax, (title, series) in zip(axes, panels, strict=True):
        for group in groups:
            chosen = sorted(((x, p) for x, p in zip(xs, points, strict=True) if p["group"] == group),
                            key=lambda xp: xp[0])
            for key, style in series:
                pts = [(x, p[key]) for x, p in chosen if p.get(key) is not None]
                if not pts:
                    continue
                label = " ".join(s for s in (group, key.replace("_", " ") if len(series) > 1 else "") if s)
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=label or None)
        ax.set_title(title)
        ax.set_xticks(ticks, labels)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    memory = [(x, p["peak_memory_mib"]) for x, p in zip(xs, points, strict=True) if p.get("peak_memory_mib")]
    if memory:  # the price of a larger factor: expert buffers grow with it
        twin = axes[2].twinx()
        twin.plot(*np.asarray(sorted(memory)).T, "^:", color="tab:grey")
        twin.set_ylabel("peak MiB", color="tab:grey")
    if any(p.get("drop_pct") is not None for p in points):
        axes[0].axhline(1.0, color="grey", lw=0.8, ls=":")
        axes[0].text(ticks[0], 1.0, " 1% target", va="bottom", fontsize=7, color="grey")
    return _save(fig, path)


def _panels(count: int):
    """A figure of `count` panels, three a row (the unused ones hidden)."""
    cols = min(count, 3)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    return fig, axes.flat[:count]


def plot_sweep_evals(points: list[dict], names: list[str], x_label: str, path: Path) -> Path:
    """Each in-run evaluation metric (`<task>/<metric>`, its last value in each run: points' `evals`) against
    the swept value, a panel each; one line per group of other overrides."""
    xs, ticks, labels = _positions([p["x"] for p in points])
    groups = sorted({p["group"] for p in points})
    fig, axes = _panels(len(names))
    for ax, name in zip(axes, names, strict=True):
        for group in groups:
            pts = sorted((x, p["evals"][name]) for x, p in zip(xs, points, strict=True)
                         if p["group"] == group and p["evals"].get(name) is not None)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=group or None)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(ticks, labels)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, path)


def plot_evals(evals: list[tuple[int, dict[str, float]]], names: list[str], path: Path) -> Path:
    """One run's in-run evaluations over its steps ((step, {name: value}) in order), a panel per metric."""
    fig, axes = _panels(len(names))
    for ax, name in zip(axes, names, strict=True):
        pts = [(step, values[name]) for step, values in evals if name in values]
        ax.plot([s for s, _ in pts], [v for _, v in pts], "o-")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_loss_curves(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> Path:
    """Training loss against step for several runs (label -> (steps, losses))."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (steps, loss) in curves.items():
        ax.plot(steps, loss, label=label, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_run(steps, loss, lm_loss, val_steps, val_loss, drop_pct, path: Path) -> Path:
    """One run: loss curves (total, LM, validation) and drop % against step."""
    fig, (ax, ax_drop) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax.plot(steps, loss, label="loss (LM + aux)", lw=1.2)
    if lm_loss is not None:
        ax.plot(steps, lm_loss, label="LM loss", lw=1.0, alpha=0.8)
    if len(val_steps):
        ax.plot(val_steps, val_loss, "s--", label="validation loss")
    ax.set_xlabel("step")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_drop.plot(steps, drop_pct, color="tab:red", lw=1.2)
    ax_drop.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax_drop.set_xlabel("step")
    ax_drop.set_title("dropped assignments %")
    ax_drop.grid(alpha=0.3)
    return _save(fig, path)


def plot_expert_load(steps_S: np.ndarray, counts_SLE: np.ndarray, path: Path) -> Path:
    """Per-layer heatmap, experts x steps: routed assignments / balanced share (1.0 = balanced)."""
    num_layers, num_experts = counts_SLE.shape[1], counts_SLE.shape[2]
    mean_SL = counts_SLE.mean(-1, keepdims=True)
    load_SLE = np.divide(counts_SLE, mean_SL, out=np.ones_like(counts_SLE), where=mean_SL > 0)
    top = max(2.0, float(np.ceil(load_SLE.max() * 4) / 4))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)  # white = balanced, red = overloaded
    cols = min(num_layers, 4)
    rows = -(-num_layers // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1, 2.6 * rows + 0.8), squeeze=False,
                             layout="constrained")
    extent = [float(steps_S[0]) - 0.5, float(steps_S[-1]) + 0.5, num_experts - 0.5, -0.5]
    for layer, ax in enumerate(axes.flat):
        if layer >= num_layers:
            ax.axis("off")
            continue
        image = ax.imshow(load_SLE[:, layer].T, aspect="auto", cmap="RdBu_r", norm=norm, extent=extent,
                          interpolation="nearest")
        ax.set_title(f"MoE layer {layer}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
        ax.set_yticks(range(num_experts))
        ax.tick_params(labelsize=7)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.85, label="load / balanced share")
    fig.suptitle("tokens routed per expert (before drops), relative to a balanced router", fontsize=10)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path
