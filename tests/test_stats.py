"""harness.stats against textbook numbers, closed forms worked by hand and scipy; harness.compare's use of it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from harness import compare, stats
from timm_rollout.errors import UserError

# Student's sleep data (Cushny & Peebles 1905): extra hours of sleep under two drugs, the same 10 patients.
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_paired_delta_gives_the_textbook_sleep_interval():
    """The classic paired t-test: mean 1.58, t = 4.0621 on 9 df, p = 0.002833, 95% CI [0.7001, 2.4599]."""
    got = stats.paired_delta(SLEEP_1, SLEEP_2)
    assert got.n == 10 and got.mean == pytest.approx(1.58)
    assert (got.low, got.high) == (pytest.approx(0.7001142, abs=1e-6), pytest.approx(2.4598858, abs=1e-6))
    assert got.p == pytest.approx(0.002833, abs=5e-7)
    assert got.p == pytest.approx(sps.ttest_rel(SLEEP_2, SLEEP_1).pvalue, rel=1e-12)


def test_paired_delta_on_constructed_per_seed_results_matches_the_closed_form():
    """Three seeds, per-seed deltas 0.03, 0.02, 0.01: mean 0.02, sd 0.01. With 2 df the t distribution has a
    closed form, F(t) = 1/2 + t / (2 sqrt(t^2 + 2)), so t_{0.975} = sqrt(1.805 / 0.0975), p = 1 - t / sqrt(t^2 + 2).
    """
    cls = [0.50, 0.52, 0.51]
    rollout = [0.53, 0.54, 0.52]
    got = stats.paired_delta(cls, rollout)
    se = 0.01 / math.sqrt(3)
    t_crit = math.sqrt(1.805 / 0.0975)  # 4.3027, the table value
    t_stat = 0.02 / se
    assert got.mean == pytest.approx(0.02) and got.sd == pytest.approx(0.01)
    assert got.low == pytest.approx(0.02 - t_crit * se, abs=1e-12)
    assert got.high == pytest.approx(0.02 + t_crit * se, abs=1e-12)
    assert (got.low, got.high) == (pytest.approx(-0.004841, abs=1e-6), pytest.approx(0.044841, abs=1e-6))
    assert got.p == pytest.approx(1 - t_stat / math.sqrt(t_stat**2 + 2), abs=1e-12)  # 0.07418
    assert got.p == pytest.approx(sps.ttest_rel(rollout, cls).pvalue, rel=1e-10)
    # MDE: the effect a paired t-test finds with power 0.8, 5.6535 standard errors at n = 3 (the central-t
    # shortcut (4.3027 + sqrt(1.125)) se = 5.3633 se has power 0.77); checked by simulation below.
    assert got.mde == pytest.approx(5.6535 * se, rel=1e-4)


def test_degenerate_samples():
    one = stats.paired_delta([0.5], [0.6])
    assert one.mean == pytest.approx(0.1) and one.low is None and one.p is None and one.mde is None
    assert stats.min_detectable_effect(0.01, 1) is None
    flat = stats.paired_delta([0.5, 0.6], [0.6, 0.7])
    assert flat.low == flat.high == pytest.approx(0.1) and flat.p is None and flat.mde == 0.0
    with pytest.raises(ValueError, match="length"):
        stats.paired_delta([1.0, 2.0], [1.0])


@pytest.mark.parametrize("n", [2, 3, 5, 12])
def test_mde_is_the_effect_detected_with_the_stated_power(n):
    """Simulated paired experiments whose true mean difference is the MDE: a two-sided t-test at level 0.05
    rejects in 80% of them (4 sd of the simulation's binomial error: 0.005 with 100,000 experiments)."""
    sd = 0.01
    mde = stats.min_detectable_effect(sd, n)
    x = np.random.default_rng(0).normal(mde, sd, size=(100_000, n))
    t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
    rejected = np.abs(t) > sps.t.ppf(0.975, n - 1)
    assert rejected.mean() == pytest.approx(0.8, abs=0.005)
    assert stats.min_detectable_effect(2 * sd, n) == pytest.approx(2 * mde, rel=1e-9)  # scales with sd


@pytest.mark.parametrize(("sd", "want"), [(0.0035, 4), (0.0055, 5), (0.02, None)])
def test_seeds_for_mde_is_the_fewest_seeds_whose_simulated_power_reaches_0_8(sd, want):
    """Simulated paired experiments whose true mean difference is the target (0.01): with the seeds returned a
    two-sided t-test at level 0.05 rejects in at least 80% of them, with one seed fewer in under 80%; None when
    even the cap (12) falls short."""
    def power(n: int) -> float:
        x = np.random.default_rng(n).normal(0.01, sd, size=(50_000, n))
        t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
        return float((np.abs(t) > sps.t.ppf(0.975, n - 1)).mean())

    got = stats.seeds_for_mde(sd, 0.01, 12)
    assert got == want
    if want is None:
        assert power(12) < 0.78
    else:
        assert power(want) > 0.82 and power(want - 1) < 0.78


def test_mcnemar_against_a_hand_count():
    base = [1, 1, 1, 0, 0, 0, 1, 0, 1, 1]
    other = [1, 0, 1, 1, 1, 1, 1, 1, 0, 1]
    got = stats.mcnemar(np.array(base, bool), np.array(other, bool))
    # base only: images 1 and 8; other only: images 3, 4, 5, 7.
    assert (got.n, got.base_only, got.other_only) == (10, 2, 4)
    assert got.delta == pytest.approx(0.8 - 0.6)
    # X ~ Bin(6, 1/2): P(X < 2) = 7/64, P(X = 2) = 15/64, mid-p = 2 (7 + 7.5) / 64.
    assert got.p == pytest.approx(29 / 64, abs=1e-12)
    exact = sps.binomtest(2, 6, 0.5).pvalue  # 44/64
    assert got.p == pytest.approx(exact - sps.binom.pmf(2, 6, 0.5), abs=1e-12)


def test_mcnemar_mid_p_edge_cases():
    assert stats.mcnemar_mid_p(0, 0) == 1.0
    assert stats.mcnemar_mid_p(3, 3) == pytest.approx(1.0)
    assert stats.mcnemar_mid_p(0, 5) == pytest.approx(2 * 0.5 / 32)  # 2 * P(X = 0) / 2
    assert stats.mcnemar_mid_p(1, 5) == pytest.approx(2 * (1 + 3) / 64)
    with pytest.raises(ValueError):
        stats.mcnemar([True], [True, False])


def test_holm_against_a_hand_example():
    # sorted: 0.005 x4 = 0.02, 0.01 x3 = 0.03, 0.03 x2 = 0.06, 0.04 x1 = 0.04 -> raised to 0.06 (monotone).
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.01, None, 0.04]) == [pytest.approx(0.02), None, pytest.approx(0.04)]
    assert stats.holm([0.6, 0.5]) == pytest.approx([1.0, 1.0])
    assert stats.holm([]) == []


