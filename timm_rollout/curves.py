"""Per-epoch curves from ``log.csv`` rows: a run's ``curves.png`` and the one line drawer that the study's and the
summary figure's curves use too. Matplotlib is imported where a figure is drawn, so that ``--help`` loads none."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .atomic import save_figure


def epoch_axis(ax) -> None:
    """Label a matplotlib axis's x axis ``epoch`` with ticks on whole epochs only (never 1.2, 1.4, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def seeds_phrase(n: int) -> str:
    """``'1 seed'``, ``'3 seeds'``: how figures count seeds."""
    return f"{n} seed{'' if n == 1 else 's'}"


def draw_seeds(ax, runs: Sequence[Sequence[dict[str, float]]], key: str, colour: str, label: str) -> None:
    """One arm's ``key`` per epoch (``runs``: each seed's log rows): a thin line per seed where there are several,
    and a bold mean over the epochs every seed logged, labelled."""
    logged = [[r for r in rows if key in r] for rows in runs]
    length = min(len(rows) for rows in logged)
    if length == 0:
        return
    for rows in logged if len(runs) > 1 else []:
        ax.plot([r["epoch"] for r in rows], [r[key] for r in rows], color=colour, lw=0.8, alpha=0.35)
    mean = [sum(col) / len(col) for col in zip(*[[r[key] for r in rows[:length]] for rows in logged], strict=True)]
    ax.plot([r["epoch"] for r in logged[0][:length]], mean, color=colour, lw=2, label=label,
            marker="." if length < 3 else None)  # a line of one or two points is hard to see


def plot_curves(path: str | os.PathLike, rows: Sequence[dict[str, Any]], title: str) -> None:
    """A run's ``curves.png``: train and eval loss; eval top-1 and (with more than 5 classes) top-5 accuracy (%)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for ax, lines, ylabel, title_ in ((ax_loss, {"train_loss": "train", "eval_loss": "eval"}, "cross-entropy loss",
                                       "Loss"),
                                      (ax_acc, {"eval_top1": "top-1", "eval_top5": "top-5"}, "eval accuracy (%)",
                                       "Eval accuracy")):
        for i, (key, label) in enumerate(lines.items()):
            draw_seeds(ax, [rows], key, f"C{i}", label)  # top-5 only with more than 5 classes
        ax.set(ylabel=ylabel, title=title_)
        ax.legend()
        epoch_axis(ax)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
