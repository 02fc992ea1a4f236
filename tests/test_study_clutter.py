"""scripts/study.py on cluttered canvases: the data card, the localisation section and ``--also-eval``'s paired
top-1 change, checked against the evaluations' own results.json files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from harness import study
from harness.compare import Group
from harness.study import report as study_report
from harness.study import tables as study_tables
from timm_rollout.clutter import ClutterRecipe, make_cluttered
from timm_rollout.device import cpu_supports_bf16
from timm_rollout.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clutter_study(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The gap and rollout arms, one seed, one epoch, on 20 + 20 cluttered sample images; also evaluated without
    clutter."""
    tmp = tmp_path_factory.mktemp("clutter")
    for k in (16, 0):
        make_cluttered("cifar10-sample", tmp / f"c{k}", ClutterRecipe(fragments=k, seed=0), per_class=2)
    out = tmp / "study"
    study.main(["--dataset", str(tmp / "c16"), "--also-eval", str(tmp / "c0"), "--epochs", "1", "--seeds", "0",
                "--arms", "gap", "rollout", "--heatmaps", "0", "--device", "cpu", "--output", str(out),
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
    line = next(line for line in report.splitlines() if line.startswith("- rollout, seed 0: training"))
    records = [json.loads((out / e / "rollout-s0" / "results.json").read_text()) for e in ("eval", "eval-c0")]
    # --amp auto evaluates in bf16 on a CPU with native bf16, else in fp32
    precision = "bfloat16" if cpu_supports_bf16() else "float32"
    assert all(r["environment"]["dtype"] == precision for r in records)
    shown = [f"`{e}/rollout-s0` ({r['timing']['total'] / 60:.1f} min, {r['environment']['machine']}, "
             f"{r['environment']['dtype']})" for e, r in zip(("eval", "eval-c0"), records, strict=True)]
    assert f"; evaluation {shown[0]}, {shown[1]}; evaluation code timm-rollout " in line, line
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
    report = "\n".join(study_tables.report_tables(groups, [], None))
    section = report.split("### rollout - gap", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| pooling_object_mass |"))
    assert row.split("|")[3].strip() == "+0.0200"  # (0.01 + 0.03 + 0.02) / 3
    for shown_only in ("object_area_fraction", "pooling_weight_inside", "pooling_effective_patches"):
        assert f"| {shown_only} |" not in section
    assert report.count("| top1 | 3 |") == 3 and report.count("| primary |") == 3 and "uncorrected" not in report
    named = "\n".join(study_tables.report_tables(groups, [], ("gap", "rollout")))
    tables = named.split("\n### ")[1:]
    assert [t.splitlines()[0] for t in tables] == ["rollout - gap (the primary comparison)", "gap - cls",
                                                   "rollout - cls"]
    assert ["| primary |" in t for t in tables] == [True, False, False]
    assert all("| uncorrected |" in t for t in tables[1:])
    assert "The primary comparison, named before the runs, is rollout - gap in top1" in named


def test_null_excess_is_each_seeds_value_minus_the_null_of_the_same_evaluation() -> None:
    """The localisation section's excess over content_chance: per seed the arm's object mass minus that seed's
    content_chance, mean and 95% t-interval against scipy; arms without masks get no row."""
    mass, chance = [0.40, 0.35, 0.45], [0.30, 0.31, 0.29]
    share, fraction = [0.5, 0.6, 0.55], [0.4, 0.4, 0.4]
    values = {"pooling_object_mass": mass, "content_chance": chance, "pooling_object_share": share,
              "object_content_fraction": fraction}
    groups = {"rollout": Group("rollout", [f"eval/rollout-s{s}" for s in range(3)], [0, 1, 2], [None] * 3, values,
                               {}, {}, dict.fromkeys(values, 3)),
              "cls": Group("cls", ["eval/cls-s0"], [0], [None], {"pooling_object_mass": [0.3]}, {}, {}, {})}
    table = "\n".join(study_tables.null_excess_table(groups))
    row = next(line for line in table.splitlines() if line.startswith("| rollout |")).strip("|").split("|")
    for (mean_at, ci_at), (a, b) in zip(((2, 3), (4, 5)), ((mass, chance), (share, fraction)), strict=True):
        d = np.subtract(a, b)
        low, high = sps.t.interval(0.95, 2, loc=d.mean(), scale=sps.sem(d))
        assert float(row[mean_at]) == pytest.approx(d.mean(), abs=1e-4)
        assert row[ci_at].strip() == f"[{low:+.4f}, {high:+.4f}]"
    assert "| cls |" not in table and study_tables.null_excess_table({"cls": groups["cls"]}) == []


def _record(folder: Path, metrics: dict, data: str) -> None:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"model": {}, "metrics": metrics, "data": {
        "fingerprint": data, "subset_fingerprint": "all"}}))