# harness.compare on constructed per-seed results: pairing by seed, the textbook interval, Holm, McNemar pooled.

CLS_TOP1 = {0: 0.50, 1: 0.52, 2: 0.51, 3: 0.90}  # seed 3 has no rollout partner
ROLLOUT_TOP1 = {2: 0.52, 0: 0.53, 1: 0.54}  # listed in another order: pairing must go by seed


def _result(tmp_path: Path, model: str, seed: int, top1: float, knn: float, correct: list[int]) -> dict:
    folder = tmp_path / f"{model}-s{seed}"
    folder.mkdir()
    labels = [0] * len(correct)
    (folder / "predictions.json").write_text(json.dumps(
        {"index": list(range(100, 100 + len(correct))), "label": labels,
         "predicted": {"top1": [0 if c else 1 for c in correct]}, "top5_hit": [1] * len(correct)}))
    return {"path": str(folder), "model": {"name": model, "architecture": model},
            "data": {"argument": "cifar10", "split": "test"}, "config": {"seed": seed},
            "metrics": {"top1": top1, "knn_loo": knn, "ratio": 1.0 + 0.1 * seed}}


def test_compare_pairs_by_seed_and_gives_the_textbook_interval(tmp_path):
    # Per-image correctness: per seed, cls right / rollout right on 6 images.
    cls_img = {0: [1, 1, 0, 0, 1, 0], 1: [1, 0, 0, 1, 1, 1], 2: [0, 0, 1, 1, 1, 1], 3: [1] * 6}
    rol_img = {0: [1, 1, 1, 1, 0, 0], 1: [1, 1, 1, 1, 1, 1], 2: [1, 1, 1, 1, 1, 0]}
    knn_cls, knn_rol = {0: 0.40, 1: 0.45, 2: 0.41, 3: 0.5}, {0: 0.42, 1: 0.46, 2: 0.47}
    results = [_result(tmp_path, "cls", s, v, knn_cls[s], cls_img[s]) for s, v in CLS_TOP1.items()]
    results += [_result(tmp_path, "rollout", s, v, knn_rol[s], rol_img[s]) for s, v in ROLLOUT_TOP1.items()]
    base, other = compare.summarise(results, ["top1", "knn_loo", "ratio"])
    rows = {r.metric: r for r in compare.compare_groups(base, other, ["top1", "knn_loo", "ratio"])}
    top1 = rows["top1"]
    assert top1.seeds == [0, 1, 2] and top1.delta.mean == pytest.approx(0.02)
    se, t_crit = 0.01 / math.sqrt(3), math.sqrt(1.805 / 0.0975)
    assert (top1.delta.low, top1.delta.high) == (pytest.approx(0.02 - t_crit * se), pytest.approx(0.02 + t_crit * se))
    assert top1.p_holm is None  # primary: not adjusted
    # Hand count over the 18 (seed, image) pairs: cls alone right on 2 (s0 #4, s2 #5), rollout alone on 6
    # (s0 #2 #3, s1 #1 #2, s2 #0 #1); X ~ Bin(8, 1/2): mid-p = 2 (P(X <= 1) + P(X = 2) / 2) = 2 (9 + 14) / 256.
    assert (top1.per_image.n, top1.per_image.base_only, top1.per_image.other_only) == (18, 2, 6)
    assert top1.per_image.delta == pytest.approx(4 / 18)
    assert top1.per_image.p == pytest.approx(2 * (9 + 14) / 256)
    p_knn = sps.ttest_rel([0.42, 0.46, 0.47], [0.40, 0.45, 0.41]).pvalue
    assert rows["knn_loo"].delta.p == pytest.approx(p_knn)
    assert rows["ratio"].delta.p is None  # identical per-seed ratios: zero spread, no test
    assert rows["knn_loo"].p_holm == pytest.approx(p_knn)  # the only secondary test: m = 1
    table = compare.render_comparison(list(rows.values()))
    assert "| top1 | 3 | +0.0200 | [-0.0048, +0.0448] | 0.0742 | primary |" in table


