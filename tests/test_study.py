"""scripts/study.py end to end at toy scale on the shipped CIFAR-10 sample: report statistics, skipping, refusal."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from harness.compare import summarise
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


def _table_row(report: str, metric: str, after: str = "") -> list[str]:
    """Cells of the first table row for ``metric`` after the line ``after`` (default: from the top)."""
    lines = report.splitlines()
    start = lines.index(after) if after else 0
    row = next(line for line in lines[start:] if line.startswith(f"| {metric} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def _correct(folder: Path) -> dict[int, bool]:
    pred = json.loads((folder / "predictions.json").read_text())
    return {i: p == y for i, p, y in zip(pred["index"], pred["predicted"]["top1"], pred["label"], strict=True)}


def test_report_matches_the_evaluations(finished):
    """Every statistic in the report is recomputed from the four results.json / predictions.json files with numpy,
    scipy and a hand count."""
    report = (finished / "report.md").read_text(encoding="utf-8")
    assert "Command: `python scripts/study.py --dataset cifar10-sample --epochs 1 --seeds 0 1" in report
    assert "beyond" not in report  # the spread rule is gone
    for name in ("curves.png", "heatmaps_both.png", "eval/cls-s0/cosine_matrix.png",
                 "eval/rollout-s0/cosine_matrix.png"):
        assert (finished / name).stat().st_size > 10_000, name
    folders = {(m, s): finished / "eval" / f"{m}-s{s}" for m in ("cls", "rollout") for s in (0, 1)}
    results = {k: json.loads((f / "results.json").read_text()) for k, f in folders.items()}
    for metric in ("top1", "linear_probe", "knn_loo", "knn_bank", "ratio", "silhouette", "ratio_original"):
        per_model = {m: np.array([results[m, s]["metrics"][metric] for s in (0, 1)]) for m in ("cls", "rollout")}
        _, cls_cell, rollout_cell = _table_row(report, metric)
        for cell, values in ((cls_cell, per_model["cls"]), (rollout_cell, per_model["rollout"])):
            mean, std = map(float, re.findall(r"-?\d+\.\d+", cell))
            assert mean == pytest.approx(values.mean(), abs=6e-5)
            assert std == pytest.approx(values.std(ddof=1), abs=6e-5)
        if metric == "ratio_original":
            assert "| ratio_original |" not in report.split("## The original study")[0]  # shown, never tested
            continue
        row = _table_row(report, metric, after="### rollout - cls")
        diff = per_model["rollout"] - per_model["cls"]
        assert row[1] == "2" and float(row[2]) == pytest.approx(diff.mean(), abs=6e-5)
        if diff.std(ddof=1) > 0:
            low, high = sps.t.interval(0.95, 1, loc=diff.mean(), scale=diff.std(ddof=1) / np.sqrt(2))
            assert row[3] == f"[{low:+.4f}, {high:+.4f}]"
            assert float(row[4]) == pytest.approx(sps.ttest_rel(per_model["rollout"], per_model["cls"]).pvalue,
                                                  rel=1e-2)
    # Per-image McNemar for top-1 pooled over both seeds, counted by hand from predictions.json.
    only = [0, 0]
    for s in (0, 1):
        a, b = _correct(folders["cls", s]), _correct(folders["rollout", s])
        only[0] += sum(a[i] and not b[i] for i in a)
        only[1] += sum(b[i] and not a[i] for i in a)
    assert _table_row(report, "top1", after="### rollout - cls")[7] == f"{only[0]} / {only[1]}"
    deletion = [results[m, s]["faithfulness"]["fills"]["drop"]["maps"]["rollout"]["deletion_auc"]
                for m in ("cls", "rollout") for s in (0, 1)]
    _, cls_cell, rollout_cell = _table_row(report, "rollout deletion AUC (drop)")
    assert float(cls_cell.split()[0]) == pytest.approx(np.mean(deletion[:2]), abs=6e-5)
    assert float(rollout_cell.split()[0]) == pytest.approx(np.mean(deletion[2:]), abs=6e-5)


def test_predictions_file_reproduces_the_accuracies(finished):
    folder = finished / "eval" / "rollout-s1"
    results = json.loads((folder / "results.json").read_text())
    pred = json.loads((folder / "predictions.json").read_text())
    labels = np.array(pred["label"])
    assert len(labels) == results["data"]["num_images"] == 50 and len(set(pred["index"])) == 50
    for metric in ("top1", "linear_probe", "knn_loo", "knn_bank"):
        assert (np.array(pred["predicted"][metric]) == labels).mean() == pytest.approx(results["metrics"][metric])
    assert np.mean(pred["top5_hit"]) == pytest.approx(results["metrics"]["top5"])
    assert results["config"]["linear_probe"] == {"C": 1.0, "solver": "lbfgs", "max_iter": 1000, "tol": 1e-4}


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


def test_each_arm_is_compared_with_cls_and_with_gap():
    """Four arms, three seeds: every arm against cls, the others against gap too, each pair once."""
    def result(arm, seed, top1):
        return {"path": f"eval/{arm}-s{seed}", "model": {"name": arm}, "config": {"seed": seed},
                "metrics": {"top1": top1}}

    arms = {"cls": 0.50, "gap": 0.52, "rollout": 0.53, "rollout-grad": 0.51}
    results = [result(a, s, v + 0.01 * s * (a == "rollout")) for a, v in arms.items() for s in (0, 1, 2)]
    groups = {g.label: g for g in summarise(results, ["top1"], label=lambda r: study.run_short(r["path"]))}
    text = study.delta_tables(groups, ["top1"])
    headings = [line for line in text.splitlines() if line.startswith("###")]
    assert headings == ["### gap - cls", "### rollout - cls", "### rollout-grad - cls", "### rollout - gap",
                        "### rollout-grad - gap"]
    # rollout - cls per seed: 0.03, 0.04, 0.05 -> mean 0.04, sd 0.01, the 2-df closed form t = sqrt(1.805/0.0975).
    half = np.sqrt(1.805 / 0.0975) * 0.01 / np.sqrt(3)
    assert _table_row(text, "top1", after="### rollout - cls")[2:4] == ["+0.0400", f"[{0.04 - half:+.4f}, "
                                                                                  f"{0.04 + half:+.4f}]"]
    two = {k: groups[k] for k in ("cls", "gap")}
    assert "| top1 | 0.5000 ± 0.0000 | 0.5200 ± 0.0000 |" in study.means_table(two, ["top1"])
