"""The per-epoch training log (``log.csv``, written atomically; its figure is :mod:`timm_rollout.curves`), and with
``--report-to tensorboard`` the same rows as TensorBoard scalars (:class:`TensorBoardLog`)."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic import write_text

LOG_COLUMNS = ("epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr", "img_per_s", "seconds")
# Written when some row has them: the pooling diagnostics of a rollout-pooled model's evaluation pass.
OPTIONAL_COLUMNS = ("rollout_effective_patches", "rollout_cosine_to_mean")
# TensorBoard tag of each log column (step: the epoch); a column not named here is logged under its own name.
BOARD_TAGS = {"train_loss": "loss/train", "eval_loss": "loss/eval", "eval_top1": "accuracy/top1",
              "eval_top5": "accuracy/top5", "lr": "lr", "img_per_s": "throughput/img_per_s",
              "seconds": "time/epoch_seconds", "rollout_effective_patches": "rollout/effective_patches",
              "rollout_cosine_to_mean": "rollout/cosine_to_mean"}
EVENT_FILES = "events.out.tfevents.*"  # TensorBoard's event files in a run folder


class TensorBoardLog:
    """Log rows as TensorBoard scalars (:data:`BOARD_TAGS`, step = epoch) into event files in ``folder``; an epoch
    its event files already hold (a resumed run's) is not written again, one they lack is."""

    def __init__(self, folder: Path) -> None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from torch.utils.tensorboard import SummaryWriter

        found = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
        tag = BOARD_TAGS["train_loss"]
        self.epochs = {e.step for e in found.Scalars(tag)} if tag in found.Tags()["scalars"] else set()
        self.writer = SummaryWriter(str(folder))

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        """Write the rows of epochs not written yet, and flush."""
        for row in rows:
            if row["epoch"] not in self.epochs:
                for key, value in row.items():
                    if key != "epoch":
                        self.writer.add_scalar(BOARD_TAGS.get(key, key), value, row["epoch"])
                self.epochs.add(row["epoch"])
        self.writer.flush()


def top5_text(row: dict[str, Any]) -> str:
    """``, top-5 91.20%`` for a row (log row or summary) with top-5 accuracy; nothing without (5 classes or fewer)."""
    return f", top-5 {row['eval_top5']:.2f}%" if row.get("eval_top5") is not None else ""


def write_log(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> None:
    """Write ``rows`` (one dict per finished epoch, keys ``LOG_COLUMNS``, some of ``OPTIONAL_COLUMNS``) as CSV;
    an optional column some row has is written with empty cells for the rows without it (e.g. resumed epochs)."""
    columns = [*LOG_COLUMNS, *(k for k in OPTIONAL_COLUMNS if any(k in row for row in rows))]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in columns})
    write_text(path, buf.getvalue())


def read_log(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of a ``log.csv`` as floats (``epoch`` as int); empty cells are left out of their row."""
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: int(v) if k == "epoch" else float(v) for k, v in row.items() if v != ""}
                for row in csv.DictReader(f)]