def test_compare_finds_the_training_seed_and_refuses_ambiguous_pairs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_args.json").write_text(json.dumps({"seed": 7}))
    assert compare.run_seed({"model": {"checkpoint": str(run)}, "config": {"seed": 0}}) == 7
    assert compare.run_seed({"model": {"checkpoint": str(run / "model.safetensors")}, "config": {"seed": 0}}) == 7
    assert compare.run_seed({"model": {"checkpoint": str(tmp_path / "gone")}, "config": {"seed": 3}}) == 3
    study = tmp_path / "moved-study"  # the tree moved: <study>/eval/cls-s0 reads the run beside it, <study>/runs
    (study / "runs" / "cls-s0").mkdir(parents=True)
    (study / "runs" / "cls-s0" / "train_args.json").write_text(json.dumps({"seed": 5}))
    assert compare.run_seed({"model": {"checkpoint": str(tmp_path / "gone" / "cls-s0")}, "config": {"seed": 0},
                             "path": str(study / "eval" / "cls-s0")}) == 5
    twice = []
    for i, model in enumerate(("a", "a", "b")):
        (tmp_path / str(i)).mkdir()
        twice.append(_result(tmp_path / str(i), model, 0, 0.5, 0.5, [1]))
    base, other = compare.summarise(twice, ["top1"])
    with pytest.raises(UserError, match="two runs with seed 0"):
        compare.compare_groups(base, other, ["top1"])


def test_compare_refuses_seeds_evaluated_on_different_images(tmp_path):
    """A paired difference between two evaluations of different test subsets (or banks) compares the images."""
    found = []
    for i, (model, subset, bank) in enumerate((("a", "s1", "b1"), ("b", "s1", "b1"), ("c", "s2", "b1"),
                                               ("d", "s1", "b2"))):
        (tmp_path / str(i)).mkdir()
        result = _result(tmp_path / str(i), model, 0, 0.5, 0.5, [1])
        result["data"].update(subset_fingerprint=subset, bank={"fingerprint": bank})
        found.append(result)
    a, b, c, d = compare.summarise(found, ["top1"])
    assert compare.compare_groups(a, b, ["top1"])[0].seeds == [0]
    for other in (c, d):
        with pytest.raises(UserError, match=r"seed 0 of .* was evaluated on different images"):
            compare.compare_groups(a, other, ["top1"])
    found[1]["data"].update(fingerprint="another data set")  # e.g. the clutter-free canvases
    a, b, *_ = compare.summarise(found, ["top1"])
    with pytest.raises(UserError, match=r"evaluated on different data \(another data set or split\) .*same --dataset"):
        compare.compare_groups(a, b, ["top1"])
