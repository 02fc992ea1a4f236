"""Statistics for comparing runs, as pure functions: paired-by-seed t-intervals, McNemar's per-image test,
Holm's correction and the minimum detectable effect.

Two sources of uncertainty are treated separately. Training seeds: runs of two arms that share a seed are
paired and the per-seed differences get a one-sample t-interval (:func:`paired_delta`). Test images: for fixed
trained models, per-image correctness is compared with McNemar's test (:func:`mcnemar`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps
from scipy.optimize import brentq

__all__ = ["ALPHA", "POWER", "McNemar", "TInterval", "holm", "mcnemar", "mcnemar_mid_p",
           "min_detectable_effect", "paired_delta", "seeds_for_mde", "t_interval"]

ALPHA = 0.05  # two-sided level of every interval and test (95% confidence)
POWER = 0.8  # power of the minimum detectable effect


@dataclass(frozen=True)
class TInterval:
    """Mean of ``n`` values with its t-interval, the two-sided p-value against 0 and the minimum detectable
    effect. With one value only ``mean`` is known; with zero spread the interval is the point and p is undefined."""

    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None
    p: float | None
    mde: float | None


def min_detectable_effect(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """Smallest true mean difference a two-sided one-sample (paired) t-test of level ``alpha`` detects with
    probability ``power`` from ``n`` pairs whose differences have standard deviation ``sd``: the exact solution
    under the noncentral t distribution (the usual ``(t_{1-alpha/2} + t_{power}) sd / sqrt(n)`` shortcut gives
    power 0.77, not 0.8, at n = 3). None for n < 2 (no spread to scale by)."""
    if n < 2:
        return None
    df, se = n - 1, sd / math.sqrt(n)
    if se == 0.0:
        return 0.0
    crit = sps.t.ppf(1 - alpha / 2, df)

    def shortfall(nc: float) -> float:
        return float(sps.nct.sf(crit, df, nc) + sps.nct.sf(crit, df, -nc)) - power  # both tails, by symmetry

    shortcut = crit + sps.t.ppf(power, df)  # within 15% of the solution for n >= 2
    return float(brentq(shortfall, 0.5 * shortcut, 4 * shortcut, xtol=1e-12) * se)


def seeds_for_mde(sd: float, target: float, most: int) -> int | None:
    """The fewest seeds (2 to ``most``) whose :func:`min_detectable_effect` at per-seed spread ``sd`` is at most
    ``target``: how many seeds a study plans from the spread of its first ones. None when ``most`` fall short."""
    return next((n for n in range(2, most + 1) if min_detectable_effect(sd, n) <= target), None)


def t_interval(values: Sequence[float]) -> TInterval:
    """Student t summary of ``values``: mean, sample sd, the ``1 - ALPHA`` interval
    ``mean ± t_{1-ALPHA/2, n-1} sd / sqrt(n)``, two-sided p-value of mean = 0, and the minimum detectable effect."""
    x = np.asarray(values, dtype=np.float64)
    n = int(x.size)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(x.mean())
    if n < 2:
        return TInterval(n, mean, None, None, None, None, None)
    sd = float(x.std(ddof=1))
    mde = min_detectable_effect(sd, n)
    if sd == 0.0:
        return TInterval(n, mean, 0.0, mean, mean, None, mde)
    se = sd / math.sqrt(n)
    half = float(sps.t.ppf(1 - ALPHA / 2, n - 1)) * se
    p = float(2 * sps.t.sf(abs(mean) / se, n - 1))
    return TInterval(n, mean, sd, mean - half, mean + half, p, mde)


def paired_delta(base: Sequence[float], other: Sequence[float]) -> TInterval:
    """Paired t summary of ``other - base`` (paired by position, e.g. by seed); the p-value of
    ``scipy.stats.ttest_rel(other, base)``."""
    if len(base) != len(other):
        raise ValueError(f"paired samples differ in length: {len(base)} vs {len(other)}")
    return t_interval(np.asarray(other, dtype=np.float64) - np.asarray(base, dtype=np.float64))


@dataclass(frozen=True)
class McNemar:
    """Per-image comparison of two classifiers on the same images: ``base_only`` images only the base got
    right, ``other_only`` only the other; ``delta`` = accuracy(other) - accuracy(base); ``p`` the mid-p value."""

    n: int
    base_only: int
    other_only: int
    delta: float
    p: float


def mcnemar_mid_p(b: int, c: int) -> float:
    """Two-sided mid-p McNemar test of ``b`` vs ``c`` discordant pairs: with m = min(b, c) and
    X ~ Binomial(b + c, 1/2), p = 2 (P(X < m) + P(X = m) / 2), capped at 1 (Fagerland et al. 2013: closer
    to the nominal level than the exact test, which doubles P(X <= m)). No discordant pairs gives 1."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b}, {c}")
    n, m = b + c, min(b, c)
    if n == 0:
        return 1.0
    return float(min(1.0, 2 * (sps.binom.cdf(m - 1, n, 0.5) + 0.5 * sps.binom.pmf(m, n, 0.5))))


def mcnemar(base_correct: Sequence[bool] | np.ndarray, other_correct: Sequence[bool] | np.ndarray) -> McNemar:
    """McNemar's mid-p test on paired per-image correctness (the pairs of several seeds concatenated pool them:
    each (seed, image) pair counts once)."""
    a = np.asarray(base_correct, dtype=bool)
    o = np.asarray(other_correct, dtype=bool)
    if a.shape != o.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"need two equal-length non-empty 1-D correctness vectors, got {a.shape} and {o.shape}")
    b, c = int((a & ~o).sum()), int((~a & o).sum())
    return McNemar(int(a.size), b, c, (c - b) / a.size, mcnemar_mid_p(b, c))


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input order; None entries
    (no test) are skipped and stay None. With m tests sorted p_(1) <= ... <= p_(m):
    adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(tested)
    adjusted: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted
