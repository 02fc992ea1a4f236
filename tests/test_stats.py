"""harness.stats against textbook numbers, closed forms worked by hand, and scipy's own routes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from harness import stats

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
    # MDE with t_{0.8, 2} = sqrt(1.125) from the same closed form: (4.3027 + 1.0607) * 0.01 / sqrt(3).
    assert got.mde == pytest.approx((t_crit + math.sqrt(1.125)) * se, abs=1e-12)


def test_degenerate_samples():
    one = stats.paired_delta([0.5], [0.6])
    assert one.mean == pytest.approx(0.1) and one.low is None and one.p is None and one.mde is None
    assert stats.min_detectable_effect(0.01, 1) is None
    flat = stats.paired_delta([0.5, 0.6], [0.6, 0.7])
    assert flat.low == flat.high == pytest.approx(0.1) and flat.p is None and flat.mde == 0.0
    with pytest.raises(ValueError, match="length"):
        stats.paired_delta([1.0, 2.0], [1.0])


def test_mde_is_the_effect_detected_with_the_stated_power():
    """Power of the two-sided paired t-test at the MDE, from the noncentral t distribution: close to 0.8
    (the formula is the usual central-t approximation)."""
    sd, n = 0.01, 5
    mde = stats.min_detectable_effect(sd, n)
    crit = sps.t.ppf(0.975, n - 1)
    nc = mde / (sd / math.sqrt(n))
    power = sps.nct.sf(crit, n - 1, nc) + sps.nct.cdf(-crit, n - 1, nc)
    assert 0.75 < power < 0.85


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