def _row(report: str, metric: str) -> list[str]:
    return next(line for line in report.splitlines() if line.startswith(f"| {metric} |")).strip("|").split("|")


def test_interaction_sets_the_primary_comparison_against_another_study(tmp_path) -> None:
    """(rollout - gap here) - (rollout - gap there), paired by seed, against a by-hand difference, scipy's paired t
    (interval and p) and Holm by hand; a seed one study lacks is left out."""
    here_top1 = {("gap", 0): 0.50, ("rollout", 0): 0.53, ("gap", 1): 0.52, ("rollout", 1): 0.53,
                 ("gap", 2): 0.49, ("rollout", 2): 0.54, ("gap", 3): 0.4, ("rollout", 3): 0.6}
    there_top1 = {("gap", 0): 0.60, ("rollout", 0): 0.61, ("gap", 1): 0.61, ("rollout", 1): 0.60,
                  ("gap", 2): 0.58, ("rollout", 2): 0.60}
    probe = {("gap", s): 0.5 for s in range(4)} | {("rollout", s): 0.5 + 0.01 * s * s for s in range(4)}
    knn = {("gap", s): 0.4 for s in range(4)} | {("rollout", s): 0.4 + 0.01 * s for s in range(4)}
    other = tmp_path / "clean"
    (other).mkdir()
    (other / "study.json").write_text(json.dumps({"identity": {"dataset": "clean", "epochs": 1}}))
    for key, top1 in there_top1.items():
        _record(other / "eval" / f"{key[0]}-s{key[1]}", {"top1": top1, "linear_probe": 0.5, "knn_bank": 0.4},
                "clean-data")
    data = {"fingerprint": "clutter-data", "subset_fingerprint": "all"}
    here = {key: {"metrics": {"top1": top1, "linear_probe": probe[key], "knn_bank": knn[key]}, "data": data}
            for key, top1 in here_top1.items()}
    args = study.build_parser().parse_args(["--dataset", "cluttered", "--epochs", "1", "--output", str(tmp_path / "o"),
                                            "--primary", "gap:rollout", "--interaction", str(other)])
    report = "\n".join(study_report.interaction_section(args, tmp_path / "o", here,
                                                        ["top1", "linear_probe", "knn_bank"]))
    by_seed = [(here_top1["rollout", s] - here_top1["gap", s]) - (there_top1["rollout", s] - there_top1["gap", s])
               for s in range(3)]
    row = _row(report, "top1")
    assert row[1].strip() == "3" and float(row[2]) == pytest.approx(np.mean([0.03, 0.01, 0.05]), abs=1e-4)
    assert float(row[3]) == pytest.approx(np.mean([0.01, -0.01, 0.02]), abs=1e-4)
    assert float(row[4]) == pytest.approx(np.mean(by_seed), abs=1e-4)
    low, high = sps.t.interval(0.95, 2, loc=np.mean(by_seed), scale=sps.sem(by_seed))
    assert row[5].strip() == f"[{low:+.4f}, {high:+.4f}]"
    here_d = [here_top1["rollout", s] - here_top1["gap", s] for s in range(3)]
    there_d = [there_top1["rollout", s] - there_top1["gap", s] for s in range(3)]
    assert float(row[6]) == pytest.approx(sps.ttest_rel(here_d, there_d).pvalue, rel=1e-2)
    assert row[7].strip() == "uncorrected"  # secondary, as the design named it; not in the Holm family
    p_probe = sps.ttest_1samp([0.0, 0.01, 0.04], 0).pvalue
    p_knn = sps.ttest_1samp([0.0, 0.01, 0.02], 0).pvalue
    low_p, high_p = sorted([p_probe, p_knn])
    holm = {p_probe: None, p_knn: None}
    holm[low_p] = 2 * low_p
    holm[high_p] = max(2 * low_p, high_p)
    assert float(_row(report, "linear_probe")[7]) == pytest.approx(holm[p_probe], rel=1e-2)
    assert float(_row(report, "knn_bank")[7]) == pytest.approx(holm[p_knn], rel=1e-2)
    assert "[../clean/report.md](../clean/report.md)" in report
    here_same = {k: {**v, "data": {"fingerprint": "clean-data", "subset_fingerprint": "all"}} for k, v in here.items()}
    same = "\n".join(study_report.interaction_section(args, tmp_path / "o", here_same, ["top1"]))
    assert "Not computed: gap seed 0, gap seed 1, gap seed 2, rollout seed 0" in same and "| top1 |" not in same
    del here["rollout", 1]["metrics"]["knn_bank"]  # a metric one run lacks: that row pairs the other seeds
    report = "\n".join(study_report.interaction_section(args, tmp_path / "o", here, ["top1", "knn_bank"]))
    assert _row(report, "knn_bank")[1].strip() == "2" and _row(report, "top1")[1].strip() == "3"
    assert float(_row(report, "knn_bank")[4]) == pytest.approx(0.01, abs=1e-4)  # seeds 0 and 2: (0 + 0.02) / 2
    change = report.split("there - here", 1)[1]  # each arm there minus here, paired by seed: what clutter costs it
    for arm in ("gap", "rollout"):
        cost = [there_top1[arm, s] - here_top1[arm, s] for s in range(3)]
        row = next(line for line in change.splitlines() if line.startswith(f"| {arm} | top1 |")).split("|")
        assert float(row[6]) == pytest.approx(np.mean(cost), abs=1e-4) and row[3].strip() == "3"
        low, high = sps.t.interval(0.95, 2, loc=np.mean(cost), scale=sps.sem(cost))
        assert row[7].strip() == f"[{low:+.4f}, {high:+.4f}]"
        assert float(row[8]) == pytest.approx(sps.ttest_1samp(cost, 0).pvalue, rel=1e-2)
    none_yet = study_report.interaction_section(args, tmp_path / "o", {("gap", 3): here["gap", 3]}, ["top1"])
    assert "No seed has gap and rollout evaluated in both studies yet." in none_yet


