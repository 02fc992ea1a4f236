"""scripts/study.py end to end at toy scale on the shipped CIFAR-10 sample: report numbers, skipping, refusal."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from harness.compare import Group
from timm_rollout.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("study", ROOT / "scripts" / "study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def _argv(out: Path, epochs: int = 1) -> list[str]:
    return ["--dataset", "cifar10-sample", "--epochs", str(epochs), "--seeds", "0", "1", "--max-train-samples", "100",
            "--train-args", "--batch-size 20 --warmup-epochs 0 --max-eval-samples 100 --no-progress",
            "--eval-per-class", "5", "--bank-per-class", "10", "--faithfulness-images", "4", "--heatmaps", "2",
            "--jobs", "2", "--device", "cpu", "--output", str(out)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("study") / "toy"
    study.main(_argv(out))
    return out


def _table_row(report: str, metric: str) -> list[str]:
    row = next(line for line in report.splitlines() if line.startswith(f"| {metric} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_report_matches_the_evaluations(finished):
    """Every table cell is recomputed with numpy from the four results.json files."""
    report = (finished / "report.md").read_text(encoding="utf-8")
    assert "Command: `python scripts/study.py --dataset cifar10-sample --epochs 1 --seeds 0 1" in report
    for name in ("curves.png", "heatmaps_both.png", "eval/cls-s0/cosine_matrix.png",
                 "eval/rollout-s0/cosine_matrix.png"):
        assert (finished / name).stat().st_size > 10_000, name
    results = {(m, s): json.loads((finished / "eval" / f"{m}-s{s}" / "results.json").read_text())
               for m in ("cls", "rollout") for s in (0, 1)}
    for metric in ("top1", "knn_loo", "knn_bank", "ratio", "silhouette"):
        per_model = {m: np.array([results[m, s]["metrics"][metric] for s in (0, 1)]) for m in ("cls", "rollout")}
        _, cls_cell, rollout_cell, delta, verdict = _table_row(report, metric)
        for cell, values in ((cls_cell, per_model["cls"]), (rollout_cell, per_model["rollout"])):
            mean, std = map(float, re.findall(r"-?\d+\.\d+", cell))
            assert mean == pytest.approx(values.mean(), abs=6e-5)
            assert std == pytest.approx(values.std(ddof=1), abs=6e-5)
        diff = per_model["rollout"].mean() - per_model["cls"].mean()
        assert float(delta) == pytest.approx(diff, abs=6e-5)
        spread = per_model["cls"].std(ddof=1) + per_model["rollout"].std(ddof=1)
        assert verdict == ("yes" if abs(diff) > spread else "no")
    deletion = [results[m, s]["faithfulness"]["maps"]["rollout_weights"]["deletion_auc"]
                for m in ("cls", "rollout") for s in (0, 1)]
    _, cls_cell, rollout_cell, _, _ = _table_row(report, "rollout_weights deletion AUC")
    assert float(cls_cell.split()[0]) == pytest.approx(np.mean(deletion[:2]), abs=6e-5)
    assert float(rollout_cell.split()[0]) == pytest.approx(np.mean(deletion[2:]), abs=6e-5)


def test_both_models_share_one_recipe(finished):
    """The runs of a seed differ only in the model (and where they are written)."""
    cls, rollout = (json.loads((finished / "runs" / f"{m}-s0" / "train_args.json").read_text())
                    for m in ("cls", "rollout"))
    differing = {k for k in cls.keys() | rollout.keys() if cls.get(k) != rollout.get(k)}
    assert differing == {"model", "output"}
    assert cls["seed"] == 0 and cls["epochs"] == 1 and cls["batch_size"] == 20


def test_rerun_skips_finished_work_and_redoes_only_what_is_missing(finished, capfd):
    kept = finished / "eval" / "cls-s1" / "results.json"
    redo = finished / "eval" / "rollout-s1" / "results.json"
    stamp = kept.stat().st_mtime_ns
    redo.unlink()
    study.main(_argv(finished))
    printed = capfd.readouterr().out
    assert printed.count("finished, skipped") == 4
    assert printed.count("evaluated, skipped") == 3
    assert kept.stat().st_mtime_ns == stamp
    assert json.loads(redo.read_text())["metrics"]["top1"] >= 0


def test_rerun_with_other_study_flags_is_refused(finished):
    with pytest.raises(UserError, match=r"--epochs 1 \(now 2\)"):
        study.main(_argv(finished, epochs=2))
    with pytest.raises(UserError, match="--jobs must be at least 1"):
        study.main([*_argv(finished), "--jobs", "0"])


def test_spread_verdicts():
    cls = Group("cls", mean={"top1": 0.50, "ratio": 1.0}, std={"top1": 0.01, "ratio": None})
    rollout = Group("rollout", mean={"top1": 0.53, "ratio": 1.2}, std={"top1": 0.01, "ratio": None})
    table = study.spread_table(cls, rollout, ["top1", "ratio"])
    assert _table_row(table, "top1") == ["top1", "0.5000 ± 0.0100", "0.5300 ± 0.0100", "+0.0300", "yes"]
    assert _table_row(table, "ratio")[-1] == "n/a (one seed)"
    rollout.std["top1"] = 0.03
    assert _table_row(study.spread_table(cls, rollout, ["top1"]), "top1")[-1] == "no"
