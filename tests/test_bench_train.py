"""``scripts/bench_train.py``'s epoch-2 totals, against the arithmetic by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from timm_rollout.train.log import write_log

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


def test_json_keeps_the_finished_sections_of_a_run_cut_off_later(tmp_path: Path, monkeypatch) -> None:
    """The race's figures are on disk, marked incomplete, when a later section dies (a time limit's kill); a run
    that ends writes them all with ``complete`` true. The race itself is replaced by fixed figures (its timings
    are not the point), on the CPU."""
    labels = {"a": "(a) full loop", "c": "(c) stock timm"}
    monkeypatch.setattr(bench_train, "single_runs", lambda *a: ({"a": 30.0, "c": 10.0}, labels))

    def killed(*_: object) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_train, "pack_rates", killed)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench_train.main(["--device", "cpu", "--pack", "2", "--json", str(out)])
    cut = json.loads(out.read_text())
    assert cut["complete"] is False and cut["ratio_vs_stock_timm_b128"] == pytest.approx(3.0)
    assert cut["img_per_s"] == {"(a) full loop": 30.0, "(c) stock timm": 10.0} and "serial_total_img_per_s" not in cut
    monkeypatch.setattr(bench_train, "pack_rates", lambda *a: {"serial_total_img_per_s": 5.0, "members": 2})
    bench_train.main(["--device", "cpu", "--pack", "2", "--json", str(out)])
    whole = json.loads(out.read_text())
    assert whole["complete"] is True and whole["serial_total_img_per_s"] == 5.0 and whole["members"] == 2
