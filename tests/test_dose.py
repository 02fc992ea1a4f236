"""The dose analysis (harness.study.dose): its rules against the notes' conditions on a grid, its statistics against
scipy and plain loops, and scripts/study.py with several --also-eval data sets, checked against the evaluations'
files."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from harness import study
from harness.study.dose import (
    contrast_metric,
    dose_section,
    dose_series,
    image_level,
    null_outcome,
    place_outcome,
    rule_outcome,
    trend_slope,
)
from timm_rollout.clutter import ClutterRecipe, make_cluttered

ROOT = Path(__file__).resolve().parents[1]

GRID = [round(x, 3) for x in np.arange(-0.03, 0.031, 0.0025)]


def test_the_five_outcomes_are_exclusive_and_exhaustive_as_the_notes_define_them():
    conditions = {  # the notes' words, written out independently of rule_outcome
        "pays": lambda lo, hi: lo >= 0.01,
        "grows, size open": lambda lo, hi: 0 < lo < 0.01 <= hi,
        "grows, below interest": lambda lo, hi: 0 < lo and hi < 0.01,
        "no gain of interest": lambda lo, hi: lo <= 0 and hi < 0.01,
        "open": lambda lo, hi: lo <= 0 and hi >= 0.01,
    }
    for lo, hi in itertools.combinations_with_replacement(GRID, 2):
        holding = [name for name, holds in conditions.items() if holds(lo, hi)]
        assert holding == [rule_outcome(lo, hi)], (lo, hi, holding)


def test_the_localisation_outcomes_split_on_the_interval():
    for lo, hi in itertools.combinations_with_replacement(GRID, 2):
        assert null_outcome(lo, hi) == ("beats the null" if lo > 0 else "does not" if hi <= 0 else "open")
        excludes_zero, within = lo > 0 or hi < 0, -0.02 <= lo and hi <= 0.02
        assert place_outcome(lo, hi) == ("looks elsewhere" if excludes_zero else
                                         "looks where the base's rollout looks" if within else "open")


def test_trend_slope_and_image_level_against_scipy_and_a_plain_loop():
    rng = np.random.default_rng(0)
    values = rng.normal(size=4)
    assert trend_slope(values) == pytest.approx(sps.linregress(np.arange(4), values).slope, abs=1e-12)
    hits = {(a, s, d): rng.integers(0, 2, 50).astype(float) for a in ("gap", "rollout") for s in (0, 1, 2)
            for d in ("lo", "hi")}
    per_image = []
    for i in range(50):
        total = 0.0
        for s in (0, 1, 2):
            total += (hits["rollout", s, "hi"][i] - hits["gap", s, "hi"][i]) - (
                hits["rollout", s, "lo"][i] - hits["gap", s, "lo"][i])
        per_image.append(total / 3)
    d = image_level(hits, "gap", "rollout", "lo", "hi", [0, 1, 2])
    want = sps.ttest_1samp(per_image, 0.0)
    low, high = want.confidence_interval(0.95)
    assert (d.n, d.mean, d.low, d.high, d.p) == pytest.approx((50, np.mean(per_image), low, high, want.pvalue))


def _row(lines: list[str], start: str) -> list[str]:
    return next(line for line in lines if line.startswith(start)).strip("|").split("|")


def test_dose_section_by_hand():
    """Three seeds at three doses: the primary is (rollout - gap at the last) - (at the first) per seed; its row
    holds their mean and the scipy t-interval, and the rule's outcome."""
    top1 = {("gap", 0): (0.50, 0.55, 0.60), ("rollout", 0): (0.51, 0.57, 0.64),
            ("gap", 1): (0.52, 0.56, 0.61), ("rollout", 1): (0.52, 0.58, 0.64),
            ("gap", 2): (0.49, 0.54, 0.60), ("rollout", 2): (0.50, 0.56, 0.63)}
    names = ["d0", "d16", "d256"]
    results = {(a, s, n): {"metrics": {"top1": top1[a, s][i], "pooling_object_mass": 0.4 + 0.01 * s,
                                       "content_chance": 0.3, "position_prior_mass": 0.35 + 0.01 * i,
                                       "pooling_fixed_object_mass": 0.32, "rollout_box_mass": 0.39 + 0.01 * s}}
               for (a, s) in top1 for i, n in enumerate(names)}
    lines = dose_section("gap", "rollout", names, [0, 1, 2], results)
    per_seed = [(top1["rollout", s][2] - top1["gap", s][2]) - (top1["rollout", s][0] - top1["gap", s][0])
                for s in range(3)]  # 0.03, 0.02, 0.02
    cells = _row(lines, "| **primary**")
    low, high = sps.ttest_1samp(per_seed, 0.0).confidence_interval(0.95)
    assert float(cells[2]) == pytest.approx(np.mean(per_seed), abs=1e-4)
    assert cells[3].strip() == f"[{low:+.4f}, {high:+.4f}]" and cells[6].strip() == rule_outcome(low, high)
    slope = _row(lines, "| trend of rollout - gap")
    want = np.mean([sps.linregress(range(3), [top1["rollout", s][i] - top1["gap", s][i] for i in range(3)]).slope
                    for s in range(3)])
    assert float(slope[2]) == pytest.approx(want, abs=1e-4)
    assert float(_row(lines, "| - content_chance")[2]) == pytest.approx(0.11, abs=1e-4)
    assert _row(lines, "| - gap's `rollout_box_mass`")[2].strip() == "+0.0100"  # the same by seed: no spread
    assert contrast_metric(names) == "top1 on d256 - top1 on d0"
    sd = np.std(per_seed, ddof=1)  # 0.0058: 5 seeds reach an MDE of 0.0097, 4 only 0.0123
    assert f"per-seed sd of {sd:.5f}, 5 seeds give an MDE of at most the gain of interest 0.01" in "\n".join(lines)
    noisy = {**results, ("rollout", 2, "d256"): {"metrics": {**results["rollout", 2, "d256"]["metrics"], "top1": 0.7}}}
    text = "\n".join(dose_section("gap", "rollout", names, [0, 1, 2], noisy))
    assert "even 12 seeds give an MDE of only" in text


