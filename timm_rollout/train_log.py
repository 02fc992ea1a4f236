"""The per-epoch training log (``log.csv``) and its curves (``curves.png``), both written atomically."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .atomic import atomic_path, write_text

__all__ = ["LOG_COLUMNS", "plot_curves", "read_log", "write_log"]

LOG_COLUMNS = ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr", "img_per_s", "seconds")


def write_log(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> None:
    """Write ``rows`` (one dict per finished epoch, keys ``LOG_COLUMNS``) as CSV."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=LOG_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row[k] for k in LOG_COLUMNS})
    write_text(path, buf.getvalue())


def read_log(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of a ``log.csv`` as floats (``epoch`` as int)."""
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: int(v) if k == "epoch" else float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def plot_curves(path: str | os.PathLike, rows: Sequence[dict[str, Any]], title: str) -> None:
    """Two panels per epoch: train and eval loss; eval top-1 and top-5 accuracy (%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], marker=".", label="train")
    ax_loss.plot(epochs, [r["eval_loss"] for r in rows], marker=".", label="eval")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [r["eval_top1"] for r in rows], marker=".", label="top-1")
    ax_acc.plot(epochs, [r["eval_top5"] for r in rows], marker=".", label="top-5")
    ax_acc.set(xlabel="epoch", ylabel="eval accuracy (%)", title="Eval accuracy")
    ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
