"""scripts/study.py on cluttered canvases: the data card, the localisation section and ``--also-eval``'s paired
top-1 change, checked against the evaluations' own results.json files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from timm_rollout.clutter import ClutterRecipe, make_cluttered

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("study", ROOT / "scripts" / "study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


@pytest.fixture(scope="module")
def clutter_study(tmp_path_factory) -> tuple[Path, Path, Path]:
    """gap and rollout, one seed, one epoch, on 20 + 20 cluttered sample images; also evaluated without clutter."""
    tmp = tmp_path_factory.mktemp("clutter")
    for k in (16, 0):
        make_cluttered("cifar10-sample", tmp / f"c{k}", ClutterRecipe(fragments=k, seed=0), per_class=2)
    out = tmp / "study"
    study.main(["--dataset", str(tmp / "c16"), "--also-eval", str(tmp / "c0"), "--epochs", "1", "--seeds", "0",
                "--arms", "gap", "rollout", "--heatmaps", "0", "--device", "cpu", "--output", str(out),
                "--train-args", "--batch-size 10 --warmup-epochs 0 --no-progress --model-kwargs img_size=64 "
                "patch_size=8 depth=2"])
    return out, tmp / "c16", tmp / "c0"


def _metrics(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())["metrics"]


def test_clutter_study_reports_where_each_arm_pools_and_the_cost_of_clutter(clutter_study) -> None:
    out, c16, c0 = clutter_study
    report = (out / "report.md").read_text()
    assert f"data card `{c16}/README.md` (cifar10-sample cluttered (16 fragments, seed 0))" in report
    assert f"also evaluated on `{c0}`" in report
    assert "## Localisation" in report and (out / "localisation.png").stat().st_size > 10_000
    for arm in ("gap", "rollout"):
        main, clean = _metrics(out / "eval" / f"{arm}-s0"), _metrics(out / "eval-c0" / f"{arm}-s0")
        assert main["object_area_fraction"] == pytest.approx(0.25, abs=1e-12)  # 32x32 of 64x64, by hand
        assert "knn_bank" in main and clean.get("knn_bank") is None  # no bank on the other set
        row = next(line for line in report.splitlines() if line.startswith("| top1 on c0 - top1 |"))
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        column = ("gap", "rollout").index(arm)
        assert float(cells[column]) == pytest.approx(clean["top1"] - main["top1"], abs=1e-4)
    gap = _metrics(out / "eval" / "gap-s0")
    assert gap["pooling_object_mass"] == pytest.approx(gap["object_area_fraction"], abs=1e-6)  # uniform weights
    assert gap["pooling_weight_inside"] == pytest.approx(1.0, abs=1e-5)
    # the paired table of rollout against gap carries the localisation and the cost of clutter
    section = report.split("### rollout - gap", 1)[1].split("\n## ", 1)[0]
    assert "| pooling_object_mass |" in section and "| top1 on c0 - top1 |" in section
    assert "| object_area_fraction |" not in section  # a chance level: shown, not tested