def test_dose_series_by_hand():
    """The dose figure's values: per dose each seed's rollout - gap top-1, and each map's object mass per seed; a
    mass one seed did not record at one dose is left out, not drawn from the others."""
    names, seeds = ["d0", "d256"], [0, 1]
    top1 = {("gap", 0): (0.50, 0.60), ("rollout", 0): (0.52, 0.61),
            ("gap", 1): (0.40, 0.45), ("rollout", 1): (0.43, 0.44)}
    results = {(a, s, n): {"metrics": {"top1": top1[a, s][i], "pooling_object_mass": 0.4 + 0.1 * s + 0.01 * i,
                                       "rollout_box_mass": 0.3 + 0.01 * i, "content_chance": 0.8 - 0.5 * i,
                                       "position_prior_mass": 0.42, "pooling_fixed_object_mass": 0.33}}
               for (a, s) in top1 for i, n in enumerate(names)}
    gains, masses = dose_series("gap", "rollout", names, seeds, results)
    assert gains == {"d0": pytest.approx([0.02, 0.03]), "d256": pytest.approx([0.01, -0.01])}
    assert list(masses) == ["rollout pooling weights", "gap backbone's post-hoc rollout map",
                            "rollout's mean weights as one fixed map", "position prior (mean object coverage)",
                            "content chance (avoids flat fill only)"]
    assert masses["rollout pooling weights"] == {"d0": pytest.approx([0.4, 0.5]), "d256": pytest.approx([0.41, 0.51])}
    assert masses["gap backbone's post-hoc rollout map"]["d256"] == pytest.approx([0.31, 0.31])
    assert masses["content chance (avoids flat fill only)"]["d256"] == pytest.approx([0.3, 0.3])
    del results["rollout", 1, "d256"]["metrics"]["position_prior_mass"]
    assert "position prior (mean object coverage)" not in dose_series("gap", "rollout", names, seeds, results)[1]


def test_an_interval_end_stays_on_its_side_of_a_boundary_and_one_dose_gains():
    """A committed case: rollout's object mass minus the gap backbone's rollout map, [-0.0247, -0.000013] over two
    seeds, "looks elsewhere" by the exact ends; at 4 decimals the upper end would print as -0.0000 and the printed
    interval would read "open". A difference at one dose is labelled *gains*, the interaction and trend *grow*."""
    m, high = -0.0123, -0.000013
    delta = (high - m) / sps.t.ppf(0.975, 1)  # two seeds m -/+ delta: the interval is m -/+ t * delta
    diffs = {0: 0.0050, 1: 0.0051}  # rollout - gap top-1 at d0: a small positive interval, below interest
    results = {}
    for s, v in enumerate((m - delta, m + delta)):
        for n in ("d0", "d256"):
            results["gap", s, n] = {"metrics": {"top1": 0.5, "rollout_box_mass": 0.43}}
            results["rollout", s, n] = {"metrics": {"top1": 0.5 + diffs[s], "pooling_object_mass": 0.43 + v}}
    lines = dose_section("gap", "rollout", ["d0", "d256"], [0, 1], results)
    cells = _row(lines, "| - gap's `rollout_box_mass`")
    low, high_shown = (float(x) for x in cells[3].strip(" []").split(","))
    assert high_shown < 0 and high_shown == pytest.approx(high, abs=5e-6)
    assert low == pytest.approx(m - (high - m), abs=5e-5)
    assert cells[6].strip() == place_outcome(low, high_shown) == "looks elsewhere"
    at_d0 = _row(lines, "| rollout - gap at d0")
    lo, hi = sps.ttest_1samp(list(diffs.values()), 0.0).confidence_interval(0.95)
    assert 0 < lo and hi < 0.01 and at_d0[6].strip() == "gains, below interest"
    assert _row(lines, "| **primary**")[6].strip() in {"pays", "open", "no gain of interest", "grows, size open",
                                                       "grows, below interest"}


@pytest.fixture(scope="module")
def dose_study(tmp_path_factory) -> tuple[Path, list[Path]]:
    """gap and rollout, two seeds, one epoch on 20 + 20 cluttered sample images, each evaluated at 0 and 16
    fragments."""
    tmp = tmp_path_factory.mktemp("dose")
    doses = [tmp / f"c{k}" for k in (0, 16)]
    for k, folder in zip((0, 16), doses, strict=True):
        make_cluttered("cifar10-sample", folder, ClutterRecipe(fragments=k, seed=0), per_class=2)
    make_cluttered("cifar10-sample", tmp / "mix", ClutterRecipe(fragments=(0, 16), seed=0), per_class=2)
    out = tmp / "study"
    study.main(["--dataset", str(tmp / "mix"), "--also-eval", *map(str, doses), "--primary", "gap:rollout",
                "--epochs", "1", "--seeds", "0", "1", "--arms", "gap", "rollout", "--heatmaps", "0", "--device", "cpu",
                "--output", str(out), "--train-args", "--batch-size 10 --warmup-epochs 0 --no-progress --amp none "
                "--model-kwargs img_size=64 patch_size=8 depth=1"])
    return out, doses


def test_a_study_at_several_doses_reports_the_interaction_of_the_same_models(dose_study):
    out, _ = dose_study
    report = (out / "report.md").read_text().splitlines()
    top1 = {(a, s, d): json.loads((out / f"eval-{d}" / f"{a}-s{s}" / "results.json").read_text())["metrics"]["top1"]
            for a in ("gap", "rollout") for s in (0, 1) for d in ("c0", "c16")}
    per_seed = [(top1["rollout", s, "c16"] - top1["gap", s, "c16"]) - (top1["rollout", s, "c0"] - top1["gap", s, "c0"])
                for s in (0, 1)]
    assert float(_row(report, "| **primary**")[2]) == pytest.approx(np.mean(per_seed), abs=1e-4)
    # The paired table tests the contrast metric as the primary: its Holm cell reads "primary", top-1's a p-value.
    contrast = _row(report, "| top1 on c16 - top1 on c0 | 2 |")  # the paired table's row (the means table's has ±)
    assert float(contrast[2]) == pytest.approx(np.mean(per_seed), abs=1e-4) and contrast[5].strip() == "primary"
    assert _row(report, "| top1 | 2 |")[5].strip() != "primary"
    hits = {}
    for key in top1:
        a, s, d = key
        found = json.loads(gzip.decompress((out / f"eval-{d}" / f"{a}-s{s}" / "predictions.json.gz").read_bytes()))
        hits[key] = [int(p == y) for p, y in zip(found["predicted"]["top1"], found["label"], strict=True)]
    per_image = [sum((hits["rollout", s, "c16"][i] - hits["gap", s, "c16"][i])
                     - (hits["rollout", s, "c0"][i] - hits["gap", s, "c0"][i]) for s in (0, 1)) / 2
                 for i in range(len(hits["gap", 0, "c0"]))]
    line = next(line for line in report if line.startswith("Image-level"))
    assert f"the per-image interaction is {np.mean(per_image):+.4f}" in line
    assert "## Dose" in report and any(line.startswith("| - position_prior_mass") for line in report)
    assert "![rollout - gap and object masses at each dose](dose.png)" in report
    assert (out / "dose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