def test_interaction_in_the_report_and_its_refusals(clutter_study, tmp_path) -> None:
    """--interaction end to end on a copy of the clutter study, against a doctored copy as the other study (other
    data, top-1 shifted by hand); a study of another recipe, of the same data set, or no study is refused."""
    out, c16, c0 = clutter_study
    here, other = tmp_path / "here", tmp_path / "other"
    shutil.copytree(out, here)
    shutil.copytree(out, other)
    saved = json.loads((other / "study.json").read_text())
    saved["identity"]["dataset"] = str(c0)
    (other / "study.json").write_text(json.dumps(saved))
    for arm, shift in (("gap", 0.1), ("rollout", 0.3)):
        path = other / "eval" / f"{arm}-s0" / "results.json"
        result = json.loads(path.read_text())
        result["metrics"]["top1"] += shift
        result["data"]["fingerprint"] = result["data"]["split_content"] = "another data set"
        path.write_text(json.dumps(result))

    def argv(output: Path, *flags: str) -> list[str]:
        return ["--dataset", str(c16), "--epochs", "1", "--arms", "gap", "rollout", "--heatmaps", "0", "--device",
                "cpu", "--output", str(output), "--report-only", "--train-args", "--batch-size 10 --warmup-epochs 0 "
                "--no-progress --model-kwargs img_size=64 patch_size=8 depth=1", *flags]

    study.main(argv(here, "--primary", "gap:rollout", "--interaction", str(other)))
    report = (here / "report.md").read_text()
    assert f"## Interaction with `{other}`" in report
    mine = {a: _metrics(here / "eval" / f"{a}-s0")["top1"] for a in ("gap", "rollout")}
    row = _row(report.split("## Interaction", 1)[1], "top1")
    assert float(row[2]) == pytest.approx(mine["rollout"] - mine["gap"], abs=1e-4)
    assert float(row[3]) == pytest.approx(mine["rollout"] - mine["gap"] + 0.2, abs=1e-4)
    assert float(row[4]) == pytest.approx(-0.2, abs=1e-4) and row[5].strip() == "-"  # one seed: no interval
    assert json.loads((here / "study.json").read_text())["interaction"] == str(other)
    study.main(argv(here))  # remembered, and the same folder with a trailing slash is the same flag
    study.main(argv(here, "--interaction", f"{other}/"))
    assert f"## Interaction with `{other}`" in (here / "report.md").read_text()
    saved["identity"]["epochs"] = 2
    (other / "study.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"was run with --epochs 2 \(here 1\) \(--interaction as .* remembers it"):
        study.main(argv(here))
    saved["identity"].update(epochs=1, dataset=str(c16))
    (other / "study.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"is a study of the same data set as this one \(--interaction as .* remembers"):
        study.main(argv(here))
    # the same data typed another way (the evaluations read the same data): refused before anything is recorded
    same, fresh = tmp_path / "same", tmp_path / "fresh"
    shutil.copytree(out, same)
    shutil.copytree(out, fresh)
    saved["identity"]["dataset"] = f"{c16}/../{c16.name}"
    (same / "study.json").write_text(json.dumps(saved))
    recorded = (fresh / "study.json").read_text()
    refusals = [(["--interaction", str(same)], r"is a study of the same data set as this one; an interaction needs"),
                (["--interaction", str(other)], r"add --primary BASE:ARM"),
                (["--interaction", str(other / "runs")], r"holds no study.json; name a folder written by"),
                (["--interaction", str(fresh)], r"this study's own --output")]
    for flags, message in refusals:
        with pytest.raises(UserError, match=message):
            study.main(argv(fresh, *flags, *([] if "primary" in message else ["--primary", "gap:rollout"])))
        assert (fresh / "study.json").read_text() == recorded
