"""scripts/study.py on cluttered canvases: the data card, the localisation section and ``--also-eval``'s paired
top-1 change, checked against the evaluations' own results.json files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from harness.compare import Group
from timm_rollout.clutter import ClutterRecipe, make_cluttered

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("study", ROOT / "scripts" / "study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


@pytest.fixture(scope="module")
def clutter_study(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The rollout arm, one seed, one epoch, on 20 + 20 cluttered sample images; also evaluated without clutter."""
    tmp = tmp_path_factory.mktemp("clutter")
    for k in (16, 0):
        make_cluttered("cifar10-sample", tmp / f"c{k}", ClutterRecipe(fragments=k, seed=0), per_class=2)
    out = tmp / "study"
    study.main(["--dataset", str(tmp / "c16"), "--also-eval", str(tmp / "c0"), "--epochs", "1", "--seeds", "0",
                "--arms", "rollout", "--heatmaps", "0", "--device", "cpu", "--output", str(out),
                "--train-args", "--batch-size 10 --warmup-epochs 0 --no-progress --model-kwargs img_size=64 "
                "patch_size=8 depth=1"])
    return out, tmp / "c16", tmp / "c0"


def _metrics(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())["metrics"]


def test_clutter_study_reports_where_the_arm_pools_and_the_cost_of_clutter(clutter_study) -> None:
    out, c16, c0 = clutter_study
    report = (out / "report.md").read_text()
    assert (f"trained and evaluated on `{c16}` (cifar10-sample cluttered (16 fragments, seed 0)): its data card, "
            f"as made, in [`data/c16.md`](data/c16.md)") in report
    for name, folder in (("c16", c16), ("c0", c0)):  # the cards travel with the study: the data sets do not
        assert (out / "data" / f"{name}.md").read_text() == (folder / "README.md").read_text()
    assert f"also evaluated on `{c0}`" in report
    assert "## Localisation" in report and (out / "localisation.png").stat().st_size > 10_000
    main, clean = _metrics(out / "eval" / "rollout-s0"), _metrics(out / "eval-c0" / "rollout-s0")
    assert main["object_area_fraction"] == pytest.approx(0.25, abs=1e-12)  # 32x32 of 64x64, by hand
    assert "knn_bank" in main and clean.get("knn_bank") is None  # no bank on the other set
    row = next(line for line in report.splitlines() if line.startswith("| top1 on c0 - top1 |"))
    assert float(row.strip("|").split("|")[1]) == pytest.approx(clean["top1"] - main["top1"], abs=1e-4)
    for config in (out / "runs" / "rollout-s0" / "config.json", out / "hub" / "rollout" / "config.json"):
        assert json.loads(config.read_text())["pretrained_cfg"]["input_size"] == [3, 64, 64], config


def test_paired_tables_test_the_localisation_but_not_its_chance_levels() -> None:
    """Two arms over three seeds: pooling_object_mass is paired (its delta is the mean of the per-seed differences,
    by hand), object_area_fraction, the same chance level for every arm, is shown but not tested."""
    def group(label: str, mass: list[float]) -> Group:
        values = {"pooling_object_mass": mass, "object_area_fraction": [0.25] * 3, "top1": [0.5, 0.6, 0.7],
                  "pooling_weight_inside": [4 * m for m in mass], "pooling_effective_patches": [60.0, 61.0, 62.0]}
        return Group(label, [f"eval/{label}-s{s}" for s in range(3)], [0, 1, 2], [None] * 3, values,
                     {k: sum(v) / 3 for k, v in values.items()}, {k: 0.0 for k in values}, dict.fromkeys(values, 3))

    groups = {"cls": group("cls", [0.3, 0.3, 0.3]), "gap": group("gap", [0.25, 0.25, 0.25]),
              "rollout": group("rollout", [0.26, 0.28, 0.27])}
    report = "\n".join(study._report_tables(groups, [], None))
    section = report.split("### rollout - gap", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| pooling_object_mass |"))
    assert row.split("|")[3].strip() == "+0.0200"  # (0.01 + 0.03 + 0.02) / 3
    for shown_only in ("object_area_fraction", "pooling_weight_inside", "pooling_effective_patches"):
        assert f"| {shown_only} |" not in section
    assert report.count("| top1 | 3 |") == 3 and report.count("| primary |") == 3 and "uncorrected" not in report
    named = "\n".join(study._report_tables(groups, [], ("gap", "rollout")))
    tables = named.split("\n### ")[1:]
    assert [t.splitlines()[0] for t in tables] == ["rollout - gap (the primary comparison)", "gap - cls",
                                                   "rollout - cls"]
    assert ["| primary |" in t for t in tables] == [True, False, False]
    assert all("| uncorrected |" in t for t in tables[1:])
    assert "The primary comparison, named before the runs, is rollout - gap in top1" in named
