"""Figures for the studies: small functions from `metrics.jsonl` records or arrays to PNGs
(matplotlib, headless `Agg`). Each takes the output path, the data, axis labels with units and a
title that says the setting; fitted numbers go in the legend. Each returns the saved figure so
callers (and tests) can inspect what was drawn."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bebop import analysis  # noqa: E402


def series(records: Sequence[Mapping], key: str, x_key: str = "step"):
    """(x, y) arrays of the records that have `key` (e.g. from `metrics.read_jsonl`)."""
    pts = [(r[x_key], r[key]) for r in records if key in r and x_key in r]
    if not pts:
        return np.zeros(0), np.zeros(0)
    x, y = zip(*pts, strict=True)
    return np.asarray(x, np.float64), np.asarray(y, np.float64)


def read_metrics(path: Path) -> list[dict]:
    """The records of a `metrics.jsonl`; a line that is not JSON is an error naming it."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: not a JSON record ({e})") from None
    return out


def _save(fig, ax, path: Path, xlabel: str, ylabel: str, title: str, legend: bool = True):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _check(label, x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(
            f"plot series {label!r}: want two equal 1-D non-empty arrays, got "
            f"{x.shape} and {y.shape}"
        )
    return x, y


def lines(path, curves: Mapping[str, tuple], xlabel: str, ylabel: str, title: str, size=(6, 4)):
    """One line per entry of `curves` (label -> (x, y)), e.g. acceptance vs step."""
    fig, ax = plt.subplots(figsize=size)
    for label, (x, y) in curves.items():
        x, y = _check(label, x, y)
        ax.plot(x, y, marker="o" if x.size <= 30 else None, markersize=3, label=label)
    return _save(fig, ax, path, xlabel, ylabel, title)


def twin_x(path, curves: Mapping[str, tuple], xlabels: tuple[str, str], ylabel: str, title: str):
    """Two panels sharing y: the same curves (label -> (x1, x2, y)) against two x axes, e.g.
    reward vs step and reward vs wall-clock."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for label, (x1, x2, y) in curves.items():
        for ax, x in zip(axes, (x1, x2), strict=True):
            xx, yy = _check(label, x, y)
            ax.plot(xx, yy, label=label)
    axes[0].set_xlabel(xlabels[0])
    axes[0].set_ylabel(ylabel)
    axes[0].grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, axes[1], path, xlabels[1], "", "")


def binned_fit(
    path, groups: Mapping[str, tuple], xlabel: str, ylabel: str, title: str, bins: int = 10
):
    """Per group (label -> (x, y)), binned means of y against x (markers) and the least-squares
    line over the raw pairs, with slope, its bootstrap 95 % interval and r in the legend (e.g.
    acceptance vs policy entropy). Returns (figure, {label: LinearFit})."""
    fig, ax = plt.subplots(figsize=(6, 4))
    fits = {}
    for i, (label, (x, y)) in enumerate(groups.items()):
        x, y = _check(label, x, y)
        fit = analysis.linear_fit(x, y)
        fits[label] = fit
        bx, by, _ = analysis.binned(x, y, bins)
        color = f"C{i}"
        ax.plot(bx, by, "o", color=color, markersize=4)
        grid = np.linspace(x.min(), x.max(), 50)
        ax.plot(
            grid,
            fit.slope * grid + fit.intercept,
            "-",
            color=color,
            label=f"{label}: {fit.label()}",
        )
    return _save(fig, ax, path, xlabel, ylabel, title), fits


def scatter(path, groups: Mapping[str, tuple], xlabel: str, ylabel: str, title: str, fit=True):
    """Points per group (label -> (x, y)), e.g. one point per run; with `fit`, each group's
    least-squares line and its slope in the legend."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, (x, y)) in enumerate(groups.items()):
        x, y = _check(label, x, y)
        text = label
        if fit and x.size >= 3:
            f = analysis.linear_fit(x, y)
            grid = np.linspace(x.min(), x.max(), 50)
            ax.plot(grid, f.slope * grid + f.intercept, "--", color=f"C{i}", linewidth=1)
            text = f"{label}: slope {f.slope:+.3f}, r = {f.r:+.2f}"
        ax.plot(x, y, "o", color=f"C{i}", markersize=5, label=text)
    return _save(fig, ax, path, xlabel, ylabel, title)
