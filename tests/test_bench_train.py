"""``scripts/bench_train.py``'s JSON record: what a run cut off by a time limit keeps."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the benchmarks import their shared helpers (scripts/_bench.py)
_spec = importlib.util.spec_from_file_location("bench_train", ROOT / "scripts" / "bench_train.py")
bench_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_train)


def test_json_keeps_the_finished_sections_of_a_run_cut_off_later(tmp_path: Path, monkeypatch) -> None:
    """The race's figures are on disk, marked incomplete, when a later section dies (a time limit's kill); a run
    that ends writes them all with ``complete`` true. The race itself is replaced by fixed figures (its timings
    are not the point), on the CPU."""
    labels = {"a": "(a) full loop", "c": "(c) stock timm"}
    monkeypatch.setattr(bench_train, "single_runs", lambda *a: ({"a": 30.0, "c": 10.0}, labels))

    def killed(*_: object) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_train, "compare_concurrent", killed)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench_train.main(["--device", "cpu", "--concurrent", "1", "2", "--json", str(out)])
    cut = json.loads(out.read_text())
    assert cut["complete"] is False and cut["ratio_vs_stock_timm_b128"] == pytest.approx(3.0)
    assert cut["img_per_s"] == {"(a) full loop": 30.0, "(c) stock timm": 10.0}
    assert "concurrent_total_img_per_s" not in cut
    monkeypatch.setattr(bench_train, "compare_concurrent", lambda *a: {"1": 5.0, "2": 9.0})
    bench_train.main(["--device", "cpu", "--concurrent", "1", "2", "--json", str(out)])
    whole = json.loads(out.read_text())
    assert whole["complete"] is True and whole["concurrent_total_img_per_s"] == {"1": 5.0, "2": 9.0}
