"""``scripts/bench_train.py``'s epoch-2 totals, against the arithmetic by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from timm_rollout.train_log import write_log

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_train", ROOT / "scripts" / "bench_train.py")
bench_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_train)


def _run(folder: Path, rates: list[float]) -> Path:
    rows = [{"epoch": i + 1, "train_loss": 1.0, "eval_loss": 1.0, "eval_top1": 10.0, "eval_top5": 50.0, "lr": 1e-3,
             "img_per_s": rate, "seconds": 1.0} for i, rate in enumerate(rates)]
    folder.mkdir()
    write_log(folder / "log.csv", rows)
    return folder


def test_epoch2_total_sums_runs_trained_together_and_chains_runs_one_after_another(tmp_path: Path) -> None:
    """Epoch 1 (start-up) is left out; side by side the rates add; one after another, two runs of equal epochs at
    100 and 300 img/s take 1/100 + 1/300 s per image pair: 2 images per 4/300 s = 150 img/s."""
    runs = [_run(tmp_path / "a", [5.0, 100.0]), _run(tmp_path / "b", [7.0, 300.0])]
    assert bench_train.epoch2_total(runs, together=True) == pytest.approx(400.0)
    assert bench_train.epoch2_total(runs, together=False) == pytest.approx(150.0)
